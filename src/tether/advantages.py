"""Sequence scores, per-token rewards with the KL penalty, generalised advantage estimation,
whitening.

Notation: B batch, T response positions. `mask` [B, T] is true on the tokens the policy sampled
(a rollout's `action_mask`: up to and including EOS, or up to the last token of a truncated
response) and false on padding and on an environment's observations between two turns.

The total reward of a response y to a prompt x (Ziegler et al. 2019; Stiennon et al. 2020) is

    R_total(x, y) = R_RM(x, y) - beta * KL(pi(.|x) || ref(.|x))

spread over tokens: every real token gets r_t = -beta * kl_t, and the sequence score R_RM is added
at the last real token, where the whole response is known.

Advantages come from a critic (`gae`) or, critic-free, from k samples per prompt. Rows come in
groups: B = n_prompts * k, and rows i*k .. i*k + k - 1 answer prompt i. `rloo` and `grpo` use the
sequence return R_i = sum_t r_{i,t} (gamma = 1) on every real token (outcome supervision);
`reinforce_pp` whitens the per-token return-to-go over the batch. With the KL in the loss, the
rewards are `kl_shaped_rewards` with beta = 0: the score alone, on the last real token.

Before they become per-token rewards, sequence scores may be normalised per batch or over the
run (`ScoreNormalizer`) and given DAPO's soft penalty for long responses (`overlong_penalty`);
`varied_groups` finds the groups of samples whose scores vary (the ones that carry a gradient
under rloo and grpo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tether import kl as kl_lib
from tether.choices import ADVANTAGES, entry, non_negative, positive, same_shape


class ScoreNormalizer:
    """Scores -> (score - mean) / std: per batch, or with running moments over the run (the
    running form is a streaming version of the reward normalisation of Ziegler et al. 2019).

    mode "none": unchanged; "batch": population moments of this batch; "running": moments of
    every score seen so far (Chan et al.'s parallel update), checkpointed with `state_dict`.
    """

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


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the score:

        0                                   |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                  |y| > L_max

    Args:
        lengths: [B] response lengths in tokens. max_len: L_max (--max-new-tokens).
        cache: L_cache > 0, the window before L_max where the penalty grows from 0 to -1.

    Returns:
        [B] fp32 penalties in [-1, 0].
    """
    positive("cache", cache)
    # ((L_max - L_cache) - |y|) / L_cache is >= 0 up to L_max - L_cache and < -1 past L_max
    return ((max_len - cache - lengths.float()) / cache).clamp(-1.0, 0.0)


def varied_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B / k] bool: True for each group of k consecutive scores that are not all equal.

    A group whose k responses all score exactly the same has zero advantage under rloo and grpo
    (each response equals its baseline), so it adds no policy gradient. DAPO's dynamic sampling
    (Yu et al. 2025, "DAPO", eq. 11: 0 < |{o_i : o_i correct}| < G) keeps only the others.

    Args:
        scores: [B] sequence scores, B a multiple of k, groups in consecutive rows.
    """
    if k < 1 or scores.numel() % k:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {k}")
    groups = scores.reshape(-1, k)
    return groups.amax(dim=1) != groups.amin(dim=1)


def kl_shaped_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      mask: torch.Tensor, beta: float, estimator: str = "k1",
                      placed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -beta * KL on every sampled token, plus the score on the last one.

    r_t = -beta * kl_t * m_t + [t == last(m)] * score (+ placed_t),  kl_t = estimate(...)

    The score goes on the last sampled token (EOS, or the last token of a truncated response),
    not one past it, which would land on padding and be masked away. `placed` [B, T]: rewards
    already at their tokens (each turn's reward on its last token), added where `mask` is true.

    Args:
        scores: [B] sequence scores (reward model or reward function).
        logprobs: [B, T] log pi(y_t) of the response tokens.
        ref_logprobs: [B, T] log ref(y_t) of the same tokens.
        mask: [B, T] bool, true on real response tokens; every row needs at least one.
        beta: KL coefficient >= 0.
        estimator: "k1" (the classic choice), "k2", "k3" or "abs"; see `tether.kl.estimate`.

    Returns:
        (rewards, kl): both [B, T] fp32 and zero on padding; `kl` is the masked per-token
        estimate, whose row sums are the per-sequence KL the controller needs.
    """
    non_negative("beta", beta)
    same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"shape mismatch: scores {tuple(scores.shape)} needs one score per row "
                         f"of logprobs {tuple(logprobs.shape)}")
    # [B] index of the last true position of each row; -1 for empty rows
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).amax(dim=-1)
    if bool((last < 0).any()):
        raise ValueError("a response has no real tokens in mask; every row needs at least one")
    # torch.where, not a product: whatever a padded position holds (even inf or NaN from a
    # masked-out logit) must not leak into the rewards.
    kl = torch.where(mask.bool(), kl_lib.estimate(logprobs.float(), ref_logprobs.float(),
                                                  estimator), 0.0)
    rewards = -beta * kl
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.float()
    if placed is not None:
        same_shape(placed=placed, mask=mask)
        rewards = rewards + torch.where(mask.bool(), placed.float(), 0.0)
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", eq. 16).

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    returns = A + V

    t runs over the policy's own tokens (`mask`): t + 1 is the next token the policy sampled. A
    masked token is no step of the policy's: padding, or an environment's observation between
    two turns, which the policy reads but did not choose. The return carries across it, so an
    observation of any length leaves every advantage unchanged (a masked token is not the end of
    the episode). Past a sequence's last sampled token values and advantages count as 0: the
    episode has ended.

    Args:
        rewards: [B, T] per-token rewards (see `kl_shaped_rewards`).
        values: [B, T] value estimates V(s_t).
        mask: [B, T] bool, true on the tokens the policy sampled.
        gamma: discount per sampled token in [0, 1]; 1 is the usual choice for language.
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages, returns): [B, T] fp32, zero where `mask` is false.
    """
    same_shape(rewards=rewards, values=values, mask=mask)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")
    real = mask.bool()
    mask_f = mask.float()
    values = torch.where(real, values.float(), 0.0)  # masked positions may hold anything
    rewards = torch.where(real, rewards.float(), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])  # replaced, never written
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask_f[:, t]
        # across a masked token the next sampled token's value and advantage carry on
        next_value = torch.where(real[:, t], values[:, t], next_value)
        next_advantage = torch.where(real[:, t], advantages[:, t], next_advantage)
    return advantages, (advantages + values) * mask_f


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Masked standardisation: (x - mean) / std over the positions where `mask` is true.

    mean = sum(x * m) / sum(m);  var = sum((x - mean)^2 * m) / sum(m)  (population variance, so
    the result has masked std exactly 1). With shift_mean=False the mean is added back: the scale
    is normalised but the sign information of the mean is kept (used for rewards, where
    re-centring would shift the score the policy optimises).

    Args:
        x: [...] values.
        mask: [...] bool, same shape, with at least one true entry.

    Returns:
        [...] fp32 whitened values, zero where `mask` is false.
    """
    same_shape(x=x, mask=mask)
    mask_f = mask.float()
    count = mask_f.sum()
    if count < 1:
        raise ValueError("whiten needs at least one true entry in mask")
    x = x.float()
    mean = (x * mask_f).sum() / count
    var = ((x - mean).square() * mask_f).sum() / count
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask_f


def _group_returns(rewards: torch.Tensor, mask: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """[B // k, k] sequence returns R_i = sum_t r_{i,t} over real tokens, one row per prompt."""
    same_shape(rewards=rewards, mask=mask)
    if rewards.dim() != 2:
        raise ValueError(f"{name} takes [B, T] rewards and mask, got {tuple(rewards.shape)}")
    if k < 2:
        raise ValueError(f"{name} needs k >= 2 samples per prompt (a baseline from the other "
                         f"samples of the group), got k={k}")
    batch = rewards.shape[0]
    if batch % k:
        raise ValueError(f"{name}: a batch of {batch} rows is not a whole number of groups of "
                         f"k={k}; pass n_prompts * k rows, the k samples of a prompt adjacent")
    if not bool(mask.bool().any(dim=-1).all()):
        raise ValueError("a response has no real tokens in mask; every row needs at least one")
    return torch.where(mask.bool(), rewards.float(), 0.0).sum(dim=-1).view(batch // k, k)


def _on_real_tokens(sequence_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's advantage on its real tokens, 0 on padding."""
    return torch.where(mask.bool(), sequence_advantages.reshape(-1, 1), 0.0)


def rloo(rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!"; for RLHF, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs").

    R_i = sum_t r_{i,t}
    A_i = R_i - 1/(k - 1) * sum_{j != i, j in group(i)} R_j  =  k/(k - 1) * (R_i - mean_group R)

    The baseline of sample i excludes R_i, so it is independent of y_i and the gradient estimate
    stays unbiased. The advantages of a group sum to 0.

    Args:
        rewards: [B, T] per-token rewards (`kl_shaped_rewards`), B = n_prompts * k.
        mask: [B, T] bool, true on real response tokens; every row needs at least one.
        k: samples per prompt, >= 2; rows i*k .. i*k + k - 1 share a prompt.

    Returns:
        [B, T] fp32 advantages: A_i on every real token of row i, 0 on padding.
    """
    returns = _group_returns(rewards, mask, k, "rloo")  # [n_prompts, k]
    others_mean = (returns.sum(dim=1, keepdim=True) - returns) / (k - 1)
    return _on_real_tokens(returns - others_mean, mask)


def grpo(rewards: torch.Tensor, mask: torch.Tensor, k: int, scale_rewards: str = "group",
         eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages, outcome supervision (Shao et al. 2024, "DeepSeekMath", GRPO).

    group: A_i = (R_i - mean_group R) / (std_group R + eps)
    batch: A_i = (R_i - mean_group R) / (std_batch R + eps)   (std over every reward of the
                                               batch: a prompt whose rewards barely vary is no
                                               longer scaled up; TRL's scale_rewards="batch",
                                               after Hu et al. 2025 "REINFORCE++" on global
                                               normalisation)
    none:  A_i =  R_i - mean_group R          (Dr. GRPO, Liu et al. 2025, "Understanding
                                               R1-Zero-Like Training: A Critical Perspective")

    std is the sample standard deviation (Bessel-corrected, torch.std's default, as the common
    GRPO implementations compute it; the paper writes std(r) without saying which), and eps
    (TRL's 1e-4) keeps a group of equal rewards at A = 0 instead of 0/0. Dividing by the group's
    std weighs prompts by how much their rewards vary and scales the reward, not a KL loss term:
    Liu et al. remove it. `none` equals `rloo` times (k - 1)/k: the group mean includes the
    sample, so beside a KL loss term beta acts as beta * k/(k - 1) (docs/ppo.md).

    Args:
        rewards: [B, T] per-token rewards (`kl_shaped_rewards`), B = n_prompts * k.
        mask: [B, T] bool, true on real response tokens; every row needs at least one.
        k: samples per prompt, >= 2; rows i*k .. i*k + k - 1 share a prompt.
        scale_rewards: "group" (divide by the group's std), "batch" (by the std of all B
            rewards) or "none".
        eps: > 0, added to the std.

    Returns:
        [B, T] fp32 advantages: A_i on every real token of row i, 0 on padding.
    """
    entry(("group", "batch", "none"), scale_rewards, "scale_rewards")
    positive("eps", eps)
    returns = _group_returns(rewards, mask, k, "grpo")  # [n_prompts, k]
    advantages = returns - returns.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (returns.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (returns.std() + eps)
    return _on_real_tokens(advantages, mask)


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                 eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): the per-token return-to-go, whitened over the whole batch.

    G_t = sum_{s >= t} gamma^(s - t) r_s      (the policy's own tokens; observations carry it)
    A_t = (G_t - mean(G)) / sqrt(var(G) + eps)  over all real tokens of the batch

    Subtracting the batch mean makes it a baseline shared by every token of the batch (no
    critic, no groups: k is not needed); it is a token mean, so longer responses weigh more in
    it, and it depends on the sample itself, a bias of order 1/(number of tokens). The division
    by the std scales the KL-shaped return as a whole, so with the KL in the reward it changes
    the step size, not the fixed point. Under data parallelism the statistics must be global.

    Args:
        rewards: [B, T] per-token rewards (`kl_shaped_rewards`).
        mask: [B, T] bool, true on real response tokens.
        gamma: discount in [0, 1].
        eps: added to the (population) variance, as in `whiten`.

    Returns:
        [B, T] fp32 advantages, 0 on padding.
    """
    # GAE with V = 0 and lambda = 1 is exactly the discounted return-to-go.
    returns_to_go, _ = gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), mask,
                           gamma=gamma, lam=1.0)
    return whiten(returns_to_go, mask, shift_mean=True, eps=eps)


@dataclass(frozen=True)
class AdvantageSpec:
    """Which estimator, and its settings, named as the run's config names them (--advantage,
    --gamma, --lam, --whiten-advantages resolved, --samples-per-prompt, --scale-rewards)."""

    advantage: str = "gae"  # a key of tether.choices.ADVANTAGES
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True  # gae only: standardise over the batch's sampled tokens
    samples_per_prompt: int = 1  # k: the group rloo and grpo compare
    scale_rewards: str = "group"  # grpo: "group", "batch" or "none"


# The estimators of `tether.choices.ADVANTAGES`: (spec, rewards, values, mask) -> (advantages,
# returns), all [B, T]. The critic-free ones compare the spec.samples_per_prompt responses to
# each prompt and give a critic no targets (zeros).

def gae_advantages(spec: AdvantageSpec, rewards, values, mask):
    """GAE on the critic's values (Schulman et al. 2015), whitened unless the spec says not."""
    advantages, returns = gae(rewards, values, mask, spec.gamma, spec.lam)
    return (whiten(advantages, mask) if spec.whiten_advantages else advantages), returns


def rloo_advantages(spec: AdvantageSpec, rewards, values, mask):
    """RLOO (Ahmadian et al. 2024)."""
    return rloo(rewards, mask, spec.samples_per_prompt), torch.zeros_like(rewards)


def grpo_advantages(spec: AdvantageSpec, rewards, values, mask):
    """GRPO (Shao et al. 2024); scale_rewards "none": Dr. GRPO (Liu et al. 2025)."""
    return (grpo(rewards, mask, spec.samples_per_prompt, spec.scale_rewards),
            torch.zeros_like(rewards))


def reinforce_pp_advantages(spec: AdvantageSpec, rewards, values, mask):
    """REINFORCE++ (Hu 2025)."""
    return reinforce_pp(rewards, mask, spec.gamma), torch.zeros_like(rewards)


def estimate_advantages(spec: AdvantageSpec, rewards: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor, episode: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] from the per-token rewards [B, T] by `spec.advantage`
    (`tether.choices.ADVANTAGES`); `values` [B, T] are read by gae only, `mask` [B, T] is the
    sampled tokens.

    `episode` [B]: the episode of each row, when an episode spans several rows (segments; rows of
    an episode consecutive and in order). The estimator then runs on the episodes, each one's
    rows laid end to end (`by_episode`): the return carries from one segment into the next, and
    the k samples of a prompt are k episodes, whatever their rows."""
    estimator = entry(ADVANTAGES, spec.advantage, "advantage estimator").fn
    if episode is None:
        return estimator(spec, rewards, values, mask)
    return by_episode(lambda r, v, m: estimator(spec, r, v, m), rewards, values, mask, episode)


def by_episode(fn, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               episode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(rewards, values, mask) -> (advantages, returns)` on episodes instead of rows: episode
    e's rows r_1 .. r_n (each [T]) laid end to end as one row [n * T] of an [E, n_max * T] batch,
    and the results put back in the rows' places."""
    rows_of = [(episode == e).nonzero().flatten() for e in range(int(episode.max()) + 1)]
    width = rewards.shape[1]
    span = max(len(rows) for rows in rows_of) * width

    def laid(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((len(rows_of), span), dtype=x.dtype, device=x.device)
        for e, rows in enumerate(rows_of):
            out[e, :len(rows) * width] = x[rows].reshape(-1)
        return out

    def back(y: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rewards.shape, dtype=y.dtype, device=y.device)
        for e, rows in enumerate(rows_of):
            out[rows] = y[e, :len(rows) * width].reshape(len(rows), width)
        return out
    advantages, returns = fn(laid(rewards), laid(values), laid(mask))
    return back(advantages), back(returns)
