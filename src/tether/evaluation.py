"""Held-out evaluation of a policy: proxy and gold reward, KL to the reference, diversity.

One function serves PPO's periodic evaluation and the scoring of any other policy (SFT, DPO,
IPO), so every run in a comparison is measured the same way: the same prompts, the same seeded
sampling at the same temperature, the same KL formula.

Notation: B prompts in a chunk, R response width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tether.rollout import (
    Rollout,
    decode_responses,
    left_pad,
    sample_responses,
    sampling_uniforms,
)
from tether.trunk_head import score_responses

# reward(prompts, responses, rollout) -> scores [B]
Reward = Callable[[list[str], list[str], Rollout], torch.Tensor]


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct-n (Li et al. 2016): unique word n-grams over all word n-grams in `texts`."""
    grams = [tuple(words[i:i + n]) for words in (t.split() for t in texts)
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def evaluate_policy(policy: nn.Module, reference: nn.Module, tokenizer, prompts: list[str],
                    prompt_ids: list[list[int]], reward: Reward, gold: Reward | None, *,
                    max_new_tokens: int, temperature: float, eos_token_ids: list[int],
                    batch_size: int, seed: int,
                    chunked_lm_head: bool = True) -> tuple[dict[str, float], list[dict]]:
    """Sample one response per prompt (seeded) and measure it.

    Metrics: `eval/score` (proxy), `eval/gold_score` (if `gold`), `eval/kl` (mean over prompts of
    sum_t log pi(y_t) - log ref(y_t), the k1 sequence KL), `eval/entropy` (mean per-token entropy
    of pi), `eval/response_len`, `eval/eos_rate`, `eval/distinct_2` (diversity of the responses).
    The seed is fixed, so successive evaluations differ only through the policy; a proxy score
    that rises while the gold score falls is over-optimisation (Gao et al. 2022).
    `chunked_lm_head`: log-probs and entropies through the LM head in chunks (tether.lm_head).

    Returns:
        (metrics, samples): samples are {prompt, response, score, gold_score} per prompt.
    """
    device = next(policy.parameters()).device
    uniforms = sampling_uniforms(seed, len(prompts), max_new_tokens)  # per prompt: chunk-invariant
    pad = tokenizer.pad_token_id
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("score", "gold", "kl", "ent", "len",
                                                             "eos")}
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = left_pad(prompt_ids[start:start + batch_size], pad, device)
        rollout = sample_responses(policy, ids, mask, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_ids=eos_token_ids,
                                   pad_token_id=pad,
                                   uniforms=uniforms[start:start + batch_size])
        responses = decode_responses(tokenizer, rollout)
        texts += responses
        parts["score"].append(reward(chunk, responses, rollout).float().cpu())
        if gold is not None:
            parts["gold"].append(gold(chunk, responses, rollout).float().cpu())
        args = (rollout.input_ids, rollout.attention_mask, rollout.context_length,
                rollout.temperature)  # the log-probs of what was sampled, at its temperature
        scores = score_responses(policy, *args, chunked=chunked_lm_head, entropy=True)
        ref = score_responses(reference, *args, chunked=chunked_lm_head)
        response_mask = rollout.response_mask.float()
        parts["kl"].append(((scores.logprobs - ref.logprobs) * response_mask).sum(1).cpu())
        token_entropy = scores.entropy * response_mask
        parts["ent"].append((token_entropy.sum(1) / response_mask.sum(1)).cpu())
        parts["len"].append(response_mask.sum(1).cpu())
        parts["eos"].append(rollout.ended.float().cpu())
    joined = {k: torch.cat(v) for k, v in parts.items() if v}
    metrics = {"eval/score": joined["score"].mean().item(), "eval/kl": joined["kl"].mean().item(),
               "eval/entropy": joined["ent"].mean().item(),
               "eval/response_len": joined["len"].mean().item(),
               "eval/eos_rate": joined["eos"].mean().item(),
               "eval/distinct_2": distinct_n(texts, 2)}
    if "gold" in joined:
        metrics["eval/gold_score"] = joined["gold"].mean().item()
    samples = [{"prompt": p, "response": r, "score": float(s),
                "gold_score": float(joined["gold"][i]) if "gold" in joined else None}
               for i, (p, r, s) in enumerate(zip(prompts, texts, joined["score"].tolist()))]
    return metrics, samples
