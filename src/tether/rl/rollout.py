"""A rollout batch: the sampled responses in one layout every engine returns and every scorer
reads, with the noise that makes them reproducible, stop strings and the decoded text.

Notation: B batch, P prompt (context) width, R response width.

Layout of a rollout batch (one row per prompt)::

    [pad pad p1 p2 p3 | r1 r2 EOS pad]      input_ids       [B, P + R]
    [ 0   0  1  1  1  |  1  1  1   0 ]      attention_mask  [B, P + R]
                        [1  1  1   0 ]      response_mask   [B, R]

Prompts are left-padded so every response starts at column P; what follows a response's end
(EOS, stop string, or max_new_tokens) is padding. Masks come from the sampling itself, never from
comparing tokens to the pad id, so a sampled EOS (or even a sampled pad id) is never mistaken for
padding (pitfall: "pad is not EOS").

The engines that sample a rollout live in `tether.rl.engines` (`native`: tether's own KV-cached
sampler; `vllm_engine`: vLLM, which also reports its own log-probs of the sampled tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tether.run.config import check_stop_strings


@dataclass
class Rollout:
    """One batch of sampled responses in the layout above."""

    input_ids: torch.Tensor  # [B, P + R] prompt (left-padded), response, padding
    attention_mask: torch.Tensor  # [B, P + R] 1 on real prompt and response tokens
    response_mask: torch.Tensor  # [B, R] bool, True on real response tokens (EOS included)
    ended: torch.Tensor  # [B] bool, True when the response ended by EOS or a stop string
    context_length: int  # P
    # The temperature the responses were sampled at: every log-prob of them (policy, old
    # policy, reference) must be taken at it, or the KL and the ratio are wrong (DESIGN.md).
    temperature: float = 1.0
    # [B, R] the engine's own log-prob of each sampled token, log_softmax(z / T), 0 on padding;
    # None from the native engine, which is the trainer's model (rl.engines.mismatch).
    engine_logprobs: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:  # [B, R]
        return self.input_ids[:, self.context_length:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows `index` (a minibatch), same widths."""
        return replace(self, input_ids=self.input_ids[index],
                       attention_mask=self.attention_mask[index],
                       response_mask=self.response_mask[index], ended=self.ended[index],
                       engine_logprobs=(None if self.engine_logprobs is None
                                        else self.engine_logprobs[index]))


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """The rows of several rollouts as one, in order, in the layout above: every prompt
    left-padded to the widest context, every response right-padded to the widest response. The
    extra padding is masked out, so each row scores as it did alone."""
    if len({r.temperature for r in rollouts}) != 1:
        raise ValueError("rollouts sampled at different temperatures cannot be one batch")
    context = max(r.context_length for r in rollouts)
    width = max(r.responses.shape[1] for r in rollouts)
    parts: dict[str, list[torch.Tensor]] = {"ids": [], "attention": [], "response": [],
                                            "engine": []}
    for r in rollouts:
        left, right = context - r.context_length, width - r.responses.shape[1]
        parts["ids"].append(F.pad(r.input_ids, (left, right), value=pad_token_id))
        parts["attention"].append(F.pad(r.attention_mask, (left, right), value=0))
        parts["response"].append(F.pad(r.response_mask, (0, right), value=False))
        if r.engine_logprobs is not None:
            parts["engine"].append(F.pad(r.engine_logprobs, (0, right), value=0.0))
    engine = torch.cat(parts["engine"]) if len(parts["engine"]) == len(rollouts) else None
    return Rollout(torch.cat(parts["ids"]), torch.cat(parts["attention"]),
                   torch.cat(parts["response"]), torch.cat([r.ended for r in rollouts]), context,
                   rollouts[0].temperature, engine)


def sampling_uniforms(seed: int, n_rows: int, max_new_tokens: int) -> torch.Tensor:
    """[n_rows, max_new_tokens] uniforms in [0, 1) for a global batch, from one CPU generator
    seeded with `seed`: rank r (or a chunk) takes its rows' slice, so the samples do not depend on
    the world size or the chunking, and a resumed run draws what the uninterrupted one did."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((n_rows, max_new_tokens), generator=generator)


def apply_stop_strings(rollout: Rollout, tokenizer, stop_strings: Sequence[str],
                       pad_token_id: int) -> Rollout:
    """Cut each response just after the first token that completes one of `stop_strings`.

    The stop string stays in the response (like EOS); what follows becomes padding, and the row
    counts as ended (it gets no missing-EOS penalty).
    """
    if not stop_strings:
        return rollout
    check_stop_strings(stop_strings)  # a Python caller's config may never have been validated
    input_ids = rollout.input_ids.clone()
    response_mask = rollout.response_mask.clone()
    ended = rollout.ended.clone()
    context = rollout.context_length
    for row in range(len(rollout)):
        length = int(response_mask[row].sum())
        tokens = input_ids[row, context:context + length].tolist()
        if not any(s in tokenizer.decode(tokens) for s in stop_strings):
            continue
        cut = next(k for k in range(1, length + 1)
                   if any(s in tokenizer.decode(tokens[:k]) for s in stop_strings))
        response_mask[row, cut:] = False
        input_ids[row, context + cut:] = pad_token_id
        ended[row] = True
    attention_mask = torch.cat([rollout.attention_mask[:, :context], response_mask.long()], dim=1)
    engine_logprobs = rollout.engine_logprobs
    if engine_logprobs is not None:
        engine_logprobs = engine_logprobs * response_mask
    return replace(rollout, input_ids=input_ids, attention_mask=attention_mask,
                   response_mask=response_mask, ended=ended, engine_logprobs=engine_logprobs)


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """The text of each response (special tokens such as EOS dropped), for reward functions."""
    return [tokenizer.decode(row[mask].tolist(), skip_special_tokens=True)
            for row, mask in zip(rollout.responses, rollout.response_mask, strict=True)]
