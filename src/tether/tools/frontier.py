"""The reward-KL frontier and Gao et al.'s over-optimisation fit: pure functions of numbers.

Notation: a run's evaluations give points (KL_i, R_i), KL in nats per response (the k1 sequence
KL to the reference, tether.rl.evaluation), R the gold reward's gain over the starting policy.

Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization", eq. 2 (RL):

    R(d) = d (alpha - beta_RL log d),   d = sqrt(KL)

R rises, peaks at d* = exp(alpha / beta_RL - 1) with R(d*) = beta_RL d*, then falls: the point
where optimising the proxy further starts to cost gold reward. R is linear in (alpha, beta_RL),
so the fit is ordinary least squares on the features (d, -d log d). (beta_RL is the fit's
coefficient, not the KL penalty beta.) Their eq. 1, best-of-n, is R(d) = d (alpha - beta_bon d),
peaking at d* = alpha / (2 beta_bon) with R(d*) = alpha d* / 2: the same fit on (d, -d^2)
(`form="bon"`).

Best-of-n from a pool (tether bon): N responses sampled for a prompt, r_(1) <= ... <= r_(N) their
proxy scores sorted. The best of n drawn from the pool without replacement is the i-th smallest
with probability C(i-1, n-1) / C(N, n), so

    E[v of the best of n] = sum_i C(i-1, n-1) / C(N, n) v_(i)        (order statistics; an
                                                                      unbiased estimate of the
                                                                      expected best of n)

for any value v of the responses (the proxy itself, or the gold score of the one the proxy
picks); responses tied on the proxy share their group's weight equally (a tie broken at random).
The KL of best-of-n to the policy it draws from is commonly quoted as log n - (n - 1) / n, which
Beirami et al. (2024, "Theoretical guarantees on the best-of-n alignment policy") show is an
upper bound; with the pool as the policy's support (each response 1/N, reward levels with their
CDF F) best-of-n gives level y the probability F(y)^n - F(y-)^n, and the KL is exact:

    KL_n = sum_levels q log(q / p),   q = F(y)^n - F(y-)^n,   p = F(y) - F(y-)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Gao et al.'s second feature of R = alpha d + beta f(d), by form: RL's and best-of-n's
GAO_FORMS = {"rl": lambda d: -d * math.log(d) if d > 0 else 0.0, "bon": lambda d: -d * d}


@dataclass
class GaoFit:
    alpha: float
    beta_rl: float  # the second coefficient (beta_bon for form "bon")
    r2: float  # 1 - SS_res / SS_tot of the gold gains
    n: int  # points fitted
    form: str = "rl"  # "rl": d (alpha - beta log d); "bon": d (alpha - beta d)

    def predict(self, kl: float) -> float:
        """R at a KL: d (alpha - beta_RL log d), with R(0) = 0 (the limit of d log d); or
        best-of-n's d (alpha - beta d)."""
        d = math.sqrt(max(kl, 0.0))
        if self.form == "bon":
            return d * (self.alpha - self.beta_rl * d)
        return 0.0 if d == 0 else d * (self.alpha - self.beta_rl * math.log(d))

    def peak(self) -> tuple[float, float] | None:
        """(KL, R) where the fitted gold peaks, d* = exp(alpha / beta_RL - 1) (best-of-n:
        alpha / (2 beta)); None when beta <= 0 (the fit keeps rising: no over-optimisation
        seen yet)."""
        if self.beta_rl <= 0:
            return None
        if self.form == "bon":
            d_star = self.alpha / (2 * self.beta_rl)
            return d_star * d_star, self.predict(d_star * d_star)
        exponent = self.alpha / self.beta_rl - 1
        if exponent > 350:  # a peak far beyond any KL reached; exp would overflow
            return None
        d_star = math.exp(exponent)
        return d_star * d_star, self.beta_rl * d_star

    def describe(self, max_kl: float) -> str:
        """The fit in words, honest about its reach: R² with its number of points (with 3 or
        fewer, two coefficients fit them almost exactly, so R² says nothing), and the fitted
        peak only as an extrapolation when it lies beyond `max_kl`, the largest KL measured."""
        r2 = (f"R² {self.r2:.2f} from {self.n} points" if math.isfinite(self.r2)
              else f"R² undefined ({self.n} points)")
        if self.n <= 3:
            r2 += ": too few to test the curve (two coefficients fit 3 points almost exactly)"
        peak = self.peak()
        if peak is None:
            where = "no fitted peak (still rising)"
        elif peak[0] > max_kl:
            where = (f"fitted peak beyond the data, an extrapolation (at KL {peak[0]:.3g}; the "
                     f"runs reached {max_kl:.2f})")
        else:
            where = f"fitted peak gold {peak[1]:+.3f} at KL {peak[0]:.2f}"
        return f"{r2}; {where}"


def gao_fit(kls: list[float], gains: list[float], form: str = "rl") -> GaoFit | None:
    """Least-squares (alpha, beta_RL) of R = d (alpha - beta_RL log d), d = sqrt(KL) (`form`
    "bon": best-of-n's R = d (alpha - beta d)).

    Negative KL (k1 on a small sample can dip below 0) counts as 0. None with fewer than three
    points or when the two features are collinear (e.g. every point at one KL).
    """
    if len(kls) != len(gains):
        raise ValueError(f"{len(kls)} KL values but {len(gains)} gold gains")
    f1 = [math.sqrt(max(k, 0.0)) for k in kls]  # d
    f2 = [GAO_FORMS[form](d) for d in f1]  # -d log d (RL), -d^2 (best-of-n)
    if len(f1) < 3:
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
    fit = GaoFit(alpha, beta_rl, float("nan"), len(f1), form)
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


def best_of_n(proxy: list[float], values: list[float], n: int) -> float:
    """The expected `values` entry of the best of `n` responses drawn without replacement from
    the pool, best by `proxy` (one score each; ties share their group's weight): the order
    statistics sum in the module's docstring. n = 1 gives the pool's mean, n = N its best."""
    pool = len(proxy)
    if not 1 <= n <= pool:
        raise ValueError(f"best of {n} from a pool of {pool}")
    total, below = 0.0, 0
    for level in sorted(set(proxy)):
        group = [v for p, v in zip(proxy, values) if p == level]
        # sum of C(i-1, n-1) over the group's ranks i = C(below + k, n) - C(below, n)
        weight = math.comb(below + len(group), n) - math.comb(below, n)
        total += weight * sum(group) / len(group)
        below += len(group)
    return total / math.comb(pool, n)


def best_of_n_kl(proxy: list[float], n: int) -> float:
    """KL(best-of-n || policy) with the pool as the policy's support: sum over the proxy's levels
    of q log(q / p), q = F^n - F_-^n (Beirami et al. 2024); never above log n - (n - 1) / n."""
    pool, kl, below = len(proxy), 0.0, 0
    for level in sorted(set(proxy)):
        upto = below + proxy.count(level)
        p = upto / pool - below / pool  # written as q is: at n = 1 they are the same float
        q = (upto / pool) ** n - (below / pool) ** n
        kl += q * math.log(q / p) if q > 0 else 0.0
        below = upto
    return kl


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)  # var / n


def over_seeds(per_seed: list[list[float]]) -> tuple[list[float], list[float]]:
    """Position by position (each seed's values at the same steps, seeds in one order): the mean
    over the seeds and its standard error (mean_and_stderr)."""
    stats = [mean_and_stderr(column) for column in zip(*per_seed)]
    return [m for m, _ in stats], [e for _, e in stats]


def error_text(mean: float, stderr: float, n: int) -> str:
    """`mean ± stderr`, or, with one value, the mean and "one seed, no error bar" (never ± 0.000,
    which would claim a certainty one seed cannot give)."""
    if n < 2:
        return f"{mean:+.3f} (one seed, no error bar)"
    return f"{mean:+.3f} ± {stderr:.3f}"


def end_of_training(per_eval: list[list[float]], last: int = 3) -> list[float]:
    """Per prompt, the mean gold over the last `last` evaluations (all of them if fewer).

    `per_eval`: each evaluation's per-prompt scores, in step order, the same prompts in each.
    One evaluation can be a dip (a policy that oscillates); the mean of the last few is the end
    of training a practitioner would trust, and stays paired prompt by prompt."""
    tail = per_eval[-last:]
    return [sum(scores) / len(tail) for scores in zip(*tail, strict=True)]


@dataclass
class Recommendation:
    label: str  # the setting recommended (a sweep group)
    beta: float
    evidence: str
    best: str = ""  # the setting that measured best
    tied: list[str] = field(default_factory=list)  # within noise of the best (the best included)
    gaps: dict[str, tuple[float, float]] = field(default_factory=dict)  # label -> best - it, error


def _gap(best: list[float], other: list[float]) -> tuple[float, float]:
    """best - other, paired per prompt when both hold the same (seed, prompt) units."""
    if len(best) == len(other):
        return paired_difference(other, best)
    (m1, e1), (m2, e2) = mean_and_stderr(best), mean_and_stderr(other)
    return m1 - m2, math.sqrt(e1 ** 2 + e2 ** 2)


def recommend_beta(end_gold: dict[str, list[float]], betas: dict[str, float],
                   seeds: dict[str, int]) -> Recommendation | None:
    """The rule: the best end-of-training gold, or, when the evidence cannot separate the best
    from others, the largest beta among them, said so first.

    `end_gold`: label -> each (seed, prompt)'s end-of-training gold (end_of_training), seeds
    concatenated in the same order for every label: the same held-out prompts, so each gap to
    the best is paired (mean and standard error of the per-unit differences). A setting is
    within noise of the best when its gap is at most twice its error. Among those, the largest
    beta is recommended: a stronger KL penalty keeps the policy nearer the SFT model, where the
    gold was measured to hold (it acts as early stopping against over-optimisation).
    """
    if not end_gold:
        return None
    means = {label: sum(v) / len(v) for label, v in end_gold.items()}
    best = max(means, key=lambda label: means[label])
    if len(means) == 1:
        return Recommendation(best, betas[best], f"only {best} was run", best, [best])
    gaps = {label: _gap(end_gold[best], end_gold[label]) for label in means if label != best}
    tied = [best] + [label for label, (gap, err) in gaps.items() if gap <= 2 * err]
    pick = max(tied, key=lambda label: betas[label])
    n_seeds = seeds[best]
    caveat = ("" if n_seeds > 1 else " With one seed the error bars cover the prompts and the "
              "sampling, not the training's own randomness.")
    if len(tied) == 1:
        runner = max(gaps, key=lambda label: means[label])
        gap, err = gaps[runner]
        return Recommendation(best, betas[best], (
            f"{best} measured best, end gold {means[best]:+.3f}, and beats every other beta "
            f"beyond noise: the closest, {runner} ({means[runner]:+.3f}), by {gap:+.3f} ± "
            f"{err:.3f}, more than twice its error.{caveat}"), best, tied, gaps)
    others = [label for label in tied if label != best]
    named = ", ".join(f"{label} ({means[label]:+.3f}, {gaps[label][0]:+.3f} ± "
                      f"{gaps[label][1]:.3f} behind)" for label in others)
    text = (f"No clear winner: {best} measured best (end gold {means[best]:+.3f}), but {named} "
            "cannot be told apart from it (a gap within twice its error).")
    if pick != best:
        gap, err = gaps[pick]
        need = (f"about {math.ceil(n_seeds * (2 * err / gap) ** 2)} seeds instead of {n_seeds}"
                f" would separate {best} from {pick} if the gap held (the error falls as "
                "1/sqrt(n))" if gap > 0 else f"{best} and {pick} measured the same")
        text += (f" The rule then takes the largest beta, beta {betas[pick]:g}: a stronger KL "
                 "penalty keeps the policy nearer the SFT model (it acts as early stopping). "
                 f"{need[0].upper() + need[1:]}.")
    else:
        text += f" {best} also has the largest beta of them, so the rule takes it."
    return Recommendation(pick, betas[pick], text + caveat, best, tied, gaps)


@dataclass
class PeakVerdict:
    holds: bool  # the rise to the peak and the fall after it both exceed twice their error
    evidence: str
    rose: bool = False  # the rise alone exceeds twice its error
    rise: tuple[float, float] = (0.0, 0.0)  # mean and standard error
    fall: tuple[float, float] = (0.0, 0.0)  # (0, 0) when the peak is the last evaluation


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
    # The best evaluation may be the last: then there is no fall to measure (not a zero error).
    after = ("the peak is the last evaluation: no fall to judge" if list(peak) == list(final)
             else f"final {m[2]:+.3f} (fall {fall:+.3f} ± {fall_se:.3f})")
    return PeakVerdict(rose and fell, f"start {m[0]:+.3f}, peak {m[1]:+.3f} at KL {peak_kl:.2f} "
                              f"(rise {rise:+.3f} ± {rise_se:.3f}), {after}", rose,
                       (rise, rise_se), (fall, fall_se))


def paired_difference(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean and standard error of after_i - before_i over the same prompts (paired)."""
    return mean_and_stderr([a - b for b, a in zip(before, after, strict=True)])


def one_curve_test(groups: list[list[tuple[float, float]]], permutations: int = 999,
                   seed: int = 0) -> tuple[float, float] | None:
    """Does a KL penalty only stop RL early? Gao et al. (2022, sec. 3.5) found every KL
    coefficient's (KL, gold gain) points on one curve, the penalty moving a run along it, not
    off it. `groups`: each beta's points. Fitted by `gao_fit` once to all points and once per
    group, the per-group fits can only lower the residual sum of squares; the question is
    whether by more than noise would. Returns (the reduction as a share of the pooled RSS, its
    permutation p-value: the share of `permutations` random reassignments of the points to
    groups of the same sizes whose reduction is at least as large), or None where a fit fails.
    A small p: the betas trace different curves (the penalty does more than stop early)."""
    def rss(points: list[tuple[float, float]]) -> float | None:
        fit = gao_fit([k for k, _ in points], [g for _, g in points])
        return None if fit is None else sum((g - fit.predict(k)) ** 2 for k, g in points)

    def reduction(parts: list[list[tuple[float, float]]]) -> float | None:
        separate = [rss(part) for part in parts]
        return None if None in separate else pooled - sum(separate)

    everything = [p for part in groups for p in part]
    pooled = rss(everything) if len(groups) >= 2 else None
    observed = reduction(groups) if pooled else None
    if observed is None:
        return None
    rng, hits = random.Random(seed), 0
    for _ in range(permutations):
        shuffled, at, parts = rng.sample(everything, len(everything)), 0, []
        for part in groups:
            parts.append(shuffled[at:at + len(part)])
            at += len(part)
        drawn = reduction(parts)
        hits += drawn is None or drawn >= observed - 1e-12 * pooled
    return observed / pooled, (1 + hits) / (1 + permutations)
