"""A rollout batch: the sampled responses in one layout every engine returns and every scorer
reads, with the noise that makes them reproducible, stop strings and the decoded text.

Notation: B batch, P prompt (context) width, R response width.

Layout of a rollout batch (one row per prompt)::

    [pad pad p1 p2 p3 | r1 r2 EOS pad]      input_ids       [B, P + R]
    [ 0   0  1  1  1  |  1  1  1   0 ]      attention_mask  [B, P + R]
                        [1  1  1   0 ]      response_mask   [B, R]  real tokens after the prompt
                        [1  1  1   0 ]      action_mask     [B, R]  the tokens the policy sampled

Prompts are left-padded so every response starts at column P; what follows a response's end
(EOS, stop string, or max_new_tokens) is padding. Masks come from the sampling itself, never from
comparing tokens to the pad id, so a sampled EOS (or even a sampled pad id) is never mistaken for
padding (pitfall: "pad is not EOS").

Two masks, two meanings. `response_mask` is the layout's: which columns after the prompt hold a
real token (the attention mask's response part). `action_mask` is the policy's: which of those
tokens it sampled. The loss, every KL estimate, the entropy, the engine-mismatch corrections, the
score's position and every token count read `action_mask`; tokens the policy did not sample (an
environment's observation between two turns, tether.rl.env) are context only. In a single-turn
rollout the two are equal, and `action_mask` defaults to `response_mask`.

The engines that sample a rollout live in `tether.rl.engines` (`native`: tether's own KV-cached
sampler; `vllm_engine`: vLLM, which also reports its own log-probs of the sampled tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # [B, R] the engine's own log-prob of each sampled token, log_softmax(z / T), 0 elsewhere;
    # None from an engine that samples the trainer's model itself (rl.engines.mismatch).
    engine_logprobs: torch.Tensor | None = None
    # [B, R] bool, True on the tokens the policy sampled; None: every real response token.
    action_mask: torch.Tensor | None = None
    # [B] long, the episode each row belongs to, when an episode takes more than one row (a
    # chat template forced a new segment: tether.rl.env.render); an episode's rows are
    # consecutive, in order. None: row i is episode i.
    episode: torch.Tensor | None = None
    # [B, R] long, the policy version (optimizer steps taken) that sampled each token, 0
    # elsewhere; set by an engine that samples ahead of the trainer (rl.engines.ahead), None
    # when every token was sampled by the weights being trained.
    versions: torch.Tensor | None = None

    def __post_init__(self):
        if self.action_mask is None:
            self.action_mask = self.response_mask

    @classmethod
    def from_parts(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   responses: torch.Tensor, response_mask: torch.Tensor, ended: torch.Tensor,
                   temperature: float, **optional: torch.Tensor | None) -> Rollout:
        """The layout above from its parts: prompts [B, P] left-padded, `prompt_mask` 1 on their
        real tokens; what follows them, `responses` [B, R] right-padded, `response_mask` True on
        its real tokens; `ended` [B]. `optional`: the per-row fields engine_logprobs,
        action_mask, episode, versions (absent: None). Per-row lists become these tensors by
        `left_pad` (prompts) and `right_padded` (what follows them)."""
        return cls(torch.cat([prompt_ids, responses], dim=1),
                   torch.cat([prompt_mask.long(), response_mask.long()], dim=1), response_mask,
                   ended, prompt_ids.shape[1], temperature, **optional)

    @property
    def responses(self) -> torch.Tensor:  # [B, R]
        return self.input_ids[:, self.context_length:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rollout:
        """`fn` applied to every per-row tensor (`ROW_FIELDS`; absent ones stay None)."""
        return replace(self, **{name: fn(getattr(self, name)) for name in ROW_FIELDS
                                if getattr(self, name) is not None})

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows `index` (a minibatch), same widths."""
        return self.map_rows(lambda t: t[index])

    def episode_ids(self) -> torch.Tensor:
        """[B] the episode of each row (`episode`, or 0, 1, 2, ... when rows are episodes)."""
        if self.episode is not None:
            return self.episode
        return torch.arange(len(self), device=self.input_ids.device)

    def last_rows(self) -> torch.Tensor:
        """[B] bool: the rows that end an episode (every row, unless a template split episodes):
        an episode's rows are consecutive, so its last is the one before the id changes."""
        if self.episode is None:
            return torch.ones(len(self), dtype=torch.bool, device=self.input_ids.device)
        episode = self.episode
        return torch.cat([episode[1:] != episode[:-1], episode.new_ones(1, dtype=torch.bool)])

    def episode_sums(self, x: torch.Tensor) -> torch.Tensor:
        """[E] x [B] summed over each episode's rows (E episodes, `episode_ids` 0 .. E - 1), on
        x's device; `episode_sums(x)[episode_ids()]` puts each episode's sum on its rows."""
        episode = self.episode_ids().to(x.device)
        return torch.zeros(int(episode.max()) + 1, dtype=x.dtype,
                           device=x.device).index_add_(0, episode, x)

    def sampled_ids(self) -> list[list[int]]:
        """The token ids the policy sampled (`action_mask`) in each episode, its rows joined in
        order: one list per response when rows are responses."""
        joined: dict[int, list[int]] = {}
        for episode, row, mask in zip(self.episode_ids().tolist(), self.responses,
                                      self.action_mask.bool(), strict=True):
            joined.setdefault(episode, []).extend(row[mask].tolist())
        return list(joined.values())


@dataclass(frozen=True)
class Sampling:
    """How a turn is sampled (--max-new-tokens, --temperature, --stop-strings, the EOS set)."""

    max_new_tokens: int
    temperature: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    stop_strings: tuple[str, ...] = ()

    def engine_settings(self, max_new_tokens: int, uniforms: torch.Tensor) -> dict:
        """`RolloutEngine.sample`'s settings for a turn of at most `max_new_tokens` tokens, each
        row drawn from its row of `uniforms`."""
        return {"max_new_tokens": max_new_tokens, "temperature": self.temperature,
                "eos_token_ids": list(self.eos_token_ids), "pad_token_id": self.pad_token_id,
                "uniforms": uniforms}


# The per-row tensors of a Rollout: what selecting, gathering and concatenating rows carries.
ROW_FIELDS = ("input_ids", "attention_mask", "response_mask", "action_mask", "ended",
              "engine_logprobs", "episode", "versions")


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """The rows of several rollouts as one, in order, in the layout above: every prompt
    left-padded to the widest context, every response right-padded to the widest response. The
    extra padding is masked out, so each row scores as it did alone. A field some rollouts lack
    (the engine's log-probs) is dropped."""
    if len({r.temperature for r in rollouts}) != 1:
        raise ValueError("rollouts sampled at different temperatures cannot be one batch")
    context = max(r.context_length for r in rollouts)
    width = max(r.responses.shape[1] for r in rollouts)
    padded = [padded_to(r, context, width, pad_token_id) for r in rollouts]
    present = [name for name in ROW_FIELDS if all(getattr(r, name) is not None for r in padded)]
    joined = {name: torch.cat([getattr(r, name) for r in padded]) for name in present}
    if any(r.episode is not None for r in rollouts):  # each rollout's episodes after the last
        joined["episode"] = torch.cat(episode_numbers([r.episode_ids() for r in rollouts]))
    return Rollout(context_length=context, temperature=rollouts[0].temperature,
                   **{name: joined.get(name) for name in ROW_FIELDS})


def padded_to(rollout: Rollout, context: int, width: int, pad_token_id: int) -> Rollout:
    """`rollout` with its prompts left-padded to `context` columns and its responses
    right-padded to `width`; the padding is masked out, so each row scores as it did."""
    left, right = context - rollout.context_length, width - rollout.responses.shape[1]
    if left == right == 0:
        return rollout

    def pad(name: str, value: torch.Tensor) -> torch.Tensor:
        if name in ("ended", "episode"):  # [B]
            return value
        if name in ("input_ids", "attention_mask"):  # [B, P + R]: both sides
            return F.pad(value, (left, right), value=pad_token_id if name == "input_ids" else 0)
        return F.pad(value, (0, right), value=0)  # [B, R]: False or 0.0 after the response
    return replace(rollout, context_length=context,
                   **{name: pad(name, getattr(rollout, name)) for name in ROW_FIELDS
                      if getattr(rollout, name) is not None})


def episode_numbers(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Episode ids of consecutive blocks of rows, each block's renumbered after the last's."""
    out, offset = [], 0
    for ids in parts:
        out.append(ids + offset)
        offset += int(ids.max()) + 1 if len(ids) else 0
    return out


def right_padded(rows: Sequence[Sequence], width: int, fill, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(rows), width]: each row's values from column 0, `fill` after them (a per-token fact
    of responses of different lengths, in the layout above)."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for r, values in enumerate(rows):
        out[r, :len(values)] = torch.tensor(values, dtype=dtype)
    return out.to(device)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and mask (long) with each sequence right-aligned: the prompt half of the layout
    above, `right_padded`'s rows reversed and flipped back."""
    width = max(len(s) for s in sequences)
    ids = right_padded([list(s)[::-1] for s in sequences], width, pad_id, torch.long, device)
    mask = right_padded([[1] * len(s) for s in sequences], width, 0, torch.long, device)
    return ids.flip(1), mask.flip(1)


def sampling_uniforms(seed: int, n_rows: int, max_new_tokens: int) -> torch.Tensor:
    """[n_rows, max_new_tokens] uniforms in [0, 1) for a global batch, from one CPU generator
    seeded with `seed`: rank r (or a chunk) takes its rows' slice, so the samples do not depend on
    the world size or the chunking, and a resumed run draws what the uninterrupted one did."""
    return torch.rand((n_rows, max_new_tokens), generator=torch.Generator().manual_seed(seed))


def sampling_noise(uniforms: torch.Tensor | None, generator: torch.Generator | None, rows: int,
                   max_new_tokens: int, temperature: float) -> torch.Tensor:
    """An engine's noise for `rows` rows: `uniforms` [rows, max_new_tokens] (`sampling_uniforms`'
    rows), or as many drawn from `generator` (on its device; the global stream without one). A
    `temperature` <= 0 is refused: sampling is from softmax(logits / T)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling")
    if uniforms is not None:
        return uniforms
    return torch.rand((rows, max_new_tokens), generator=generator,
                      device=generator.device if generator is not None else "cpu")


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
    per_token = {name: getattr(rollout, name) * response_mask  # 0 after the cut
                 for name in ("engine_logprobs", "versions") if getattr(rollout, name) is not None}
    return replace(rollout, input_ids=input_ids, attention_mask=attention_mask,
                   response_mask=response_mask, action_mask=rollout.action_mask & response_mask,
                   ended=ended, **per_token)


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """The text of each response (special tokens such as EOS dropped), for reward functions."""
    return [tokenizer.decode(row[mask].tolist(), skip_special_tokens=True)
            for row, mask in zip(rollout.responses, rollout.response_mask, strict=True)]
