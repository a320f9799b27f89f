"""Every named choice a stage offers, one table each, each entry with its facts.

    ENGINES         --engine          who samples: how it starts, its generator for
                                      --max-staleness, whether its log-probs are its own, the
                                      package it needs, the options that act only with it
    ADVANTAGES      --advantage       the estimator, whether it reads a critic, compares a group
                                      of samples, discounts; the options that act only with it
    KL_CONTROLLERS  --kl-ctl          how beta moves; the options that act only with it
    KL_ESTIMATORS   --kl-estimator    the per-token term, where it may stand (the reward, the
                                      loss), the gradient it gives as a loss term
    POLICY_LOSSES   --policy-loss     the objective
    IMPORTANCE_LEVELS --importance-level  the ratio

A table is the one place its names and facts are written: the configs' literals and `--help`,
every check, the option scopes (`tether.run.scopes`) and the code that dispatches on a name read
it. Adding an engine, an estimator or a loss is its function plus one entry here; a name missing
from a table is an error at the table (`entry`), never a fall-through to another entry. An
option that acts only with some entries is in their `options`: given with another entry, it is
refused (`tether.run.scopes`).

Beside the tables, the maths layer's argument checks (`same_shape`, `positive`, `non_negative`,
`masked_mean`): one-line errors that name the problem and the fix, as `entry` gives for a name.

An entry names its function by `module:function` (`Ref`), imported when first called: the
configs, `--help` and every refusal read these tables before torch loads (a config module imports
no torch), and an engine's optional package (vLLM) is imported only when asked for. The names
point up the layers as text only; the imports a reference makes happen where it is called.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Ref:
    """The function `module:name`, imported at its first call (module docstring)."""

    def __init__(self, path: str):
        self.path, self._fn = path, None

    def resolve(self) -> Callable:
        if self._fn is None:
            module, _, name = self.path.partition(":")
            self._fn = getattr(importlib.import_module(module), name)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Ref({self.path!r})"


def entry(table: dict | tuple, name: str, what: str):
    """`table[name]` (a tuple of names: `name`), or the one error for a name a table lacks:
    ValueError, as the maths layer raises for a bad argument (a config's literal refuses the
    name first, in the user's words)."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(table)}")
    return table[name] if isinstance(table, dict) else name


# ----------------------------------------------------------------------------- engines

@dataclass(frozen=True)
class Engine:
    """A rollout engine (`tether.rl.engines.RolloutEngine`)."""

    about: str  # one line for --help
    # (settings, model, peft, longest_prompt, d, run_model) -> RolloutEngine
    start: Callable
    # the same arguments but run_model -> the engine the generator process runs on its copy of
    # the policy (--max-staleness); its rollouts carry the log-probs of what it sampled
    generator: Callable
    # it computes the policy with kernels of its own, so its log-probs are not the trainer's:
    # the loop measures the gap (rollout/engine_kl) and --engine-is-cap and --engine-mask-kl act
    own_logprobs: bool = False
    package: str = ""  # the import it needs beyond tether's core ("": none)
    install: str = ""  # the line that installs it
    options: tuple[str, ...] = ()  # the options that act only with this engine
    # (settings, config, longest_prompt, device) -> None: what it needs of the model's config,
    # refused before any weights load (None: nothing)
    check: Callable | None = None


ENGINES: dict[str, Engine] = {
    "native": Engine(
        "tether's KV-cached sampler on the trainer's own model",
        start=Ref("tether.rl.engines.native:start"),
        generator=Ref("tether.rl.engines.native:start_recording")),
    "vllm": Engine(
        "vLLM in this process, fed the trainer's weights in memory before each rollout",
        start=Ref("tether.rl.engines.vllm_engine:start"),
        generator=Ref("tether.rl.engines.vllm_engine:start"),
        own_logprobs=True, package="vllm",
        install="pip install -e '.[vllm]' (vLLM's CPU build), or on a GPU `pip install vllm` "
                "matching your CUDA torch (docs/engine.md)",
        options=("engine_kv_cache_mb", "engine_is_cap", "engine_mask_kl"),
        check=Ref("tether.rl.engines.vllm_limits:check_settings")),
}


# ----------------------------------------------------------------------------- advantages

@dataclass(frozen=True)
class Advantage:
    """An advantage estimator (`tether.advantages`)."""

    about: str
    # (spec: AdvantageSpec, rewards, values, mask) -> (advantages, returns), all [B, T]
    fn: Callable
    uses_critic: bool = False  # reads a critic's values (the critic is built only then)
    compares_group: bool = False  # baselines each response by the other samples of its prompt
    discounts: bool = False  # reads gamma
    options: tuple[str, ...] = ()  # the options that act only with this estimator
    command: str = ""  # the stage whose default it is ("": none)


ADVANTAGES: dict[str, Advantage] = {
    "gae": Advantage("GAE on a critic's values (Schulman et al. 2015)",
                     Ref("tether.advantages:gae_advantages"), uses_critic=True, discounts=True,
                     options=("whiten_advantages", "lam"), command="ppo"),
    "rloo": Advantage("leave-one-out baseline over the k samples (Ahmadian et al. 2024)",
                      Ref("tether.advantages:rloo_advantages"), compares_group=True,
                      command="rloo"),
    "grpo": Advantage("the group's mean (and std) as the baseline (Shao et al. 2024)",
                      Ref("tether.advantages:grpo_advantages"), compares_group=True,
                      options=("scale_rewards",), command="grpo"),
    "reinforce++": Advantage("the return-to-go whitened over the batch (Hu 2025)",
                             Ref("tether.advantages:reinforce_pp_advantages"), discounts=True),
}


# ----------------------------------------------------------------------------- KL penalty

@dataclass(frozen=True)
class Controller:
    """A beta controller (`tether.kl`, built by `tether.train.ppo_setup.kl_controller`)."""

    about: str
    options: tuple[str, ...] = ()  # the options that act only with it


KL_CONTROLLERS: dict[str, Controller] = {
    "fixed": Controller("a constant beta"),
    "adaptive": Controller("proportional control toward --kl-target (Ziegler et al. 2019)",
                           ("kl_target", "kl_horizon", "kl_max_error")),
    "annealed": Controller("from --beta to --beta-end over --anneal-batches",
                           ("beta_end", "anneal_batches", "anneal_shape")),
}


@dataclass(frozen=True)
class KLEstimator:
    """A KL term (`tether.kl`, `tether.losses.kl_penalty`)."""

    about: str
    # d [...] -> [...]: the per-token value from d = log pi(y) - log ref(y); None: the exact KL,
    # which needs the logits of every position
    token: Callable | None
    in_reward: bool  # may stand in the reward, -beta * kl_t
    in_loss: bool  # may stand as a loss term
    ratio: bool = False  # as a loss term, times pi / pi_old (both factors carry the gradient)
    # its expected gradient as a loss term (Schulman 2020; tests/test_kl_gradients.py)
    gradient: str = ""
    # (logits [N, V], ref_logits [N, V], temperature, **options) -> [N]: the divergence over the
    # whole vocabulary of an entry whose `token` is None (`tether.kl.exact`'s `rows`)
    rows: Callable | None = None
    options: tuple[str, ...] = ()  # the options that act only with it, passed to `rows` by name


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator("d: unbiased, high variance", Ref("tether.kl:k1"), True, False,
                      gradient="0 on-policy"),
    "k2": KLEstimator("d^2 / 2: biased, low variance", Ref("tether.kl:k2"), True, True,
                      gradient="KL(pi || ref)'s at pi = pi_old"),
    "k3": KLEstimator("exp(-d) - 1 + d: unbiased, low variance", Ref("tether.kl:k3"), True, True,
                      gradient="KL(ref || pi)'s (the forward KL) at pi = pi_old"),
    "abs": KLEstimator("|d|: a biased magnitude", Ref("tether.kl:absolute"), True, False,
                       gradient="no KL's"),
    "k3_ratio": KLEstimator("k3 x pi / pi_old", Ref("tether.kl:k3"), False, True, ratio=True,
                            gradient="KL(pi || ref)'s for every pi"),
    "exact": KLEstimator("the KL over the whole vocabulary at each position", None, False, True,
                         gradient="KL(pi || ref)'s exactly, for every pi",
                         rows=Ref("tether.kl:exact_rows")),
    "forward": KLEstimator("the forward KL(ref || pi) over the whole vocabulary at each position",
                           None, False, True, gradient="KL(ref || pi)'s exactly, for every pi",
                           rows=Ref("tether.kl:forward_rows")),
    "jsd": KLEstimator("the generalised Jensen-Shannon divergence over the whole vocabulary at "
                       "each position, --jsd-beta from forward (0) to reverse (1) KL", None, False,
                       True, gradient="JSD_beta(pi, ref)'s exactly, for every pi",
                       rows=Ref("tether.kl:jsd_rows"), options=("jsd_beta",)),
}
# --kl-estimator auto: k1 in the reward (Ziegler et al. 2019), k3_ratio in the loss (its gradient
# is KL(pi || ref)'s; plain k3's is KL(ref || pi)'s)
KL_DEFAULTS = {"reward": "k1", "loss": "k3_ratio"}


def kl_allowed(placement: str) -> list[str]:
    """The estimators that may stand in `placement` ("reward" or "loss"), in table order."""
    return [name for name, e in KL_ESTIMATORS.items()
            if (e.in_reward if placement == "reward" else e.in_loss)]


# ----------------------------------------------------------------------------- policy losses

@dataclass(frozen=True)
class Objective:
    """A policy objective (`tether.losses`): (inputs: LossInputs) -> (per-token loss
    [B, T], where the clip or cap acted [B, T])."""

    about: str
    fn: Callable


POLICY_LOSSES: dict[str, Objective] = {
    "ppo": Objective("the clipped surrogate (Schulman et al. 2017)",
                     Ref("tether.losses:clipped_surrogate")),
    "cispo": Objective("REINFORCE on log pi with a capped, detached weight (MiniMax-M1 2025)",
                       Ref("tether.losses:cispo")),
}

# --importance-level: (log_ratio [B, T], mask [B, T]) -> the log-ratio the ratio exponentiates
IMPORTANCE_LEVELS: dict[str, Callable] = {
    "token": Ref("tether.losses:token_log_ratio"),  # PPO
    "sequence": Ref("tether.losses:sequence_log_ratio"),  # GSPO
}


# ----------------------------------------------------------------------------- argument checks
# (tensors duck-typed: this module imports no torch)

def same_shape(**tensors) -> None:
    """Raise ValueError unless every tensor has the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; pass tensors of one shape")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def masked_mean(x, mask):
    """Mean of `x` over positions where `mask` is true (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- moving references

@dataclass(frozen=True)
class RefUpdateKind:
    """A way the KL's reference moves toward the policy (--ref-update, `tether.rl.anchor`)."""

    about: str
    form: str  # as the user writes it
    pattern: re.Pattern  # its numbers as groups
    spec: Callable  # (the pattern's groups) -> (alpha: the policy's weight, every: N batches)


NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
REF_UPDATES: dict[str, RefUpdateKind] = {
    "none": RefUpdateKind("frozen: the SFT model", "none", re.compile("none"),
                          lambda: (0.0, 1)),
    "reset": RefUpdateKind("the policy copied in every N batches (ProRL)", "reset:N",
                           re.compile("reset:([0-9]+)"), lambda n: (1.0, int(n))),
    "mix": RefUpdateKind("ref <- ALPHA policy + (1 - ALPHA) ref every N batches (TRL, TR-DPO)",
                         "mix:ALPHA,N", re.compile(f"mix:{NUMBER},([0-9]+)"),
                         lambda alpha, n: (float(alpha), int(n))),
    "ema": RefUpdateKind("that mix after every batch", "ema:ALPHA", re.compile(f"ema:{NUMBER}"),
                         lambda alpha: (float(alpha), 1)),
}


@dataclass(frozen=True)
class RefUpdate:
    """--ref-update, parsed: how (`kind`, a key of `REF_UPDATES`), by how much (`alpha`, the
    policy's weight) and how often (`every` batches) the reference moves."""

    kind: str = "none"
    alpha: float = 0.0
    every: int = 1

    @classmethod
    def parse(cls, text: str) -> RefUpdate:
        """The spec of `text`, or one ValueError line naming the accepted forms."""
        kind = REF_UPDATES.get(text.partition(":")[0])
        found = kind.pattern.fullmatch(text) if kind is not None else None
        forms = ", ".join(k.form for k in REF_UPDATES.values())
        if found is None:
            raise ValueError(f"--ref-update {text!r} is not one of {forms} (N a whole number "
                             "of batches >= 1, ALPHA in [0, 1])")
        alpha, every = kind.spec(*found.groups())
        if not 0.0 <= alpha <= 1.0 or every < 1:
            raise ValueError(f"--ref-update {text}: ALPHA must lie in [0, 1] and N be at least "
                             f"1 batch ({forms})")
        return cls(text.partition(":")[0], alpha, every)

    @property
    def moves(self) -> bool:
        return self.kind != "none" and self.alpha > 0.0  # ema:0 and mix:0,N never move

    def alpha_after(self, batches_done: int) -> float | None:
        """The policy's weight in the reference after `batches_done` batches, or None when the
        reference does not move then."""
        return self.alpha if self.moves and not batches_done % self.every else None
