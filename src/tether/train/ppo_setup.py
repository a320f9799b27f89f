"""Everything `tether ppo` builds before its first batch (`build`): models, reward, critic,
optimiser, prompts, the rollout engine, and the settings of the update (`update_spec`), plus the
prompt batch of each step.

The choices live in one place each: the reference in `tether.models.reference`, the critic in
`tether.models.critic.make_critic` (none for the critic-free estimators), the reward source in
`tether.rl.reward`, the engine in `tether.rl.engines.make_engine`, where the KL acts in
`tether.kl.KLPlacement`. Every bad input fails here, before the first batch and before
anything is written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether.choices import KL_CONTROLLERS, RefUpdate, entry
from tether.data.prompts import load_prompts, prompt_indices
from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.critic import ValueModel, make_critic
from tether.models.forward import can_share, share_prompts
from tether.models.limits import check_sampled_models
from tether.models.lora import (
    TRAINED,
    AdapterView,
    LoraSpec,
    adapter_recompute_context,
    check_targets,
)
from tether.models.prepare import (
    disable_dropout,
    enable_gradient_checkpointing,
    freeze,
    fuse_gelu,
)
from tether.models.pretrained import TrainableLM, load_tokenizer, load_trainable_lm, policy_eos_ids
from tether.models.reference import check_reference, reference_model
from tether.models.reward_model import position_limit, shared_reward_model
from tether.rl.anchor import Anchor, adapter_params, add_anchor_adapter
from tether.rl.engines import RolloutEngine, ahead, check_engine_settings, make_engine
from tether.rl.evaluation import EVAL_SEED_OFFSET, Evaluation, eval_inputs
from tether.rl.reward import Reward, wiring
from tether.rl.reward.functions import RewardFunctions
from tether.rl.roles import Roles
from tether.rl.sources import (
    RolloutSource,
    longest_prompt,
    make_source,
)
from tether.rl.update import UpdateSpec
from tether.run.config import section
from tether.run.distributed import Dist
from tether.run.launch import join
from tether.run.optim import StepCounter, make_lr_schedule, make_optimizer
from tether.run.rundir import announce
from tether.run.slicing import micro_rows
from tether.run.threads import use_threads
from tether.train.ppo_config import PPOConfig


@dataclass
class Setup:
    dist: Dist  # this process's rank and world size (one process: rank 0 of 1)
    roles: Roles  # policy and critic under one DDP/FSDP2 wrapper (tether.rl.roles)
    tokenizer: object
    policy: nn.Module
    reference: nn.Module
    critic: nn.Module | None  # None for the critic-free advantage estimators
    lm: TrainableLM  # the policy and, with LoRA, the PeftModel that holds every role's adapter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: kl_lib.KLController
    # the model behind the prompts' reward (`source.reward`), when it is one
    reward_model: nn.Module | None
    gold: Reward | None
    # What TRL-style reward functions read as `trainer_state` (the loop sets global_step), or
    # None without reward functions
    reward_functions: RewardFunctions | None
    eos_token_ids: list[int]
    n_rows: int  # rows of the prompt file
    eval: Evaluation | None  # the held-out evaluation (None without --eval-prompts)
    spec: UpdateSpec  # what steps 2-4 read (update_spec)
    engine: RolloutEngine  # who samples (--engine), synced after every update
    steps: StepCounter  # the policy's version: optimizer steps taken by this process
    # where a batch's rows come from: prompts (`PromptSource`: their texts, ids and reward), or
    # episodes
    source: RolloutSource
    # the KL's anchor when it moves (--ref-update) or is not the start (--teacher), with the start
    # it is measured from; None for the frozen SFT model, which a plain batch never asks about
    anchor: Anchor | None


def update_spec(cfg: PPOConfig, d: Dist) -> UpdateSpec:
    """The settings of steps 2-4 (tether.rl.update): the config's fields by name, and this
    rank's rows per forward (derived: --micro-batch-size, or its share of a minibatch)."""
    return section(UpdateSpec, cfg, micro_rows=micro_rows(cfg.micro_batch_size,
                                                          cfg.minibatch_size, d))


def kl_controller(cfg: PPOConfig) -> kl_lib.KLController:
    """The controller --kl-ctl names (tether.choices.KL_CONTROLLERS), from its options."""
    entry(KL_CONTROLLERS, cfg.kl_ctl, "KL controller")
    if cfg.kl_ctl == "adaptive":
        return kl_lib.AdaptiveKL(cfg.beta, cfg.kl_target, cfg.kl_horizon, cfg.kl_max_error)
    if cfg.kl_ctl == "annealed":
        return kl_lib.AnnealedKL(cfg.beta, cfg.beta_end, cfg.anneal_batches or cfg.n_batches,
                                 cfg.anneal_shape)
    return kl_lib.FixedKL(cfg.beta)


def check_world(cfg: PPOConfig, d: Dist) -> None:
    """The global batch must split evenly over the ranks: whole groups of samples per rank, and
    each minibatch's share a whole number of micro-batches (`--micro-batch-size` is per rank)."""
    world = d.world_size
    if world == 1:
        return
    if cfg.batch_size % world or (cfg.batch_size // world) % cfg.samples_per_prompt:
        raise TetherError(f"--batch-size {cfg.batch_size} must split over {world} processes in "
                          f"whole groups of --samples-per-prompt {cfg.samples_per_prompt}; use a "
                          f"multiple of {world * cfg.samples_per_prompt}")
    share = cfg.minibatch_size // world
    if cfg.minibatch_size % world or (cfg.micro_batch_size and share % cfg.micro_batch_size):
        raise TetherError(f"each minibatch of {cfg.minibatch_size} rows must split over {world} "
                          f"processes in whole micro-batches of --micro-batch-size "
                          f"{cfg.micro_batch_size or share}; change --batch-size, "
                          "--num-minibatches or --micro-batch-size")


def build(cfg: PPOConfig, reward_fn=None, gold_fn=None, env=None) -> Setup:
    """Load and check everything; any bad input fails here, before the first batch. With
    --max-staleness the generator process starts first, so that its imports overlap the
    loading (`tether.rl.engines.ahead.launch`); a failed build ends it."""
    if cfg.max_staleness:
        ahead.warn(cfg)
    launched = (ahead.launch(ahead.split_threads(cfg.threads, cfg.generator_threads, True)[1])
                if cfg.max_staleness else None)
    try:
        return _build(cfg, reward_fn, gold_fn, env, launched)
    except BaseException:
        if launched is not None:
            launched.close()
        raise


def _build(cfg: PPOConfig, reward_fn, gold_fn, env, launched: ahead.Launched | None) -> Setup:
    """`build`'s work, the generator process (if any) already `launched`."""
    for name in ("policy", "prompts"):
        if not getattr(cfg, name):
            raise TetherError(f"--{name} is required")
    # What needs no model comes first, cheapest first: a bad flag, function, file or path fails
    # in seconds, before anything large loads.
    user = wiring.user_code(cfg, reward_fn, gold_fn, env, training=True)
    torch.manual_seed(cfg.seed)  # the same on every rank: FSDP2 relies on equal initial weights
    d = join(cfg, cfg.batch_size)  # under torchrun: this rank and its device
    check_world(cfg, d)
    device = d.device
    tokenizer = load_tokenizer(cfg.policy, trust_remote_code=cfg.trust_remote_code)
    prompts, prompt_ids, rows, eval_ids = _prompt_rows(cfg, tokenizer)
    lora = _config_checks(cfg, tokenizer, {cfg.prompts: prompt_ids, cfg.eval_prompts: eval_ids},
                          device)
    # every endpoint answers before weights load
    served = wiring.remote(cfg, tokenizer, (cfg.prompts, cfg.eval_prompts))
    lm, reference, rewards, critic = _models(cfg, tokenizer, lora, device, user, served)
    policy = lm.model
    anchor = _anchor(cfg, lm, reference, tokenizer, device)
    replica = copy.deepcopy((policy, lm.peft)) if cfg.max_staleness and d.fsdp else None  # _engine
    # One wrapper for the trainable roles; the optimizer after it (FSDP2 replaces the parameters
    # with sharded ones). The optimizer and schedule of every stage; a PPO step is one batch.
    roles = _roles(policy, critic, d, reference, rewards.model,
                   anchor.start if anchor is not None else None)
    optimizer = make_optimizer([m for m in (policy, critic) if m is not None], cfg.lr,
                               cfg.weight_decay)
    scheduler = make_lr_schedule(optimizer, cfg.n_batches, cfg.warmup_batches, cfg.lr_schedule)
    # Stop on every EOS the tokenizer and model declare (load_tokenizer made pad distinct).
    eos = policy_eos_ids(tokenizer, policy, cfg.policy)
    # The one helper that builds every held-out evaluation's inputs (`tether eval` uses it too).
    held_out = (eval_inputs(tokenizer, cfg.eval_prompts, eos, cfg)
                if cfg.eval_prompts and not cfg.episodic else None)
    # The engine on the policy as prepared (`_engine`; vLLM gathers FSDP2 shards at each sync,
    # the native one samples inside the wrapper). An episode's context fits the policy's positions.
    limit = position_limit(lm.model.config, tokenizer) if cfg.episodic else None
    steps = StepCounter(optimizer)
    engine = _engine(cfg, lm, roles, steps, launched, replica, longest_prompt(
        cfg, prompt_ids + (held_out.prompt_ids if held_out else []), limit))
    reward, score_ahead = _loop_reward(cfg, roles, rewards.reward, rewards.model)

    def source(texts: list[str], ids: list[list[int]], table: list[dict], name: str,
               env_seed_base: int | None = None):
        return make_source(cfg, engine, tokenizer, prompts=texts, prompt_ids=ids, rows=table,
                           reward=reward if reward is not None else rewards.functions,
                           env=user.env, tools=user.tools, eos_token_ids=eos, device=device,
                           source_name=name, context_limit=limit, env_seed_base=env_seed_base,
                           score_ahead=score_ahead)
    return Setup(dist=d, roles=roles, tokenizer=tokenizer, policy=policy,
                 reference=reference, critic=critic, lm=lm, optimizer=optimizer,
                 scheduler=scheduler, kl_ctl=kl_controller(cfg),
                 reward_model=rewards.model, gold=rewards.gold,
                 reward_functions=rewards.functions, eos_token_ids=eos,
                 n_rows=len(rows), eval=_evaluation(cfg, source, held_out),
                 spec=update_spec(cfg, d), engine=engine, steps=steps,
                 anchor=anchor,
                 source=source(prompts, prompt_ids, rows, cfg.prompts))


def _roles(policy: nn.Module, critic: nn.Module | None, d: Dist, reference: nn.Module,
           reward_model: nn.Module | None, start: nn.Module | None) -> Roles:
    """The trainable roles under one wrapper, with the frozen models that own weights beside
    them (the reference, a reward model, the start of an anchor that is not it: FSDP2 shards
    them alike, tether.rl.roles); a view of the LoRA shared base owns none (its weights are the
    policy's)."""
    frozen = {"reference": reference, "reward": reward_model, "start": start}
    roles = Roles(policy, critic, d, {k: m for k, m in frozen.items()
                                      if m is not None and any(True for _ in m.parameters())})
    if not can_share(policy):  # checkpointed or sharded: the frozen models score as it does
        for model in (reference, start):
            if model is not None:
                share_prompts(model, False)
    return roles


def _anchor(cfg: PPOConfig, lm: TrainableLM, reference: nn.Module, tokenizer, device
            ) -> Anchor | None:
    """The KL's anchor (`reference`) when it is not the start (a teacher, a reference that moves
    by --ref-update), with the start frozen beside it for the metrics' KL to the SFT model
    (tether.rl.anchor; with LoRA the base and starting adapter, no copy of the weights); None
    for the frozen SFT model."""
    update = RefUpdate.parse(cfg.ref_update)
    if not (cfg.teacher or update.moves):
        return None
    start = fuse_gelu(reference_model(lm, "", tokenizer, cfg.dtype)).to(device)
    if not update.moves:  # a teacher: fixed
        return Anchor(lambda: ({}, {}), start, update)
    if lm.peft is None:
        policy = lm.model
        return Anchor(lambda: (dict(reference.named_parameters()), dict(policy.named_parameters())),
                      start, update, cfg.ref_reset_optimizer)
    # LoRA: the reference moves as an adapter of its own, a copy of the trained one at the start
    # (the base's function when that starts at zero); the view `reference` now runs it
    adapter = reference.adapter = add_anchor_adapter(lm.peft, TRAINED)
    return Anchor(lambda: (adapter_params(lm.peft, adapter), adapter_params(lm.peft, TRAINED)),
                  start, update, cfg.ref_reset_optimizer)


def _evaluation(cfg: PPOConfig, source, held_out) -> Evaluation | None:
    """The held-out evaluation (None without --eval-prompts): the same kind of source as
    training's (`source(texts, ids, rows, name, env_seed_base)`), on the held-out rows, sampled
    from a stream of its own (`held_out`: their encoding, for prompts answered once)."""
    if not cfg.eval_prompts:
        return None
    table, seed = load_rows(cfg.eval_prompts), cfg.seed + EVAL_SEED_OFFSET
    return Evaluation(source(held_out.prompts if held_out else [],
                             held_out.prompt_ids if held_out else [], table, cfg.eval_prompts,
                             seed), len(table), cfg.batch_size, seed)


def _models(cfg: PPOConfig, tokenizer, lora: LoraSpec, device: torch.device,
            user: wiring.UserCode, served: Reward | None
            ) -> tuple[TrainableLM, nn.Module, wiring.Rewards, nn.Module | None]:
    """The policy (dropout off, fused GELU, eval mode, on `device`), its reference, the rewards
    (a LoRA reward model on the policy's base joins it as one more adapter) and the critic (none
    for the critic-free estimators), loaded in this order: the copies each makes of another (the
    reference of the policy, the critic of the reward model) come before gradient
    checkpointing, which wraps the trained trunks alone."""
    lm = load_trainable_lm(cfg.policy, tokenizer, lora, cfg.dtype, cfg.trust_remote_code)
    policy = lm.model
    # Dropout off and eval mode throughout: rollout and update forwards must agree exactly.
    disable_dropout(policy)
    fuse_gelu(policy)  # the same function, faster: torch's fused kernel for the tanh GELU
    policy.eval().to(device)
    use_threads(ahead.split_threads(cfg.threads, cfg.generator_threads, cfg.max_staleness > 0)[0],
                policy, device)  # and [1]: a generator's (--max-staleness)
    anchor, what = cfg.anchor  # --teacher, --ref-model or the policy's start
    reference = fuse_gelu(reference_model(lm, anchor, tokenizer, cfg.dtype, cfg.trust_remote_code,
                                          what)).to(device)
    shared = (shared_reward_model(lm, cfg.reward_model, tokenizer, cfg.trust_remote_code)
              if cfg.reward_model and served is None and not cfg.episodic else None)
    rewards = wiring.build(cfg, user, tokenizer, device, served=served, chunk=cfg.micro_batch_rows,
                           prompt_files=(cfg.prompts, cfg.eval_prompts), max_steps=cfg.n_batches,
                           shared=freeze(fuse_gelu(shared), device) if shared is not None else None)
    critic = make_critic(cfg.critic if cfg.uses_critic else None, lm, lora, rewards.critic_init,
                         cfg.reward_model)
    critic = critic.to(device) if critic is not None else None
    if cfg.gradient_checkpointing:  # the trained trunks only, after the copies made above
        _checkpoint_trunks(lm, critic)
    return lm, reference, rewards, critic


def _loop_reward(cfg: PPOConfig, roles: Roles, reward: Reward | None,
                 reward_model: nn.Module | None) -> tuple[Reward | None, bool]:
    """(the reward as the loop calls it, whether batches sampled ahead are scored in the
    background too). A reward model runs inside the wrapper (under FSDP2 every rank calls it
    alike); functions and a server need none. Those that run off the main thread anyway (the
    pool's workers, a server) score the batches sampled ahead in the background
    (`PromptsScoredAhead`); a function called directly stays on the main thread."""
    if reward_model is not None:
        return roles.scorer(reward), False
    off_main_thread = bool(cfg.reward_url) or getattr(reward, "pool", None) is not None
    return reward, bool(cfg.max_staleness and reward is not None and off_main_thread)


def _engine(cfg: PPOConfig, lm: TrainableLM, roles: Roles, steps: StepCounter,
            launched: ahead.Launched | None, replica: tuple | None, longest: int) -> RolloutEngine:
    """Who samples: the engine --engine names, on the policy as prepared; with --max-staleness
    a copy of the policy ahead of the trainer, in a second process (`tether.rl.engines.ahead`,
    `launched` already), whose versions `steps` counts. Under FSDP2 it starts on `replica`, the
    copy of the policy made before the wrapper sharded it (a sharded module cannot be copied
    whole); the spawn moves the copy's tensors into memory the generator shares, so the trainer
    holds no second copy once it has started."""
    if cfg.max_staleness:
        threads = ahead.split_threads(cfg.threads, cfg.generator_threads, True)[1]
        return ahead.start(cfg, lm.model, lm.peft, steps, threads, longest, roles.dist.device,
                           replica, launched, keep=cfg.batches_ahead + 1)  # for checkpoints
    return make_engine(cfg, lm.model, peft=lm.peft, d=roles.dist, run_model=roles.run_policy,
                       longest_prompt=longest)


def _config_checks(cfg: PPOConfig, tokenizer, prompt_sets: dict[str, list[list[int]]],
                   device) -> LoraSpec:
    """What the models' configs (config.json, tokenizers) alone can refuse, before any weights
    load: the reference's vocabulary, then a reward model or classifier as the policy or
    reference and samples longer than a model that reads them can take (`check_sampled_models`),
    the LoRA targets, the engine's settings; returns the policy's LoRA settings."""
    anchor, what = cfg.anchor
    check_reference(anchor, tokenizer, cfg.trust_remote_code, what)
    models = [(cfg.policy, "--policy", "")] + ([(anchor, "--teacher" if cfg.teacher else
                                                 "--ref-model", "")] if anchor else [])
    check_sampled_models(models, cfg.reward_model, prompt_sets, max_prompt_len=cfg.max_prompt_len,
                         max_new_tokens=cfg.max_new_tokens, episodic=cfg.episodic,
                         trust_remote_code=cfg.trust_remote_code)
    lora = LoraSpec.from_config(cfg)
    check_targets(cfg.policy, lora, cfg.trust_remote_code)
    if not cfg.episodic:  # an episode's length is bounded by the model: checked at the start
        check_engine_settings(cfg, cfg.policy,
                              longest_prompt=longest_prompt(cfg, prompt_sets[cfg.prompts]),
                              device=device, trust_remote_code=cfg.trust_remote_code)
    return lora


def _prompt_rows(cfg: PPOConfig, tokenizer
                 ) -> tuple[list[str], list[list[int]], list[dict], list[list[int]]]:
    """(prompt texts, their ids, the rows, the eval prompts' ids): the prompt file encoded by the
    rule every stage uses, or, for environments, its rows as they are (any columns: reset() reads
    them). The eval prompts are checked now, and encoded for the run once the EOS set is known."""
    rows = load_rows(cfg.prompts)
    if not rows:
        raise TetherError(f"--prompts {cfg.prompts} holds no rows; give at least one")
    if cfg.episodic:
        if cfg.eval_prompts and not load_rows(cfg.eval_prompts):
            raise TetherError(f"--eval-prompts {cfg.eval_prompts} holds no rows; give at least one")
        return [], [], rows, []
    announce(f"{cfg.STAGE} {cfg.run_name}: encoding {len(rows)} prompts of {cfg.prompts}")
    prompts, prompt_ids = load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)
    eval_ids = (load_prompts(cfg.eval_prompts, tokenizer, cfg.max_prompt_len)[1]
                if cfg.eval_prompts else [])
    return prompts, prompt_ids, rows, eval_ids


def _checkpoint_trunks(lm: TrainableLM, critic: nn.Module | None) -> None:
    """Gradient checkpointing on the trained trunks. With LoRA the critic's trunk is the policy's
    base under another adapter: one call covers both, and each layer is recomputed under the
    adapter it ran with. A shared critic's head reads the policy's trunk."""
    recompute = adapter_recompute_context(lm.peft) if lm.peft is not None else None
    enable_gradient_checkpointing(lm.model, recompute)
    if isinstance(critic, ValueModel) and not isinstance(critic.backbone, AdapterView):
        enable_gradient_checkpointing(critic)


def batch_rows(setup: Setup, cfg: PPOConfig, batch: int, round_: int = 0) -> list[int]:
    """The prompt rows of rollout batch `batch`, each repeated `samples_per_prompt` times in
    consecutive rows (the groups rloo and grpo compare): the whole global batch, on every rank.

    `round_` j >= 1: the batch's j-th refill under --dynamic-sampling, drawn from the prompt
    stream of another seed at the same position, so it too is a pure function of (seed, batch)
    and a resumed run draws what the uninterrupted one did."""
    seed = cfg.seed if round_ == 0 else cfg.seed + 7_919 * round_
    return [i for i in prompt_indices(setup.n_rows, cfg.prompts_per_batch, seed, batch)
            for _ in range(cfg.samples_per_prompt)]
