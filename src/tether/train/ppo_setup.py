"""Everything `tether ppo` needs before its loop: models, reward, critic, optimiser, prompts.

Also the small helpers the loop calls once per batch: the prompt batch, score normalisation,
evaluation on held-out prompts (proxy and gold reward), and the sample table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether.critic import ValueHead, ValueModel
from tether.data import format_prompt, load_rows
from tether.errors import TetherError
from tether.evaluation import evaluate_policy
from tether.models import (
    RewardModel,
    disable_dropout,
    frozen_copy,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
)
from tether.reward_fn import call_reward_function, check_same_vocabulary, load_reward_function
from tether.rollout import Rollout, left_pad
from tether.train.ppo_config import PPOConfig

# reward(prompts, responses, rollout) -> scores [B]
Reward = Callable[[list[str], list[str], Rollout], torch.Tensor]


@dataclass
class Setup:
    device: torch.device
    tokenizer: object
    policy: nn.Module
    reference: nn.Module
    critic: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: object
    reward: Reward
    gold: Callable | None
    eos_token_ids: list[int]
    prompts: list[str]
    prompt_ids: list[list[int]]
    eval_prompts: list[str]
    eval_prompt_ids: list[list[int]]


def _reward_from_model(reward_model: RewardModel, chunk: int) -> Reward:
    @torch.no_grad()
    def reward(prompts, responses, rollout: Rollout) -> torch.Tensor:
        # The reward model reads the policy's own token ids at the last real token (EOS).
        return torch.cat([reward_model.score(rollout.input_ids[i:i + chunk],
                                             rollout.attention_mask[i:i + chunk])
                          for i in range(0, len(rollout), chunk)])
    return reward


def _reward_from_function(fn: Callable, what: str) -> Reward:
    return lambda prompts, responses, rollout: call_reward_function(fn, prompts, responses, what)


def fuse_gelu(model: nn.Module) -> nn.Module:
    """Swap transformers' Python `NewGELUActivation` (GPT-2's tanh GELU, five elementwise kernels
    and as many saved tensors) for `nn.GELU(approximate="tanh")`, the same function in one fused
    kernel (outputs agree to float rounding, ~2e-7). About 3x faster for the activation, forward
    and backward, which is a sizeable share of a small model's step."""
    from transformers.activations import NewGELUActivation

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is NewGELUActivation:
                setattr(module, name, nn.GELU(approximate="tanh"))
    return model


def _frozen(model: nn.Module, device) -> nn.Module:
    disable_dropout(model)
    model.eval().requires_grad_(False)
    return model.to(device)


def load_prompts(source: str, tokenizer, max_len: int) -> tuple[list[str], list[list[int]]]:
    rows = load_rows(source)
    texts, ids = [], []
    for i, row in enumerate(rows):
        if "prompt" not in row and "messages" not in row:
            raise TetherError(f"{source}: row {i} has neither a 'prompt' nor a 'messages' field; "
                              "give one of them per row")
        text = format_prompt(tokenizer, row)
        tokens = tokenizer(text)["input_ids"][-max_len:]  # keep the end, next to the response
        if not tokens:
            raise TetherError(f"{source}: row {i} has an empty prompt; remove it")
        texts.append(text)
        ids.append(tokens)
    return texts, ids


def _reward(cfg: PPOConfig, reward_fn, tokenizer, device, chunk):
    given = [name for name, on in (("a Python reward_fn", reward_fn is not None),
                                   ("--reward-fn", bool(cfg.reward_fn)),
                                   ("--reward-model", bool(cfg.reward_model))) if on]
    if len(given) != 1:
        raise TetherError("give exactly one reward: --reward-model, --reward-fn or a Python "
                          f"reward_fn (got {', '.join(given) if given else 'none'})")
    if cfg.reward_model:
        rm = RewardModel.from_pretrained(cfg.reward_model, dtype=cfg.dtype,
                                         trust_remote_code=cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reward model": (rm.tokenizer, rm.backbone)})
        rm = _frozen(fuse_gelu(rm), device)
        return _reward_from_model(rm, chunk), rm
    fn = reward_fn if reward_fn is not None else load_reward_function(cfg.reward_fn)
    return _reward_from_function(fn, "reward function"), None


def _kl_controller(cfg: PPOConfig):
    if cfg.kl_ctl == "adaptive":
        return kl_lib.AdaptiveKL(cfg.beta, cfg.kl_target, cfg.kl_horizon, cfg.kl_max_error)
    if cfg.kl_ctl == "annealed":
        return kl_lib.AnnealedKL(cfg.beta, cfg.beta_end, cfg.anneal_batches or cfg.n_batches,
                                 cfg.anneal_shape)
    return kl_lib.FixedKL(cfg.beta)


def _lr_lambda(cfg: PPOConfig) -> Callable[[int], float]:
    def factor(k: int) -> float:  # k = batches done
        if k < cfg.warmup_batches:
            return (k + 1) / (cfg.warmup_batches + 1)
        t = (k - cfg.warmup_batches) / max(1, cfg.n_batches - cfg.warmup_batches)
        if cfg.lr_schedule == "linear":
            return max(0.0, 1.0 - t)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
        return 1.0
    return factor


def build(cfg: PPOConfig, reward_fn=None, gold_fn=None) -> Setup:
    """Load and check everything; any bad input fails here, before the first batch."""
    for name in ("policy", "prompts"):
        if not getattr(cfg, name):
            raise TetherError(f"--{name} is required")
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.policy, trust_remote_code=cfg.trust_remote_code)
    policy = load_causal_lm(cfg.policy, tokenizer, cfg.dtype, cfg.trust_remote_code)
    # Dropout off and eval mode throughout: rollout and update forwards must agree exactly.
    disable_dropout(policy)
    fuse_gelu(policy)
    policy.eval().to(device)
    if cfg.ref_model:
        ref_tokenizer = load_tokenizer(cfg.ref_model, trust_remote_code=cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (ref_tokenizer, None)})
        reference = load_causal_lm(cfg.ref_model, ref_tokenizer, cfg.dtype, cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (None, reference)})
    else:
        reference = frozen_copy(policy)
    reference = _frozen(fuse_gelu(reference), device)
    chunk = cfg.batch_size // cfg.num_minibatches
    reward, reward_model = _reward(cfg, reward_fn, tokenizer, device, chunk)
    if gold_fn is None and cfg.gold_fn:
        gold_fn = load_reward_function(cfg.gold_fn)
    gold = _reward_from_function(gold_fn, "gold reward function") if gold_fn else None

    if cfg.critic == "shared":
        hidden = policy.config.get_text_config().hidden_size
        critic = ValueHead(hidden).to(device=device, dtype=next(policy.parameters()).dtype)
    elif reward_model is not None:
        critic = ValueModel.from_reward_model(reward_model).requires_grad_(True)
    else:
        critic = ValueModel.from_causal_lm(policy)
    disable_dropout(critic)
    critic.eval().to(device)

    params = list(policy.parameters()) + list(critic.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))

    prompts, prompt_ids = load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)
    eval_prompts, eval_ids = (load_prompts(cfg.eval_prompts, tokenizer, cfg.max_prompt_len)
                              if cfg.eval_prompts else ([], []))
    eos = {tokenizer.eos_token_id}
    extra = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    eos |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    eos.discard(None)
    eos.discard(tokenizer.pad_token_id)  # pad is never EOS
    if not eos:
        raise TetherError(f"{cfg.policy}: the tokenizer has no EOS token; set one in its config")
    return Setup(device=device, tokenizer=tokenizer, policy=policy, reference=reference,
                 critic=critic, optimizer=optimizer, scheduler=scheduler,
                 kl_ctl=_kl_controller(cfg), reward=reward, gold=gold,
                 eos_token_ids=sorted(eos), prompts=prompts, prompt_ids=prompt_ids,
                 eval_prompts=eval_prompts, eval_prompt_ids=eval_ids)


def prompt_indices(n_prompts: int, batch_size: int, seed: int, batch: int) -> list[int]:
    """Rows of batch `batch`: a stream of seeded per-epoch shuffles, cut into batches.

    A pure function of (seed, batch), so a resumed run sees the prompts an uninterrupted one
    would, and batches may be larger than the prompt set.
    """
    out: list[int] = []
    position = batch * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, n_prompts)
        perm = torch.randperm(n_prompts,
                              generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        take = perm[offset: offset + batch_size - len(out)].tolist()
        out += take
        position += len(take)
    return out


def prompt_batch(setup: Setup, cfg: PPOConfig, batch: int):
    rows = prompt_indices(len(setup.prompts), cfg.batch_size, cfg.seed, batch)
    ids, mask = left_pad([setup.prompt_ids[i] for i in rows], setup.tokenizer.pad_token_id,
                         setup.device)
    return [setup.prompts[i] for i in rows], ids, mask


class ScoreNormalizer:
    """Scores -> (score - mean) / std: per batch, or with running moments over the run (the
    running form is a streaming version of the reward normalisation of Ziegler et al. 2019)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return scores
        if self.mode == "batch":
            return (scores - scores.mean()) / (scores.std(unbiased=False) + 1e-8)
        # Chan et al. parallel update of the running mean and sum of squared deviations.
        n, mean = scores.numel(), scores.mean().item()
        m2 = ((scores - mean) ** 2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta ** 2 * self.count * n / total
        self.count = total
        std = math.sqrt(self.m2 / total) if total > 1 else 1.0
        return (scores - self.mean) / (std + 1e-8)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


def evaluate(setup: Setup, cfg: PPOConfig) -> tuple[dict[str, float], list[dict]]:
    """The held-out evaluation (`tether.evaluation.evaluate_policy`) of the current policy.

    Sampled with the same seed each time, so successive evaluations differ only through the
    policy; returns (metrics, samples).
    """
    return evaluate_policy(setup.policy, setup.reference, setup.tokenizer, setup.eval_prompts,
                           setup.eval_prompt_ids, setup.reward, setup.gold,
                           max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           eos_token_ids=setup.eos_token_ids, batch_size=cfg.batch_size,
                           seed=cfg.seed + 7_919, chunked_lm_head=cfg.chunked_lm_head)


def sample_table(prompts: list[str], responses: list[str], scores: torch.Tensor,
                 n: int = 4) -> str:
    """A markdown table of the first `n` prompts, responses and scores (TensorBoard text)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")[:300]
    lines = ["| prompt | response | score |", "|---|---|---|"]
    lines += [f"| {cell(p)} | {cell(r)} | {float(s):.3f} |"
              for p, r, s in zip(prompts[:n], responses[:n], scores[:n].tolist(), strict=True)]
    return "\n".join(lines)
