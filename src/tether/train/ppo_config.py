"""`PPOConfig`: every knob of `tether ppo`, with its default and a one-line help.

Units: a *batch* is one rollout of `batch_size` prompts followed by its PPO epochs; `log_every`,
`save_every`, `eval_every` and `sample_every` count batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from tether.choices import (
    ADVANTAGES,
    IMPORTANCE_LEVELS,
    KL_CONTROLLERS,
    KL_DEFAULTS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RefUpdate,
    kl_allowed,
)
from tether.errors import TetherError
from tether.run.config import (
    EnvOptions,
    RewardOptions,
    RunConfig,
    SamplingOptions,
    check_threads,
    require_positive,
)
from tether.run.scopes import Scope
from tether.train.ppo_scopes import SCOPES

# --dynamic-sampling's most rounds: each costs as much as the batch itself, and a batch that
# needs more has almost no group with differing rewards (verl's DAPO scripts use 10)
MAX_DYNAMIC_ROUNDS = 100


@dataclass(kw_only=True)
class PPOConfig(RunConfig, EnvOptions, SamplingOptions, RewardOptions):
    """PPO maximising R(x, y) - beta * KL(pi || pi_ref), with the KL taken per token."""

    STAGE: ClassVar[str] = "ppo"  # the command; recorded in the run directory
    # (a field redefined for its default without a docstring keeps its base's help)
    SCOPES: ClassVar[dict[str, Scope]] = SCOPES

    run_name: str = "ppo"
    log_every: int = 1
    """PPO batches between metric log lines (metrics.jsonl and the --report-to trackers)."""
    save_every: int = 10
    """PPO batches between checkpoints (0: only the final model)."""

    # ---- models and reward
    policy: str
    """The SFT model to optimise (directory or hub name); also the reference unless --ref-model."""
    ref_model: str = ""
    """Frozen reference for the KL (default: a frozen copy of --policy)."""
    teacher: str = ""
    """A teacher as the KL's anchor (on-policy distillation, docs/ppo.md): the policy samples, the teacher scores every token, and the KL term pulls the policy toward it; it must share the policy's tokenizer; a reward becomes optional."""
    ref_update: str = "none"
    """How the reference moves toward the policy (docs/ppo.md, "Moving references"): none (frozen), reset:N (the policy copied into it every N batches; ProRL), mix:ALPHA,N (ref <- ALPHA * policy + (1 - ALPHA) * ref every N batches; TRL's sync_ref_model), ema:ALPHA (that mix after every batch); objective/kl_sft then logs the KL to the SFT model beside objective/kl."""
    ref_reset_optimizer: bool = False
    """--ref-update reset:N: also clear the optimizer's state (AdamW's moments) at each reset (ProRL)."""
    reward_weights: list[float] = field(default_factory=list)
    """Weights of the --reward-fn functions, in order (empty: 1 each); the score is their weighted sum, a None score left out, as TRL's reward_weights."""
    critic: Literal["separate", "shared"] = "separate"
    """Value model: separate (initialised from the reward model) or shared (a head on the policy)."""

    # ---- prompts and rollout
    prompts: str
    """Training prompts: rows with `prompt` or `messages` (JSONL, JSON, Parquet, CSV, dataset dir)."""
    eval_prompts: str = ""
    """Held-out prompts scored every --eval-every batches (empty: no evaluation)."""
    total_episodes: int = 1024
    """Responses to sample over the run; batches = total_episodes // batch_size."""
    batch_size: int = 32
    """Responses per rollout batch: batch_size / samples_per_prompt prompts, each answered samples_per_prompt times."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (k, consecutive rows); rloo and grpo compare them (k >= 2)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of responses that hit --max-new-tokens without EOS or a stop."""
    overlong_penalty: int = 0
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13): from max_new_tokens - L tokens on, the score loses up to 1, linearly, reaching -1 at max_new_tokens (L tokens; 0: off)."""
    mask_truncated: bool = False
    """Responses that hit --max-new-tokens without EOS or a stop carry no policy loss and count in no denominator (DAPO's overlong filtering; TRL's mask_truncated_completions); the critic still learns from them."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11): drop the groups of --samples-per-prompt responses whose scores are all equal and refill the batch from further prompts, at most this many more rounds of --batch-size responses per batch (100 at most); a batch still short is topped up with dropped groups, with a note saying so (0: off)."""

    # ---- rollout engine (docs/engine.md)
    engine_is_cap: float = 0.0
    """vllm: truncated importance sampling, each token's policy gradient weighted by min(pi_old / pi_engine, C) (0: off; C >= 1, 2 is usual)."""
    engine_mask_kl: float = 0.0
    """vllm: rows whose engine-vs-trainer KL (summed k3, nats) passes this get no policy gradient (0: off)."""
    max_staleness: int = 0
    """Asynchronous generation (docs/engine.md): a copy of the policy in a second process samples later batches while the trainer updates, no token more than this many optimizer steps older than the weights it is trained from, with the decoupled PPO loss (a multiple of the --ppo-epochs x --num-minibatches steps a batch takes; 0: synchronous)."""
    generator_threads: int = 0
    """--max-staleness: the generator process's torch threads (0: half the cores, at least 1; the trainer then takes the rest unless --threads is given)."""

    # ---- reward shaping and the KL penalty
    reward_per_turn: bool = False
    """Environments: each turn's reward on that turn's last token (credit by turn, for gae and reinforce++), instead of the episode's summed reward on its last token; --score-norm and --reward-clip then shape the length penalties alone."""
    kl_in: Literal[tuple(KL_DEFAULTS)] = "reward"
    """Where the KL penalty goes: reward (per-token, -beta*KL, PPO classic) or loss (GRPO-style); never both."""
    kl_estimator: Literal[("auto", *KL_ESTIMATORS)] = "auto"
    """KL estimator (tether.choices.KL_ESTIMATORS); auto = k1 in the reward, k3_ratio in the loss (its gradient is KL(pi || pi_ref)'s; plain k3's is KL(pi_ref || pi)'s)."""
    jsd_beta: float = 0.5
    """--kl-estimator jsd: the generalised Jensen-Shannon divergence's beta, from the forward KL(ref || pi) at 0 to the reverse KL(pi || ref) at 1 (GKD, Agarwal et al. 2024; TRL's beta)."""
    kl_per_token_mean: bool = False
    """KL in the loss, and the surrogate beside it, as token means over the batch (GRPO's form; it changes the objective for responses of different lengths) instead of per-sequence sums averaged over sequences; --loss-aggregation, when given, replaces it."""
    reward_clip: float = 0.0
    """Clip scores to [-c, c] after normalisation (0: off)."""
    score_norm: Literal["none", "batch", "running"] = "none"
    """Normalise scores: per batch, or with running mean/std over the run."""

    # ---- beta controller
    kl_ctl: Literal[tuple(KL_CONTROLLERS)] = "fixed"
    """How beta moves: fixed, adaptive (Ziegler et al. 2019) or annealed."""
    beta: float = 0.05
    """KL coefficient (the start value for adaptive and annealed)."""
    kl_target: float = 6.0
    """Adaptive: target of the batch mean of per-sequence summed KL, in nats."""
    kl_horizon: int = 10000
    """Adaptive: horizon in episodes; larger moves beta more slowly."""
    kl_max_error: float = 0.2
    """Adaptive: clip on the proportional error kl/target - 1."""
    beta_end: float = 0.0
    """Annealed: final beta."""
    anneal_batches: int = 0
    """Annealed: batches over which beta moves to --beta-end (0: the whole run)."""
    anneal_shape: Literal["linear", "cosine"] = "linear"
    """Annealed: schedule shape."""

    # ---- PPO update
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    num_minibatches: int = 1
    """Minibatches per epoch; must divide --batch-size."""
    micro_batch_size: int = 0
    """Rows per forward/backward inside a minibatch, gradients accumulated (0: the whole minibatch; must divide it)."""
    micro_batch_tokens: int = 0
    """Tokens (prompt + response) per forward/backward instead of a row count: rows grouped longest first to fit (a longer row runs alone); 0: --micro-batch-size rows."""
    pack: bool = False
    """Run the update's and the scoring pass's forwards on packed rows: several sequences end to end per row, positions restarting per sequence (no padding; the same numbers)."""
    lr: float = 1e-5
    """Peak learning rate (AdamW) for policy and critic."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """Decay from --lr to 0 over the run, after --warmup-batches."""
    warmup_batches: int = 0
    """Batches of linear learning-rate warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    clip_range: float = 0.2
    """PPO ratio clip epsilon."""
    clip_high: float = 0.0
    """Upper ratio clip epsilon, clip(ratio, 1 - clip_range, 1 + clip_high): DAPO's clip-higher (Yu et al. 2025 use 0.28; TRL's epsilon_high); 0: the same as --clip-range."""
    importance_level: Literal[tuple(IMPORTANCE_LEVELS)] = "token"
    """The ratio per token (PPO), or per response, exp(mean log ratio), shared by its tokens (GSPO, Zheng et al. 2025; use a clip range near 3e-4)."""
    policy_loss: Literal[tuple(POLICY_LOSSES)] = "ppo"
    """ppo: the clipped surrogate; cispo: -sg(min(ratio, 1 + clip_high)) * A * log pi, no token's gradient dropped (MiniMax-M1 2025; TRL's epsilon_high 5.0 = --clip-high 4)."""
    value_clip_range: float = 0.2
    """Value clip, in the units of the value (0: values may not move from the rollout values)."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    advantage: Literal[tuple(ADVANTAGES)] = "gae"
    """Advantage estimator: gae (needs the critic), or critic-free rloo, grpo, reinforce++ (no critic is built)."""
    loss_aggregation: Literal["auto", "token", "sequence", "sum"] = "auto"
    """How the surrogate (and with --kl-in loss the KL term) reduce over tokens: token (token mean over the minibatch; TRL's dapo), sequence (each response's token mean, then the mean over responses; TRL's grpo), sum (per-response sums averaged over responses); auto: token, or with --kl-in loss sum (token with --kl-per-token-mean)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo: divide each group's centred rewards by its std (group), by the std of the batch's rewards (batch; TRL's "batch"), or not (none: Dr. GRPO)."""
    whiten_advantages: Literal["auto", "on", "off"] = "auto"
    """Standardise gae advantages over the batch's real tokens; auto: on with the KL in the reward, off with it in the loss (whitening scales the reward's advantage but not the KL term, moving the optimum)."""
    max_kl: float = 0.0
    """Stop the run (exit 2, checkpoints kept) once a batch's mean sequence KL passes this many nats (0: off)."""
    max_kl_to: Literal["anchor", "sft"] = "anchor"
    """What --max-kl caps: anchor (objective/kl, to the reference or teacher) or sft (objective/kl_sft, to the SFT model, logged with --teacher or a moving --ref-update)."""
    target_kl: float = 0.0
    """Trust-region guard: stop a batch's epochs once its approx KL to the rollout policy passes this (0: off)."""

    # ---- evaluation and samples
    eval_every: int = 0
    """Batches between evaluations on --eval-prompts (0: only at the end, when eval prompts are given)."""
    sample_every: int = 10
    """Batches between tables of sample prompts and responses for the --report-to trackers (TensorBoard text; 0: off)."""

    @property
    def n_batches(self) -> int:  # derived
        return self.total_episodes // self.batch_size

    @property
    def prompts_per_batch(self) -> int:  # derived: each answered samples_per_prompt times
        return self.batch_size // self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:  # derived: the estimator reads a critic's values (gae)
        return ADVANTAGES[self.advantage].uses_critic

    @property
    def resolved_whiten_advantages(self) -> bool:  # derived: auto -> only with the KL in the reward
        if self.whiten_advantages == "auto":
            return self.kl_in == "reward"
        return self.whiten_advantages == "on"

    @property
    def minibatch_size(self) -> int:  # derived: rows per optimizer step
        return self.batch_size // self.num_minibatches

    @property
    def micro_batch_rows(self) -> int:  # derived: rows per forward/backward (0: the minibatch)
        return self.micro_batch_size or self.minibatch_size

    @property
    def resolved_loss_aggregation(self) -> str:  # derived: auto follows the KL placement (docs/design.md)
        if self.loss_aggregation != "auto":
            return self.loss_aggregation
        if self.kl_in == "loss" and not self.kl_per_token_mean:
            return "sum"  # the per-sequence KL's units, so beta means what it means in the reward
        return "token"

    @property
    def anchor(self) -> tuple[str, str]:  # derived: the KL's anchor ("": the policy's start), its name
        return (self.teacher, "teacher") if self.teacher else (self.ref_model, "reference model")

    @property
    def resolved_kl_estimator(self) -> str:  # derived: auto -> k1 in the reward, k3_ratio in the loss
        return KL_DEFAULTS[self.kl_in] if self.kl_estimator == "auto" else self.kl_estimator

    def validate(self) -> None:
        super().validate()
        self._check_kl()
        if self.samples_per_prompt < 1 or self.batch_size % self.samples_per_prompt:
            raise TetherError(f"--samples-per-prompt {self.samples_per_prompt} must be >= 1 and "
                              f"divide --batch-size {self.batch_size} (responses per batch)")
        if ADVANTAGES[self.advantage].compares_group and self.samples_per_prompt < 2:
            raise TetherError(f"--advantage {self.advantage} compares the responses to one prompt: "
                              "pass --samples-per-prompt 2 or more (4 is usual)")
        require_positive(self, "batch_size", "ppo_epochs", "num_minibatches", "kl_horizon")
        require_positive(self, "lr", "beta", "missing_eos_penalty", "reward_clip", "target_kl",
                         "max_grad_norm", "clip_range", "clip_high", "value_clip_range", "vf_coef",
                         "warmup_batches", "weight_decay", "max_kl", "beta_end", "anneal_batches",
                         "eval_every", "sample_every", "engine_mask_kl", allow_zero=True)
        if self.lora_dropout > 0:
            raise TetherError("--lora-dropout must be 0 for ppo: dropout stays off in RL, so the "
                              "rollout and the update score the same tokens alike")
        self._check_sizes()
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise TetherError(f"config field '{name}' must lie in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.overlong_penalty < self.max_new_tokens:
            raise TetherError(f"--overlong-penalty {self.overlong_penalty} must lie in [0, "
                              f"--max-new-tokens {self.max_new_tokens}): it is the length of the "
                              "window before the limit where the penalty grows")
        if self.engine_is_cap and not self.engine_is_cap >= 1:
            raise TetherError(f"--engine-is-cap {self.engine_is_cap} must be 0 (off) or >= 1: a "
                              "cap below 1 shrinks the weight of tokens the engine matched exactly")
        self._check_staleness()
        self._check_dynamic_sampling()

    def _check_kl(self) -> None:
        """The estimator where --kl-in puts it (tether.choices.KL_ESTIMATORS' placements), and the
        adaptive controller's settings."""
        name, allowed = self.resolved_kl_estimator, kl_allowed(self.kl_in)
        if name not in allowed and self.kl_in == "loss":
            raise TetherError(f"--kl-estimator {name} has no useful gradient as a loss term (its "
                              f"expected gradient is {KL_ESTIMATORS[name].gradient}); use "
                              f"{KL_DEFAULTS['loss']} (the default) or another of "
                              f"{', '.join(allowed)} with --kl-in loss")
        if name not in allowed:
            raise TetherError(f"--kl-estimator {name} is a loss term; use it with --kl-in loss, "
                              f"or one of {', '.join(allowed)} in the reward")
        if self.kl_ctl == "adaptive":
            require_positive(self, "kl_target", "kl_max_error")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise TetherError(f"--jsd-beta {self.jsd_beta} must lie in [0, 1]: 0 is the forward "
                              "KL, 1 the reverse KL, between them the generalised JSD")
        if self.teacher and self.ref_model:
            raise TetherError("--teacher is the KL's anchor in place of the reference; drop "
                              "--ref-model (or --teacher)")
        self._check_ref_update()

    def _check_ref_update(self) -> None:
        """--ref-update's form, and what a moving reference cannot be (yet)."""
        try:
            kind = RefUpdate.parse(self.ref_update).kind
        except ValueError as exc:
            raise TetherError(str(exc)) from None
        if kind == "none":
            return
        fixed = [(bool(self.teacher), "--teacher (a teacher does not move)"),
                 (bool(self.ref_model), "--ref-model (the reference moves from the policy's "
                                        "own start)"),
                 (self.lora_r > 0 and kind != "reset", "--lora-r (a LoRA run's reference is an "
                                                       "adapter, and mixing two adapters' factors "
                                                       "is not mixing their weights: use reset:N)")]
        for given, why in fixed:
            if given:
                raise TetherError(f"--ref-update {self.ref_update} cannot be used with {why}; "
                                  "drop one of them")

    def _check_sizes(self) -> None:
        """Minibatches, micro-batches and the run's length split the batches evenly."""
        if self.batch_size % self.num_minibatches:
            raise TetherError(f"--num-minibatches {self.num_minibatches} must divide --batch-size "
                              f"{self.batch_size}")
        if self.micro_batch_size < 0 or self.minibatch_size % self.micro_batch_rows:
            raise TetherError(f"--micro-batch-size {self.micro_batch_size} must divide the minibatch "
                              f"of {self.minibatch_size} rows (--batch-size {self.batch_size} / "
                              f"--num-minibatches {self.num_minibatches}); or 0 for the whole minibatch")
        # a minibatch is cut by rows (--micro-batch-size) or by tokens (--micro-batch-tokens)
        require_positive(self, "micro_batch_tokens", allow_zero=True)
        if self.micro_batch_tokens and self.micro_batch_size:
            raise TetherError(f"--micro-batch-tokens {self.micro_batch_tokens} and "
                              f"--micro-batch-size {self.micro_batch_size} both cut a minibatch; "
                              "pass one of them")
        if self.n_batches < 1:
            raise TetherError(f"--total-episodes {self.total_episodes} is less than one batch of "
                              f"{self.batch_size}; raise it")

    @property
    def steps_per_batch(self) -> int:
        """The most optimizer steps one rollout batch takes (fewer when --target-kl stops it)."""
        return self.ppo_epochs * self.num_minibatches

    @property
    def batches_ahead(self) -> int:
        """How many batches the generator samples ahead of the one being trained (--max-staleness
        over the steps a batch takes): batch b + L is sampled by the weights batch b starts from
        and trained L batches, at most --max-staleness steps, later."""
        return self.max_staleness // self.steps_per_batch

    @property
    def resolved_engine_is_cap(self) -> float:
        """C of the truncated importance weight: --engine-is-cap, or with --max-staleness and
        none given 2 (decoupled PPO needs the weight; uncapped it has no bound)."""
        # 2: Yao et al. 2025 use it for the engine's mismatch alone
        return self.engine_is_cap or (2.0 if self.max_staleness > 0 else 0.0)

    def _check_staleness(self) -> None:
        require_positive(self, "max_staleness", allow_zero=True)
        check_threads(self.generator_threads, "--generator-threads")  # its torch takes them
        steps = self.steps_per_batch
        if 0 < self.max_staleness < steps:  # (0: synchronous)
            raise TetherError(f"--max-staleness {self.max_staleness} is less than the {steps} "
                              f"optimizer steps each batch takes (--ppo-epochs {self.ppo_epochs} x "
                              f"--num-minibatches {self.num_minibatches}), so no batch could be "
                              f"sampled ahead within it; give {steps} (one batch ahead) or a "
                              "multiple of it, or 0")
        if self.max_staleness > (total := self.n_batches * steps):  # bounds async/staleness_<g>
            raise TetherError(f"--max-staleness {self.max_staleness} is more than the {total} "
                              f"optimizer steps this whole run takes ({self.n_batches} batches, "
                              f"{steps} each), so no token could ever be that stale; give at "
                              f"most {total} (or 0)")

    def _check_dynamic_sampling(self) -> None:
        if self.dynamic_sampling < 0:
            raise TetherError(f"--dynamic-sampling {self.dynamic_sampling} must be >= 0: the most "
                              "extra rounds of prompts a batch may draw (0: off)")
        if self.dynamic_sampling > MAX_DYNAMIC_ROUNDS:
            raise TetherError(f"--dynamic-sampling {self.dynamic_sampling} is more than "
                              f"{MAX_DYNAMIC_ROUNDS} extra rounds per batch, each as costly as "
                              f"the batch itself; a batch that needs more than "
                              f"{MAX_DYNAMIC_ROUNDS} has almost no group with differing rewards "
                              f"(check the reward, or keep the prompts the policy sometimes "
                              f"solves): give at most {MAX_DYNAMIC_ROUNDS}")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise TetherError("--dynamic-sampling drops groups whose responses all score the same; "
                              "a group of one always does: pass --samples-per-prompt 2 or more")


@dataclass(kw_only=True)
class RLOOConfig(PPOConfig):
    """RLOO (Ahmadian et al. 2024): k responses per prompt, each baselined by the mean reward of
    the other k - 1; no critic; the KL in the reward (k1), as in PPO."""

    STAGE: ClassVar[str] = "rloo"  # the command; recorded in the run directory

    run_name: str = "rloo"
    advantage: Literal[tuple(ADVANTAGES)] = "rloo"
    """Advantage estimator (rloo here; see tether ppo --help)."""
    samples_per_prompt: int = 4
    ppo_epochs: int = 1
    """Passes over each rollout batch (RLOO is on-policy REINFORCE: one)."""


@dataclass(kw_only=True)
class GRPOConfig(PPOConfig):
    """GRPO (Shao et al. 2024): k responses per prompt, advantages centred on the group mean and
    scaled by its std (--scale-rewards none: Dr. GRPO, Liu et al. 2025); no critic; the KL in the
    loss as a per-token mean, with k3 x ratio (whose gradient is KL(pi || pi_ref)'s) by default."""

    STAGE: ClassVar[str] = "grpo"  # the command; recorded in the run directory

    run_name: str = "grpo"
    advantage: Literal[tuple(ADVANTAGES)] = "grpo"
    """Advantage estimator (grpo here; see tether ppo --help)."""
    samples_per_prompt: int = 4
    kl_in: Literal[tuple(KL_DEFAULTS)] = "loss"
    """Where the KL penalty goes (GRPO: the loss)."""
    kl_per_token_mean: bool = True
    """KL term and surrogate as token means over the batch (GRPO's form); --loss-aggregation, when given, replaces it."""
    beta: float = 0.04
    """KL coefficient (Shao et al. 2024 use 0.04)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (GRPO's usual one)."""


@dataclass(kw_only=True)
class DistillConfig(PPOConfig):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu and Thinking Machines 2025): the policy
    (the student) samples, a --teacher scores every token, and the loss pulls the student's whole
    next-token distribution toward the teacher's at every sampled position (the exact KL over the
    vocabulary, --kl-estimator forward or jsd for the others). No task reward by default; with
    --reward-fn or --reward-model the optimum is pi_teacher exp(R / beta) / Z (docs/ppo.md)."""

    STAGE: ClassVar[str] = "distill"  # the command; recorded in the run directory
    FLAG_NAMES: ClassVar[dict[str, str]] = {"--student": "--policy"}  # the words

    run_name: str = "distill"
    policy: str
    """The student: the model distilled into (directory or hub name)."""
    teacher: str = field()  # required here (a bare annotation would inherit PPOConfig's "")
    """The teacher: the model whose next-token distribution the student learns, forward passes only; it must share the student's tokenizer (a larger, padded output layer is cut to the student's)."""
    advantage: Literal[tuple(ADVANTAGES)] = "reinforce++"
    """Advantage estimator of a task reward, if one is given (reinforce++ here: no critic, no group; see tether ppo --help)."""
    kl_in: Literal[tuple(KL_DEFAULTS)] = "loss"
    """Where the KL to the teacher goes (distill: the loss, where the exact KL acts)."""
    kl_estimator: Literal[("auto", *KL_ESTIMATORS)] = "exact"
    """The divergence to the teacher: exact (the reverse KL over the whole vocabulary), forward, jsd (--jsd-beta), or a per-token estimator (k1 in the reward: the sampled-token form); see tether ppo --help."""
    beta: float = 1.0
    """Weight of the KL to the teacher (1: distillation alone; smaller lets a task reward pull further)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (on-policy: one)."""
