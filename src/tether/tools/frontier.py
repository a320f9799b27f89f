"""The reward-KL frontier and Gao et al.'s over-optimisation fit: pure functions of numbers.

Notation: a run's evaluations give points (KL_i, R_i), KL in nats per response (the k1 sequence
KL to the reference, tether.rl.evaluation), R the gold reward's gain over the starting policy.

Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization", eq. 2 (RL):

    R(d) = d (alpha - beta_RL log d),   d = sqrt(KL)

R rises, peaks at d* = exp(alpha / beta_RL - 1) with R(d*) = beta_RL d*, then falls: the point
where optimising the proxy further starts to cost gold reward. R is linear in (alpha, beta_RL),
so the fit is ordinary least squares on the features (d, -d log d). (beta_RL is the fit's
coefficient, not the KL penalty beta.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class GaoFit:
    alpha: float
    beta_rl: float
    r2: float  # 1 - SS_res / SS_tot of the gold gains
    n: int  # points fitted

    def predict(self, kl: float) -> float:
        """R at a KL: d (alpha - beta_RL log d), with R(0) = 0 (the limit of d log d)."""
        d = math.sqrt(max(kl, 0.0))
        return 0.0 if d == 0 else d * (self.alpha - self.beta_rl * math.log(d))

    def peak(self) -> tuple[float, float] | None:
        """(KL, R) where the fitted gold peaks, d* = exp(alpha / beta_RL - 1); None when
        beta_RL <= 0 (the fit keeps rising: no over-optimisation seen yet)."""
        if self.beta_rl <= 0:
            return None
        exponent = self.alpha / self.beta_rl - 1
        if exponent > 350:  # a peak far beyond any KL reached; exp would overflow
            return None
        d_star = math.exp(exponent)
        return d_star * d_star, self.beta_rl * d_star


def gao_fit(kls: list[float], gains: list[float]) -> GaoFit | None:
    """Least-squares (alpha, beta_RL) of R = d (alpha - beta_RL log d), d = sqrt(KL).

    Negative KL (k1 on a small sample can dip below 0) counts as 0. None with fewer than three
    points or when the two features are collinear (e.g. every point at one KL).
    """
    if len(kls) != len(gains):
        raise ValueError(f"{len(kls)} KL values but {len(gains)} gold gains")
    ds = [math.sqrt(max(k, 0.0)) for k in kls]
    f1 = ds  # d
    f2 = [-d * math.log(d) if d > 0 else 0.0 for d in ds]  # -d log d
    if len(ds) < 3:
        return None
    # Normal equations of the 2-parameter model without intercept (R(0) = 0 by construction).
    s11 = sum(a * a for a in f1)
    s12 = sum(a * b for a, b in zip(f1, f2))
    s22 = sum(b * b for b in f2)
    t1 = sum(a * y for a, y in zip(f1, gains))
    t2 = sum(b * y for b, y in zip(f2, gains))
    det = s11 * s22 - s12 * s12
    if abs(det) <= 1e-12 * max(s11 * s22, 1e-300):
        return None
    alpha = (t1 * s22 - t2 * s12) / det
    beta_rl = (s11 * t2 - s12 * t1) / det
    fit = GaoFit(alpha, beta_rl, float("nan"), len(ds))
    mean = sum(gains) / len(gains)
    ss_tot = sum((y - mean) ** 2 for y in gains)
    ss_res = sum((y - fit.predict(k)) ** 2 for k, y in zip(kls, gains))
    fit.r2 = 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    return fit


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The best gold reached within each KL budget: points sorted by KL, each (KL_i, max R over
    points with KL <= KL_i), keeping only the points where that best improves."""
    best, out = -math.inf, []
    for kl, gold in sorted(points):
        if gold > best:
            best = gold
            out.append((kl, gold))
    return out


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclass
class Recommendation:
    label: str  # the setting recommended (a sweep group)
    beta: float
    evidence: str
    clear: bool  # the winner beats the runner-up by more than twice the gap's standard error


def recommend_beta(final_gold: dict[str, list[float]], betas: dict[str, float],
                   per_prompt: dict[str, list[float]] | None = None) -> Recommendation | None:
    """The setting whose runs end with the best mean gold (over seeds), and the evidence.

    `final_gold`: setting label -> each seed's final gold; `betas`: label -> its KL coefficient.
    `per_prompt` (optional): label -> the final per-prompt gold scores, seeds concatenated in
    the same order for every label (the same held-out prompts). When the two best settings have
    them, the gap's error is the standard error of the paired per-prompt differences (pairing
    removes the prompts' own spread; it exists with one seed); otherwise it comes from the seed
    means. When the gap is within twice its standard error, the two cannot be told apart and the
    one with the larger beta is recommended (closer to the reference for the gold measured).
    """
    if not final_gold:
        return None
    stats = {label: mean_and_stderr(golds) for label, golds in final_gold.items()}
    ranked = sorted(stats, key=lambda label: stats[label][0], reverse=True)
    best = ranked[0]
    if len(ranked) == 1:
        return Recommendation(best, betas[best], f"only {best} was run", False)
    second = ranked[1]
    (m1, e1), (m2, e2) = stats[best], stats[second]
    a, b = (per_prompt or {}).get(best), (per_prompt or {}).get(second)
    paired = bool(a) and bool(b) and len(a) == len(b) and len(a) > 1
    if paired:
        gap, gap_error = paired_difference(b, a)
        how = f"paired over {len(a)} prompt evaluations"
    else:
        gap, gap_error = m1 - m2, math.sqrt(e1 ** 2 + e2 ** 2)
        how = f"{len(final_gold[best])} and {len(final_gold[second])} seeds"
    clear = gap_error > 0 and gap > 2 * gap_error
    summary = (f"final gold {m1:+.3f} for {best} (beta {betas[best]:g}) vs {m2:+.3f} for "
               f"{second} (beta {betas[second]:g}): a gap of {gap:+.3f} ± {gap_error:.3f} ({how})")
    if clear:
        return Recommendation(best, betas[best], summary + ", more than twice its standard "
                              "error", True)
    pick = best if betas[best] >= betas[second] else second
    why = ("one seed and no per-prompt scores give no error bar" if gap_error == 0 else
           "the gap is within twice its standard error")
    return Recommendation(pick, betas[pick], summary + f"; {why}, so the larger beta of the two "
                          "(closer to the reference for the gold measured)", False)


@dataclass
class PeakVerdict:
    holds: bool  # the rise to the peak and the fall after it both exceed twice their error
    evidence: str
    rose: bool = False  # the rise alone exceeds twice its error
    fell: bool = False  # the fall alone exceeds twice its error


def peak_then_fall(start: list[float], peak: list[float], final: list[float],
                   peak_kl: float) -> PeakVerdict:
    """Does gold rise to a peak and then fall, beyond noise?

    Inputs are per-prompt gold scores (the same held-out prompts, in the same order, pooled
    over seeds) at the start, at the evaluation with the best mean gold, and at the end. The
    rise is the mean of the paired differences peak_i - start_i, its error their standard error
    (the prompts are shared, so pairing removes their spread); likewise the fall. Both must
    exceed twice their standard error: a rise of +0.002 against an error of 0.04 is no peak.
    """
    rise, rise_se = mean_and_stderr([p - s for s, p in zip(start, peak, strict=True)])
    fall, fall_se = mean_and_stderr([p - f for p, f in zip(peak, final, strict=True)])
    rose = len(start) >= 2 and rise > 2 * rise_se
    fell = len(start) >= 2 and fall > 2 * fall_se
    m = [sum(x) / len(x) for x in (start, peak, final)]
    return PeakVerdict(rose and fell, f"start {m[0]:+.3f}, peak {m[1]:+.3f} at KL {peak_kl:.2f} "
                              f"(rise {rise:+.3f} ± {rise_se:.3f}), final {m[2]:+.3f} "
                              f"(fall {fall:+.3f} ± {fall_se:.3f})", rose, fell)


def paired_difference(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean and standard error of after_i - before_i over the same prompts (paired)."""
    return mean_and_stderr([a - b for b, a in zip(before, after, strict=True)])
