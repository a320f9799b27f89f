"""Everything `tether ppo` needs before its loop: models, reward, critic, optimiser, prompts
(`build`), and the small per-batch helpers that need them: the prompt batch, the held-out
evaluation and the sample table. The pieces live by concern: prompts and their order in
`tether.data`, reward sources in `tether.reward_fn`, score normalisation beside the shaping maths
in `tether.advantages`, freezing in `tether.models`, the optimizer in `tether.optim`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether.data.prompts import left_pad, load_prompts, prompt_indices
from tether.errors import TetherError
from tether.models.critic import ValueHead, ValueModel, lora_critic
from tether.models.lora import AdapterView, LoraSpec, adapter_recompute_context, check_targets
from tether.models.prepare import (
    disable_dropout,
    enable_gradient_checkpointing,
    freeze,
    frozen_copy,
    fuse_gelu,
)
from tether.models.pretrained import (
    TrainableLM,
    check_same_vocabulary,
    load_causal_lm,
    load_tokenizer,
    load_trainable_lm,
    policy_eos_ids,
)
from tether.models.reward_model import load_reward_model, shared_reward_model
from tether.models.shared_prompt import can_share, share_prompts
from tether.rl.evaluation import EvalInputs, eval_inputs, evaluate_policy
from tether.rl.rewards import (
    Reward,
    check_one_reward,
    load_reward_function,
    reward_from_function,
    reward_from_model,
)
from tether.rl.roles import Roles, check_world
from tether.run.distributed import Dist
from tether.run.launch import join
from tether.run.optim import make_lr_schedule, make_optimizer
from tether.train.ppo_config import PPOConfig


@dataclass
class Setup:
    device: torch.device
    dist: Dist  # this process's rank and world size (one process: rank 0 of 1)
    roles: Roles  # policy and critic under one DDP/FSDP2 wrapper (ppo_dist.Roles)
    tokenizer: object
    policy: nn.Module
    reference: nn.Module
    critic: nn.Module | None  # None for the critic-free advantage estimators
    lm: TrainableLM  # the policy and, with LoRA, the PeftModel that holds every role's adapter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: kl_lib.KLController
    reward: Reward
    reward_model: nn.Module | None  # the model behind `reward`, when it is one
    gold: Callable | None
    eos_token_ids: list[int]
    prompts: list[str]
    prompt_ids: list[list[int]]
    eval: EvalInputs | None  # the held-out evaluation's inputs (None without --eval-prompts)


def _kl_controller(cfg: PPOConfig):
    if cfg.kl_ctl == "adaptive":
        return kl_lib.AdaptiveKL(cfg.beta, cfg.kl_target, cfg.kl_horizon, cfg.kl_max_error)
    if cfg.kl_ctl == "annealed":
        return kl_lib.AnnealedKL(cfg.beta, cfg.beta_end, cfg.anneal_batches or cfg.n_batches,
                                 cfg.anneal_shape)
    return kl_lib.FixedKL(cfg.beta)


def build(cfg: PPOConfig, reward_fn=None, gold_fn=None) -> Setup:
    """Load and check everything; any bad input fails here, before the first batch."""
    for name in ("policy", "prompts"):
        if not getattr(cfg, name):
            raise TetherError(f"--{name} is required")
    torch.manual_seed(cfg.seed)  # the same on every rank: FSDP2 relies on equal initial weights
    d = join(cfg, cfg.batch_size)  # under torchrun: this rank and its device
    check_world(cfg, d)
    device = d.device
    tokenizer = load_tokenizer(cfg.policy, trust_remote_code=cfg.trust_remote_code)
    # What needs no model first: a bad file or flag fails before anything large loads.
    prompts, prompt_ids = load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)
    if cfg.eval_prompts:  # checked now; encoded for use once the EOS set is known (below)
        load_prompts(cfg.eval_prompts, tokenizer, cfg.max_prompt_len)
    check_one_reward(reward_fn, cfg.reward_fn, cfg.reward_model)
    if reward_fn is None and cfg.reward_fn:
        reward_fn = load_reward_function(cfg.reward_fn)
    if gold_fn is None and cfg.gold_fn:
        gold_fn = load_reward_function(cfg.gold_fn)
    lora = LoraSpec.from_config(cfg)
    check_targets(cfg.policy, lora, cfg.trust_remote_code)
    lm = load_trainable_lm(cfg.policy, tokenizer, lora, cfg.dtype, cfg.trust_remote_code)
    policy = lm.model
    # Dropout off and eval mode throughout: rollout and update forwards must agree exactly.
    disable_dropout(policy)
    fuse_gelu(policy)  # the same function, faster (tether.activations): a small model gains
    policy.eval().to(device)
    if cfg.ref_model:
        ref_tokenizer = load_tokenizer(cfg.ref_model, trust_remote_code=cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (ref_tokenizer, None)})
        reference = load_causal_lm(cfg.ref_model, ref_tokenizer, cfg.dtype, cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (None, reference)})
    elif lm.peft is not None:
        # LoRA: the same base with the adapter off, or the frozen starting adapter; no copy.
        reference = AdapterView(lm.peft, lm.reference_adapter)
    else:
        reference = frozen_copy(policy)
    reference = freeze(fuse_gelu(reference), device)
    reward_model = None
    if cfg.reward_model:
        # A LoRA reward model on the policy's base joins it as one more adapter (no second base).
        reward_model = (shared_reward_model(lm, cfg.reward_model, tokenizer, cfg.trust_remote_code)
                        or load_reward_model(cfg.reward_model, tokenizer, cfg.dtype,
                                             cfg.trust_remote_code))
        reward_model = freeze(fuse_gelu(reward_model), device)
        reward = reward_from_model(reward_model, cfg.micro_batch_rows)
    else:
        reward = reward_from_function(reward_fn, "reward function")
    gold = reward_from_function(gold_fn, "gold reward function") if gold_fn else None

    if not cfg.uses_critic:  # the critic-free estimators: no critic, its memory or optimizer state
        critic = None
    elif cfg.critic == "shared":
        hidden = policy.config.get_text_config().hidden_size
        critic = ValueHead(hidden).to(device=device, dtype=next(policy.parameters()).dtype)
    elif lm.peft is not None:
        critic = lora_critic(lm, lora, reward_model, cfg.reward_model)
    elif reward_model is not None:
        critic = ValueModel.from_reward_model(reward_model).requires_grad_(True)
    else:
        critic = ValueModel.from_causal_lm(policy)
    if critic is not None:
        disable_dropout(critic)
        critic.eval().to(device)
    if cfg.gradient_checkpointing:  # the trained trunks only, after the copies made above
        # With LoRA the critic's trunk is the policy's base under another adapter: one call
        # covers both, and each layer is recomputed under the adapter it ran with.
        recompute = adapter_recompute_context(lm.peft) if lm.peft is not None else None
        enable_gradient_checkpointing(policy, recompute)
        if isinstance(critic, ValueModel) and not isinstance(critic.backbone, AdapterView):
            enable_gradient_checkpointing(critic)  # a shared critic's head reads the policy's trunk

    # One wrapper for the trainable roles; the optimizer after it (FSDP2 replaces the parameters
    # with sharded ones). The optimizer and schedule of every stage; a PPO step is one batch.
    frozen = {"reference": reference} | ({"reward": reward_model} if reward_model else {})
    roles = Roles(policy, critic, d, {k: m for k, m in frozen.items() if _owns_weights(m)})
    if not can_share(policy):  # checkpointed or sharded: the reference scores as it does
        share_prompts(reference, False)
    optimizer = make_optimizer([m for m in (policy, critic) if m is not None], cfg.lr,
                               cfg.weight_decay)
    scheduler = make_lr_schedule(optimizer, cfg.n_batches, cfg.warmup_batches, cfg.lr_schedule)

    # Stop on every EOS the tokenizer and model declare (load_tokenizer made pad distinct).
    eos = policy_eos_ids(tokenizer, policy, cfg.policy)
    # The one helper that builds every held-out evaluation's inputs (`tether eval` uses it too).
    evaluation = eval_inputs(tokenizer, cfg.eval_prompts, eos, cfg) if cfg.eval_prompts else None
    return Setup(device=device, dist=d, roles=roles, tokenizer=tokenizer, policy=policy,
                 reference=reference,
                 critic=critic, lm=lm, optimizer=optimizer, scheduler=scheduler,
                 kl_ctl=_kl_controller(cfg), reward=reward, reward_model=reward_model, gold=gold,
                 eos_token_ids=eos, prompts=prompts, prompt_ids=prompt_ids,
                 eval=evaluation)


def _owns_weights(model: nn.Module) -> bool:
    """False for a role that is a view of the LoRA shared base (its weights are the policy's)."""
    return any(True for _ in model.parameters())


def prompt_batch(setup: Setup, cfg: PPOConfig, batch: int):
    """The prompts of rollout batch `batch`, each repeated `samples_per_prompt` times in
    consecutive rows (the groups rloo and grpo compare), left-padded on the device. The whole
    global batch on every rank, padded to its width: a rank's slice of it has the global width."""
    rows = [i for i in prompt_indices(len(setup.prompts), cfg.prompts_per_batch, cfg.seed, batch)
            for _ in range(cfg.samples_per_prompt)]
    ids, mask = left_pad([setup.prompt_ids[i] for i in rows], setup.tokenizer.pad_token_id,
                         setup.device)
    return [setup.prompts[i] for i in rows], ids, mask


def evaluate(setup: Setup, cfg: PPOConfig) -> tuple[dict[str, float], list[dict]]:
    """The held-out evaluation (`tether.evaluation.evaluate_policy`) of the current policy.

    Sampled with the same seed each time, so successive evaluations differ only through the
    policy; returns (metrics, samples).
    """
    return evaluate_policy(setup.policy, setup.reference, setup.tokenizer, setup.eval,
                           setup.reward, setup.gold, chunked_lm_head=cfg.chunked_lm_head)


def sample_table(prompts: list[str], responses: list[str], scores: torch.Tensor,
                 n: int = 4) -> str:
    """A markdown table of the first `n` prompts, responses and scores (TensorBoard text)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")[:300]
    lines = ["| prompt | response | score |", "|---|---|---|"]
    lines += [f"| {cell(p)} | {cell(r)} | {float(s):.3f} |"
              for p, r, s in zip(prompts[:n], responses[:n], scores[:n].tolist(), strict=True)]
    return "\n".join(lines)
