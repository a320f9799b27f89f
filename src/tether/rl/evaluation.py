"""Held-out evaluation of a policy: proxy and gold reward, KL to the reference, diversity.

One helper builds the inputs (`eval_inputs`: prompt encoding, EOS set, seed) and one
function measures (`evaluate_policy`), for PPO's periodic evaluation, `tether eval` and the
demo alike, so every policy in a comparison is measured the same way: the same prompt ids, the
same seeded sampling stream at the same temperature, the same KL formula. The SFT model scored
offline and PPO's step 0 (the same model) therefore give the same numbers.

Notation: B prompts in a chunk, R response width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tether.data.prompts import load_prompts
from tether.rl.reward import Reward
from tether.rl.reward.pool import check_scored
from tether.rl.rollout import Rollout
from tether.rl.scoring import score_rollout
from tether.rl.sources import Collected, RolloutSource

# The held-out sampling stream is seeded apart from the training one (run seed + this), so an
# evaluation never replays a training batch's draws.
EVAL_SEED_OFFSET = 7_919


@dataclass
class EvalInputs:
    """Everything an evaluation samples from, built once by `eval_inputs`."""

    prompts: list[str]  # the prompt texts a reward function reads
    prompt_ids: list[list[int]]  # their ids under the one encoding rule (tether.data.encoding)
    eos_token_ids: list[int]  # every id that ends a response
    seed: int  # the sampling generator's seed (run seed + EVAL_SEED_OFFSET)


def eval_inputs(tokenizer, prompts_source: str, eos: list[int], settings) -> EvalInputs:
    """The inputs of a held-out evaluation: prompts encoded by the rule every stage uses
    (`tether.data.load_prompts`, cut to `max_prompt_len`), the EOS set (`policy_eos_ids`), and
    the sampling seed. PPO, `tether eval` and `tether generate` call this. `settings`: a config
    with the fields `max_prompt_len` and `seed`, named as in PPOConfig (and `tether eval`'s
    EvalConfig)."""
    prompts, prompt_ids = load_prompts(prompts_source, tokenizer, settings.max_prompt_len)
    return EvalInputs(prompts, prompt_ids, list(eos), settings.seed + EVAL_SEED_OFFSET)


def distinct_ngrams(sequences: Sequence[Sequence], n: int) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams over all n-grams of `sequences` (each a
    sequence of words or of token ids); 0.0 when no sequence has n items."""
    grams = [tuple(seq[i:i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct-n over whitespace words: reads 0 for answers of fewer than n words (a number, a
    word, code without spaces), which is why `eval/distinct_2_tokens` counts token ids too."""
    return distinct_ngrams([t.split() for t in texts], n)


@torch.no_grad()
def measure_responses(policy: nn.Module, reference: nn.Module, rollout: Rollout,
                      chunked_lm_head: bool = True, start: nn.Module | None = None
                      ) -> dict[str, torch.Tensor]:
    """Per-response KL (k1 and exact), mean entropy, length and EOS flag of one chunk, each [B],
    over the tokens the policy sampled (`action_mask`). `chunked_lm_head`: log-probs and
    entropies through the LM head in chunks (tether.lm_head). `start`: the SFT model when the
    reference is another anchor (tether.rl.anchor): its KLs too, as kl_sft and kl_sft_exact."""
    if start is not None:
        to_start = measure_responses(policy, start, rollout, chunked_lm_head)
        return measure_responses(policy, reference, rollout, chunked_lm_head) | {
            f"kl_sft{key[2:]}": to_start[key] for key in ("kl", "kl_exact") if key in to_start}
    # the log-probs of what was sampled, at its temperature, as the loop scores pi_old
    scored = score_rollout(policy, reference, None, rollout, None, len(rollout), chunked_lm_head)
    action_mask = rollout.action_mask.float()  # [B, R]
    out = {"kl": ((scored.logprobs - scored.ref_logprobs) * action_mask).sum(1),
           "ent": (scored.entropy * action_mask).sum(1) / action_mask.sum(1).clamp(min=1),
           "len": action_mask.sum(1), "eos": rollout.ended.float()}
    if not bool(scored.exact_kl.isnan().all()):  # all NaN: the heads do not allow it
        out["kl_exact"] = (scored.exact_kl * action_mask).sum(1)
    return {k: v.float().cpu() for k, v in out.items()}


# measure(rollout) -> `measure_responses`'s dict, run where the models may run
Measure = Callable[[Rollout], dict[str, torch.Tensor]]


@dataclass
class Evaluation:
    """A held-out evaluation: a source of its rows (its prompts answered once, or episodes of
    the run's environment), sampled `chunk` rows at a time with the noise of `seed`."""

    source: RolloutSource
    rows: int  # rows of the held-out prompt file
    chunk: int  # rows per sampling call (part of nothing: each row has its own noise)
    seed: int  # the sampling stream's seed (run seed + EVAL_SEED_OFFSET)


@torch.no_grad()
def evaluate_policy(evaluation: Evaluation, measure: Measure, gold: Reward | None
                    ) -> tuple[dict[str, float], list[dict]]:
    """Sample one response (or episode) per held-out row, seeded, and measure it.

    Metrics: `eval/score` (the source's reward: the proxy, or an environment's), `eval/gold_score`
    (if `gold`), `eval/kl` (mean over rows of sum_t log pi(y_t) - log ref(y_t) over the tokens the
    policy sampled, the k1 sequence KL), `eval/kl_exact` (mean over rows of sum_t KL(pi(. | s_t)
    || ref(. | s_t)) over the vocabulary at each sampled prefix, when both heads allow it),
    `eval/entropy` (mean per-token entropy of pi), `eval/response_len` (the policy's own tokens),
    `eval/eos_rate` (responses or episodes that ended), `eval/distinct_2` and
    `eval/distinct_2_tokens` (diversity of the responses: word pairs, and pairs of the token ids
    the policy sampled, which any text has), and for environments the episode means `eval/turns`, `eval/action_tokens`,
    `eval/observation_tokens`, `eval/done_rate`, `eval/segments`, `eval/cut_observations`. The seed
    is fixed, so successive evaluations differ only through the policy; a proxy score that rises
    while the gold score falls is over-optimisation (Gao et al. 2022).
    `measure`: `measure_responses` on the policy and its reference, called where they may run
    (inside the training wrapper, or directly on frozen models).

    Returns:
        (metrics, samples): samples are {prompt, response, score, gold_score} per row.
    """
    rows = list(range(evaluation.rows))
    parts: dict[str, list[torch.Tensor]] = {}
    prompts: list[str] = []
    texts: list[str] = []
    token_ids: list[list[int]] = []
    env: dict[str, float] = {}
    for start in range(0, len(rows), evaluation.chunk):
        part = evaluation.source.collect(rows, slice(start, start + evaluation.chunk),
                                         evaluation.seed)
        measured, chunk_prompts, chunk_texts = measured_chunk(part, measure, gold)
        token_ids += part.rollout.sampled_ids()  # an episode's turns joined
        prompts += chunk_prompts
        texts += chunk_texts
        for key, value in measured.items():
            parts.setdefault(key, []).append(value)
        for key, value in part.stats.items():  # episode means, weighted by the chunk's episodes
            env[key] = env.get(key, 0.0) + value * len(chunk_texts)
    joined = {k: torch.cat(v) for k, v in parts.items()}
    # eval/<key>, but for these (score, kl, kl_exact, kl_sft, kl_sft_exact keep their names)
    names = {"gold": "gold_score", "ent": "entropy", "len": "response_len", "eos": "eos_rate"}
    metrics = {f"eval/{names.get(k, k)}": v.mean().item() for k, v in joined.items()}
    metrics["eval/distinct_2"] = distinct_n(texts, 2)
    metrics["eval/distinct_2_tokens"] = distinct_ngrams(token_ids, 2)
    # env/turns -> eval/turns; reward/<name> -> eval/reward/<name> (a function's name is the
    # user's, and must not land on eval/score or eval/kl)
    metrics |= {"eval/" + (k.split("/", 1)[1] if k.startswith("env/") else k): v / len(texts)
                for k, v in env.items()}

    def per_prompt(key: str) -> list:
        return joined[key].tolist() if key in joined else [None] * len(texts)
    return metrics, [{"prompt": p, "response": r, "score": s, "gold_score": g}
                     for p, r, s, g in zip(prompts, texts, per_prompt("score"), per_prompt("gold"))]


def measured_chunk(part: Collected, measure: Measure, gold: Reward | None
                   ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """One chunk's per-episode measures (`measure`'s, the source's score, the gold score), and
    its prompts and texts, each episode's once (its last row's)."""
    last = part.rollout.last_rows().cpu()
    measured = per_episode(measure(part.rollout), part.rollout)
    # Held-out prompts are fixed, so a row the reward pool could not score cannot be drawn
    # again: one line, as a raising function is without the pool (tether.rl.reward.pool).
    check_scored(part.failed, "the held-out evaluation")
    if part.scores is not None:
        measured["score"] = part.scores.float().cpu()[last]
    keep = last.tolist()
    prompts = [p for p, k in zip(part.prompts, keep) if k]
    texts = [t for t, k in zip(part.texts, keep) if k]
    if gold is not None:
        table = [r for r, k in zip(part.rows, keep) if k] if part.rows else None  # prompt rows
        scored = gold(prompts, texts, part.rollout, table)
        check_scored(scored.failed, "the held-out evaluation's gold reward")
        measured["gold"] = scored.scores.float().cpu()
    return measured, prompts, texts


def per_episode(measured: dict[str, torch.Tensor], rollout: Rollout) -> dict[str, torch.Tensor]:
    """`measure_responses`'s per-row values as per-episode ones: KLs and lengths summed over an
    episode's rows, the entropy averaged over its tokens, the EOS flag of its last row."""
    if rollout.episode is None:
        return measured
    out = {key: rollout.episode_sums(measured[key])
           for key in ("kl", "kl_exact", "kl_sft", "kl_sft_exact", "len") if key in measured}
    out["ent"] = rollout.episode_sums(measured["ent"] * measured["len"]) / out["len"].clamp(min=1)
    out["eos"] = measured["eos"][rollout.last_rows().cpu()]
    return out
