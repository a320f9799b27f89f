"""Rollouts: sample responses from the policy, then score exactly those tokens.

Notation: B batch, P prompt (context) width, R response width, V vocabulary.

Layout of a rollout batch (one row per prompt)::

    [pad pad p1 p2 p3 | r1 r2 EOS pad]      input_ids       [B, P + R]
    [ 0   0  1  1  1  |  1  1  1   0 ]      attention_mask  [B, P + R]
                        [1  1  1   0 ]      response_mask   [B, R]

Prompts are left-padded so every response starts at column P; what follows a response's end
(EOS, stop string, or max_new_tokens) is padding. Masks come from the sampling itself, never from
comparing tokens to the pad id, so a sampled EOS (or even a sampled pad id) is never mistaken for
padding (pitfall: "pad is not EOS").

Every forward pass computes position ids from the attention mask, so a left-padded row gets the same
positions, hence the same log-probs, as the same row alone (batch invariance).

The decoding itself (the prompt's forward, then one token per step through the KV cache: a lean
step for GPT-2, Llama, Mistral and Qwen2, the model's own forward otherwise) is in decode.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tether.decode import LeanDecoder, ModelForward, prefill


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

    @property
    def responses(self) -> torch.Tensor:  # [B, R]
        return self.input_ids[:, self.context_length:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows `index` (a minibatch), same widths."""
        return replace(self, input_ids=self.input_ids[index],
                       attention_mask=self.attention_mask[index],
                       response_mask=self.response_mask[index], ended=self.ended[index])


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and mask with each sequence right-aligned (left padding)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, 2, ... over the real tokens of each row; pads get 0 (they are masked).

    GPT-2-style models with absolute positions otherwise give a left-padded prompt positions that
    start past 0, and its log-probs change with the amount of padding.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sampling_uniforms(seed: int, n_rows: int, max_new_tokens: int) -> torch.Tensor:
    """[n_rows, max_new_tokens] uniforms in [0, 1) for a global batch, from one CPU generator
    seeded with `seed`: rank r (or a chunk) takes its rows' slice, so the samples do not depend on
    the world size or the chunking, and a resumed run draws what the uninterrupted one did."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((n_rows, max_new_tokens), generator=generator)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inversion: the first token whose cumulative
    probability reaches (1 - u) * total, with `uniforms` u [B] in [0, 1) (Devroye 1986, ch. 2.1).

    1 - u lies in (0, 1], so a token of probability 0 is never chosen (not even the first one);
    scaling by the row's own total absorbs the cumsum's rounding. The cumsum is float64: in
    float32 each step rounds by ~6e-8 absolute, which over a 128k vocabulary moves ~0.5% of the
    probability mass (torch.multinomial accumulates in double on the CPU too). Returns [B] long.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = (1.0 - uniforms.double())[:, None] * cdf[:, -1:]  # [B, 1]
    token = torch.searchsorted(cdf, target).squeeze(1)
    return token.clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample_responses(policy: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                     max_new_tokens: int, temperature: float, eos_token_ids: Sequence[int],
                     pad_token_id: int, generator: torch.Generator | None = None,
                     uniforms: torch.Tensor | None = None, all_done=None,
                     lean: bool = True) -> Rollout:
    """Sample up to `max_new_tokens` per prompt from softmax(logits / temperature), KV-cached.

    Plain ancestral sampling and nothing else: no top-k, top-p, repetition penalty or any of the
    model's `generation_config` defaults, because the log-probs used for the KL and the PPO ratio are
    those of softmax(logits / T) over the whole vocabulary; any other processor would make the
    sampled distribution differ from the one we score.

    Args:
        prompt_ids: [B, P] prompts, left-padded. prompt_mask: [B, P], 1 on real tokens.
        eos_token_ids: ids that end a response (the EOS token is kept as its last token).
        generator: a torch.Generator, for reproducible samples (used when `uniforms` is None).
        uniforms: [B, max_new_tokens] in [0, 1), row b's noise for each step (`sampling_uniforms`):
            a row's tokens depend on its own noise only, not on the batch it is sampled in, so
            any split of a global batch (ranks, chunks) samples what the whole batch would.
        all_done: `alive [B] -> bool`, whether sampling may stop (default: no row is alive);
            under FSDP2 every rank must run the same number of steps, so it is a global "any".
        lean: run identical prompt rows once and decode GPT-2/Llama/Mistral/Qwen2 with
            `decode.LeanDecoder` (the same samples, less overhead per step); False: the model's
            forward on every row at every step (the path before, kept for bench/sampling.py).
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling")
    batch, context_length = prompt_ids.shape
    device = prompt_ids.device
    if uniforms is None:
        uniforms = torch.rand((batch, max_new_tokens), generator=generator,
                              device=generator.device if generator is not None else "cpu")
    uniforms = uniforms.to(device)
    all_done = all_done or (lambda alive: not bool(alive.any()))
    attention_mask = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    logits, cache = prefill(policy, prompt_ids, attention_mask, position_ids, dedupe=lean)
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    decoder = LeanDecoder.build(policy, cache, attention_mask, next_position,
                                max_new_tokens) if lean else None
    decoder = decoder or ModelForward(policy, cache, attention_mask, next_position)
    del cache  # the decoder holds what it needs (the lean one copied it into its own buffers)
    eos = torch.tensor(list(eos_token_ids), device=device, dtype=torch.long)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    tokens, masks = [], []
    for step in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
        token = inverse_cdf_sample(probs, uniforms[:, step])
        token = torch.where(alive, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        masks.append(alive)
        alive = alive & ~torch.isin(token, eos)
        if step == max_new_tokens - 1 or all_done(alive):
            break
        logits = decoder.step(token, alive)  # [B, V] for the next token
    responses = torch.stack(tokens, dim=1)  # [B, R]
    response_mask = torch.stack(masks, dim=1)  # [B, R]
    ended = torch.isin(responses, eos).any(dim=1)
    return Rollout(input_ids=torch.cat([prompt_ids, responses], dim=1),
                   attention_mask=torch.cat([prompt_mask.long(), response_mask.long()], dim=1),
                   response_mask=response_mask, ended=ended, context_length=context_length,
                   temperature=temperature)


def apply_stop_strings(rollout: Rollout, tokenizer, stop_strings: Sequence[str],
                       pad_token_id: int) -> Rollout:
    """Cut each response just after the first token that completes one of `stop_strings`.

    The stop string stays in the response (like EOS); what follows becomes padding, and the row
    counts as ended (it gets no missing-EOS penalty).
    """
    if not stop_strings:
        return rollout
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
    return replace(rollout, input_ids=input_ids, attention_mask=attention_mask,
                   response_mask=response_mask, ended=ended)


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """The text of each response (special tokens such as EOS dropped), for reward functions."""
    return [tokenizer.decode(row[mask].tolist(), skip_special_tokens=True)
            for row, mask in zip(rollout.responses, rollout.response_mask, strict=True)]


def response_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    context_length: int, with_hidden: bool = False):
    """Logits (and optionally last hidden states) at the positions that predict the response.

    Position P - 1 + t predicts response token t, so we keep R + 1 positions and drop the last.
    Only those positions go through the LM head (`logits_to_keep`), sparing a [B, P, V] tensor.

    Returns:
        logits: [B, R, V]; hidden: [B, R, d] (the final, normed hidden state) or None.
    """
    keep = input_ids.shape[1] - context_length + 1
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), logits_to_keep=keep,
                output_hidden_states=with_hidden, use_cache=False)
    logits = out.logits[:, :-1]
    hidden = out.hidden_states[-1][:, context_length - 1:-1] if with_hidden else None
    return logits, hidden


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_t | x_<t) / T-scaled for every token t >= 1 of any padding layout: [B, L - 1].

    Used to check batch invariance under right padding, and by callers whose responses do not
    start at one shared column.
    """
    from tether.logprobs import token_logprobs

    logits, _ = response_logits(model, input_ids, attention_mask, context_length=1)
    return token_logprobs(logits, input_ids[:, 1:], temperature)
