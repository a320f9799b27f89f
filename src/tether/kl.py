"""The KL penalty: per-token estimators, the exact KL, and beta controllers.

Notation: B batch, T response positions, V vocabulary. pi is the policy being trained, ref the
frozen SFT reference. For a token y sampled from pi,

    d = log pi(y) - log ref(y)                 (the log-ratio)

and, following Schulman (2020), "Approximating KL Divergence", with r = ref(y) / pi(y) = exp(-d):

    k1 = d                    unbiased for KL(pi || ref), high variance, negative on single tokens
    k2 = d^2 / 2              biased (the bias grows with the divergence), low variance, >= 0
    k3 = (r - 1) - log r      unbiased and >= 0 (since log r <= r - 1), low variance
       = exp(-d) - 1 + d
    abs = |d|                 a biased, non-negative magnitude

Where the penalty sits decides which divergence's gradient the update follows (docs/ppo.md,
"Critic-free advantages and the KL placements"). KL(pi || ref) is the *reverse*, mode-seeking KL
that the RLHF objective penalises; KL(ref || pi) is the *forward*, mass-covering one. In the
reward, k1 gives the gradient of KL(pi || ref). As a loss term on tokens sampled from pi_old, at
pi = pi_old: k2 gives the gradient of KL(pi || ref), k3 that of KL(ref || pi), and k3 * pi/pi_old
(`k3_ratio`) and the exact per-position KL give the gradient of KL(pi || ref) for every pi.

The controllers set beta in R_total = R_RM - beta * KL. `AdaptiveKL` is the proportional
controller of Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences", eq. 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tether.choices import KL_ESTIMATORS, entry, kl_allowed, non_negative, positive, same_shape
from tether.logprobs import map_row_chunks

# The estimators `estimate` and the KL-in-the-reward placement take, and the terms
# `tether.losses.kl_penalty` accepts as a loss: the table's facts (tether.choices.KL_ESTIMATORS).
# k1 and abs cannot be loss terms (k1's expected gradient is 0 on-policy, abs's is no KL's);
# k3_ratio (k3 * pi/pi_old) and exact exist only as loss terms.
ESTIMATORS = tuple(kl_allowed("reward"))
LOSS_ESTIMATORS = tuple(kl_allowed("loss"))

# exp(-d) in k3 overflows fp32 near d = -88; a log-ratio of 20 already means a probability ratio
# of 5e8, so clamping there changes nothing a training run can use and keeps k3 finite.
LOG_RATIO_CLAMP = 20.0


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = d: unbiased for KL(pi || ref), high variance, negative on single tokens."""
    return log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: biased (the bias grows with the divergence), low variance, >= 0."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) - 1 + d: unbiased and >= 0. Only the exponent is clamped (+-20), so the value
    stays finite and its gradient is never cut off; expm1 keeps precision when d is near 0."""
    return torch.expm1(-log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) + log_ratio


def absolute(log_ratio: torch.Tensor) -> torch.Tensor:
    """abs = |d|: a biased, non-negative magnitude."""
    return log_ratio.abs()


def estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
             estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi.

    With d = logprobs - ref_logprobs: k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d; abs = |d|
    (Schulman 2020). k3's exponent uses d clamped to +-20 so it cannot overflow.

    Args:
        logprobs: [...] log pi(y_t) of the sampled tokens.
        ref_logprobs: [...] log ref(y_t) of the same tokens.
        estimator: one of `ESTIMATORS` ("k1", "k2", "k3", "abs").

    Returns:
        [...] per-token estimates, same shape as the inputs. Masking is the caller's job.
    """
    term = KL_ESTIMATORS[entry(ESTIMATORS, estimator, "KL estimator")]
    same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return term.token(logprobs - ref_logprobs)


def exact(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0,
          rows=None) -> torch.Tensor:
    """Exact KL(softmax(logits/T) || softmax(ref_logits/T)) over the vocabulary, per position, or
    another divergence over the vocabulary (`rows`: `forward_rows`, `jsd_rows`).

    KL = sum_v p_v (log p_v - log q_v), p = softmax(logits / T), q = softmax(ref_logits / T)

    Computed over chunks of positions (see `tether.logprobs`), so no [B, T, V] copy is made.

    Args:
        logits: [..., V] policy logits.
        ref_logits: [..., V] reference logits.
        temperature: T > 0, applied to both.
        rows: (logits [N, V], ref_logits [N, V], temperature) -> [N]; default `exact_rows`.

    Returns:
        [...] fp32, `logits.shape[:-1]`; differentiable with respect to both inputs.
    """
    positive("temperature", temperature)
    same_shape(logits=logits, ref_logits=ref_logits)
    rows = rows or exact_rows
    return map_row_chunks(lambda chunk, ref_chunk: rows(chunk, ref_chunk, temperature),
                          logits, ref_logits)


def exact_rows(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`exact`'s formula on rows taken whole, [N, V] -> [N] fp32: for callers that chunk the rows
    themselves (`exact`; `tether.lm_head.head_exact_kl`, whose chunks come from the head)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def forward_rows(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The forward KL over the vocabulary, KL(q || p) = sum_v q_v (log q_v - log p_v), on rows
    taken whole ([N, V] -> [N] fp32): mass-covering, pi pulled toward every token ref (a teacher)
    gives weight, as in supervised distillation (GKD's beta = 0, Agarwal et al. 2024)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd_rows(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float,
             jsd_beta: float = 0.5) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence over the vocabulary on rows taken whole
    ([N, V] -> [N] fp32), with p = pi (the student) and q = ref (the teacher), as GKD defines it
    (Agarwal et al. 2024, "On-Policy Distillation of Language Models", eq. 1; TRL's GKD loss):

        M = beta q + (1 - beta) p
        JSD_beta = beta KL(q || M) + (1 - beta) KL(p || M)       0 < beta < 1

    and at the two ends, by definition, the forward KL(q || p) (beta = 0) and the reverse
    KL(p || q) (beta = 1), where the formula itself would vanish. beta = 0.5 is the symmetric
    Jensen-Shannon divergence, bounded by log 2. `jsd_beta`: beta (--jsd-beta)."""
    if not 0.0 <= jsd_beta <= 1.0:
        raise ValueError(f"the JSD's beta must lie in [0, 1], got {jsd_beta}")
    if jsd_beta in (0.0, 1.0):
        return (exact_rows if jsd_beta == 1.0 else forward_rows)(logits, ref_logits, temperature)
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    log_m = torch.logaddexp(log_q + math.log(jsd_beta), log_p + math.log1p(-jsd_beta))
    return (jsd_beta * (log_q.exp() * (log_q - log_m)).sum(-1)
            + (1.0 - jsd_beta) * (log_p.exp() * (log_p - log_m)).sum(-1))


@dataclass(frozen=True)
class KLPlacement:
    """Where the KL penalty acts (--kl-in, --kl-estimator resolved): per token in the reward,
    -beta * kl_t (PPO), or as a loss term beside the policy loss (GRPO), never both. As a loss
    term it takes the policy loss's reduction, so beta means what it means in the reward when
    both are per-sequence sums (docs/design.md)."""

    kl_in: str = "reward"  # "reward" or "loss"
    kl_estimator: str = "k1"  # a key of tether.choices.KL_ESTIMATORS allowed where kl_in says
    jsd_beta: float = 0.5  # the generalised JSD's beta (its `options`)

    @property
    def divergence(self) -> Callable | None:
        """The estimator's divergence over the whole vocabulary, (logits [N, V], ref_logits
        [N, V], temperature) -> [N], with its options; None for one of sampled tokens."""
        term = KL_ESTIMATORS[self.kl_estimator]
        if term.rows is None:
            return None
        return functools.partial(term.rows.resolve(),
                                 **{name: getattr(self, name) for name in term.options})

    def betas(self, beta: float) -> tuple[float, float]:
        """(beta in the reward, beta on the loss term)."""
        return (beta, 0.0) if self.kl_in == "reward" else (0.0, beta)

    @property
    def reward_estimator(self) -> str:
        # With the KL in the loss the reward is the score alone and the controller is fed the
        # rollout's k1, unbiased for the per-sequence KL.
        return self.kl_estimator if self.kl_in == "reward" else "k1"


def _as_float(kl: float | torch.Tensor) -> float:
    value = float(kl.detach().mean()) if isinstance(kl, torch.Tensor) else float(kl)
    if not math.isfinite(value):
        raise ValueError(f"KL fed to the beta controller is {value}; check the log-probs upstream")
    return value


class KLController:
    """What the loop needs of a beta controller: the current beta, an update from the batch
    mean of per-sequence summed KL and the batch size, and its state for checkpoints: every
    attribute the controller sets in `__init__` (its settings, then where its schedule stands),
    plain numbers and names, as JSON holds them."""

    beta: float

    def update(self, kl: float | torch.Tensor, n_steps: int) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        if missing := sorted(set(vars(self)) - set(state)):  # a state from another controller
            raise KeyError(f"{type(self).__name__} state lacks {', '.join(missing)}")
        vars(self).update({key: state[key] for key in vars(self)})


class FixedKL(KLController):
    """A constant beta."""

    def __init__(self, beta: float):
        non_negative("beta", beta)
        self.beta = float(beta)

    def update(self, kl: float | torch.Tensor, n_steps: int) -> float:
        _as_float(kl)
        return self.beta


class AdaptiveKL(KLController):
    """Proportional control of beta towards a KL target (Ziegler et al. 2019, eq. 2).

    e = clip(KL / target - 1, -max_error, max_error);  beta <- beta * (1 + e * n_steps / horizon)

    `kl` is the batch mean of the per-sequence summed KL and `n_steps` the number of sequences in
    the batch, so `horizon` is counted in sequences.
    """

    def __init__(self, beta: float, target: float, horizon: int = 10000, max_error: float = 0.2):
        non_negative("beta", beta)
        positive("target", target)
        positive("horizon", horizon)
        non_negative("max_error", max_error)
        self.beta = float(beta)
        self.target = float(target)
        self.horizon = int(horizon)
        self.max_error = float(max_error)

    def update(self, kl: float | torch.Tensor, n_steps: int) -> float:
        positive("n_steps", n_steps)
        error = min(max(_as_float(kl) / self.target - 1.0, -self.max_error), self.max_error)
        self.beta *= 1.0 + error * n_steps / self.horizon
        return self.beta


class AnnealedKL(KLController):
    """beta moves from `start` to `end` over `steps` updates, then stays at `end`.

    linear: beta_k = start + (end - start) * k / steps
    cosine: beta_k = start + (end - start) * (1 - cos(pi * k / steps)) / 2
    """

    def __init__(self, start: float, end: float, steps: int, shape: str = "linear"):
        non_negative("start beta", start)
        non_negative("end beta", end)
        positive("steps", steps)
        entry(("linear", "cosine"), shape, "anneal shape")
        self.start, self.end, self.steps, self.shape = float(start), float(end), int(steps), shape
        self.n_updates = 0
        self.beta = self._beta_at(0)

    def _beta_at(self, k: int) -> float:
        t = min(k / self.steps, 1.0)
        frac = t if self.shape == "linear" else (1.0 - math.cos(math.pi * t)) / 2.0
        return self.start + (self.end - self.start) * frac

    def update(self, kl: float | torch.Tensor, n_steps: int) -> float:
        _as_float(kl)
        self.n_updates += 1
        self.beta = self._beta_at(self.n_updates)
        return self.beta
