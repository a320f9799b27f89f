"""The one encoding rule: rows of text (or chat) into token ids with response masks.

Row formats (`tether.data.shapes`; docs/data.md has the table)
- SFT: `{prompt, response}`, `{prompt, completion}` (plain, or a chat prompt with the assistant's
  reply), `{messages}` (a chat rendered with the tokenizer's chat template; loss on every
  assistant turn, or on the last with `loss_on="last"`), `{text}` (loss on every token).
- Preference: `{prompt, chosen, rejected}` (+ optional numeric `margin` for reward modelling), or
  `{chosen, rejected}` with an implicit prompt, as plain text or as chat messages.
- Prompts for generation (PPO): `{prompt}` or `{messages}` (`tether.data.prompts`).

Every stage turns text into ids by one rule (below), so PPO prompts are encoded exactly as SFT,
RM and DPO saw them.

Loss masks cover response tokens only: the reply, or in a multi-turn chat every trained assistant
turn (a tool-call turn's calls included), never the user (tool result, system) turns between
them. A prompt (everything before the first trained reply) that leaves no room for a response
within `max_length` is never cut: it is an error, or (when asked) skipped and counted. Responses
that run past `max_length` are truncated at the end and counted (`data/truncated`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tether.data.chat import check_reply, common_start, turn_spans
from tether.data.rows import require_columns
from tether.data.shapes import (
    SFTRow,
    is_chat_sft_row,
    preference_shape,
    preference_texts,
    read_sft_row,
    same_shape,
    sft_shape,
)
from tether.data.tool_calls import calls_of
from tether.errors import TetherError

# ----------------------------------------------------------------------------- the encoding rule
# One rule for every stage (SFT, RM, DPO, PPO prompts):
# 1. A text gets the tokenizer's special prefix (e.g. Llama's BOS) unless it already starts with
#    it: a chat template that writes BOS (Llama 3) is not given a second one, a template that
#    relies on the tokenizer (Zephyr, Mistral) gets it, and so does a plain prompt.
# 2. A response is tokenised together with its prompt and its ids are what follows the prompt's:
#    SentencePiece-style tokenizers (Llama 2, Mistral) give a text other ids when it is tokenised
#    alone (a leading `▁`), so encoding apart would train on ids the model never sees in context.
#    A multi-turn chat is tokenised once, and each assistant turn is located in those ids
#    (`turn_mask`), so every turn's ids, not only the last's, are those of the context.
# 3. A plain response gets EOS appended unless it already ends with it; a chat response carries
#    the template's own end-of-turn tokens (every trained turn its own).

def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before every text (Llama's `[BOS]`; `[]` for GPT-2, Qwen)."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def encode_prompt(tokenizer, text: str, prefix: list[int]) -> list[int]:
    """Ids of a prompt (or prompt + response) under rule 1. `prefix`: `special_prefix(tokenizer)`,
    read once by the caller, which encodes many texts."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if ids[:len(prefix)] == prefix else prefix + ids


def encode_pair(tokenizer, prompt_text: str, response_texts: list[str], chat: bool,
                prefix: list[int]) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, response ids) under rules 1-3, one prompt shared by every response.

    The prompt ids are the longest common start of the prompt alone and of each prompt + response
    (the prompt alone, unless a token merges across the boundary; then the merged token belongs to
    the response).
    """
    prompt = encode_prompt(tokenizer, prompt_text, prefix)
    fulls = [encode_prompt(tokenizer, prompt_text + text, prefix) for text in response_texts]
    shared = len(prompt)
    for full in fulls:
        shared = common_start(prompt[:shared], full)
    if shared == 0:  # nothing in common (e.g. a one-token prompt merged away): encode apart
        fulls = [prompt + tokenizer(t, add_special_tokens=False)["input_ids"] for t in response_texts]
        shared = len(prompt)
    eos = tokenizer.eos_token_id
    responses = [full[shared:] for full in fulls]
    if not chat and eos is not None:  # the model must learn to stop: EOS carries loss
        responses = [ids if ids[-1:] == [eos] else ids + [eos] for ids in responses]
    return prompt[:shared], responses


def turn_mask(tokenizer, text: str, spans: list[tuple[int, int]], ids: list[int], n_prompt: int,
              prefix: list[int]) -> list[int]:
    """Loss mask over `ids[n_prompt:]` (the response ids of `text`): 1 on the tokens of each
    character span `(start, end)` of `spans`, 0 between them; the first span starts at `n_prompt`.

    Rule 2 at every boundary: a boundary at character c falls after the ids that `text[:c]`
    encodes to in common with the whole text's. So a token that straddles the start of a turn
    belongs to the turn (as a token merging across the prompt's end belongs to the response),
    and one that straddles its end does not (templates that close a turn with a special token,
    EOS or `<|im_end|>`, never make one).
    """
    def boundary(char: int) -> int:
        if char >= len(text):
            return len(ids)
        return common_start(encode_prompt(tokenizer, text[:char], prefix), ids)

    mask = [0] * len(ids)
    for k, (start, end) in enumerate(spans):
        for t in range(n_prompt if k == 0 else boundary(start), boundary(end)):
            mask[t] = 1
    return mask[n_prompt:]


# ----------------------------------------------------------------------------- tokenising

@dataclass
class Encoded:
    """One tokenised example: prompt ids and one or two response ids (EOS appended)."""

    prompt: list[int]
    responses: list[list[int]]
    margin: float = 0.0
    loss_mask: list[int] | None = None
    """Over `responses[0]` of a multi-turn chat: 1 on the assistant turns' tokens, 0 on the turns
    between them; None: every response token carries loss."""


@dataclass
class EncodeStats:
    skipped_long_prompt: int = 0
    truncated: int = 0

    def as_metrics(self) -> dict[str, float]:
        """The counts under their metric names, as every stage logs them."""
        return {"data/skipped_long_prompt": float(self.skipped_long_prompt),
                "data/truncated": float(self.truncated)}


def _fit(prompt: list[int], responses: list[list[int]], max_length: int, index: int,
         on_long_prompt: str, source: str, stats: EncodeStats,
         loss_mask: list[int] | None = None) -> Encoded | None:
    if len(prompt) >= max_length:
        if on_long_prompt == "skip":
            stats.skipped_long_prompt += 1
            return None
        raise TetherError(f"{source}: row {index} prompt has {len(prompt)} tokens, leaving no room for "
                          f"a response within max_length={max_length}; raise --max-length, shorten "
                          "the prompt, or pass --on-long-prompt skip")
    room = max_length - len(prompt)
    if any(len(r) > room for r in responses):
        stats.truncated += 1
    return Encoded(prompt, [r[:room] for r in responses],
                   loss_mask=None if loss_mask is None else loss_mask[:room])


def _encode_sft_row(tokenizer, row: SFTRow, loss_on: str, where: str, prefix: list[int]
                    ) -> tuple[list[int], list[int], list[int] | None]:
    """(prompt ids, response ids, loss mask or None) of one SFT row under rules 1-3.

    A chat is rendered once (with the row's `tools`); the prompt is everything before the first
    trained assistant turn, the response everything after it, and the mask marks each trained
    turn's tokens (its content, its tool calls' text and its end-of-turn token; what the template
    writes after that token only between turns, tool results included).
    """
    if row.messages is None:  # plain text; a {text} row has an empty prompt
        prompt, responses = encode_pair(tokenizer, row.prompt, [row.response], False, prefix)
        return prompt, responses[0], None
    messages = row.messages
    if messages[-1].get("role") != "assistant":
        raise TetherError(f"{where}: the chat must end with an assistant message (the reply to "
                          f"learn; got {messages[-1].get('role')!r} last)")
    trained = [i for i in range(row.reply_from, len(messages))
               if messages[i].get("role") == "assistant"]
    if loss_on == "last":
        trained = trained[-1:]
    for i in trained:
        if calls_of(messages[i]):  # a tool-call turn says something: its calls carry loss
            continue
        check_reply(messages[i]["content"], f"assistant message {i} (a turn to learn)", where,
                    "fill in the reply or drop the row" if i == trained[-1] else
                    "fill in the reply, drop the row, or pass --loss-on last")
    text, spans = turn_spans(tokenizer, messages, trained, where, row.tools)
    first = spans[0][0]
    prompt, responses = encode_pair(tokenizer, text[:first], [text[first:]], True, prefix)
    if len(spans) == 1:  # one reply, to the end: every response token carries loss
        return prompt, responses[0], None
    return prompt, responses[0], turn_mask(tokenizer, text, spans, prompt + responses[0],
                                           len(prompt), prefix)


def encode_sft(tokenizer, rows: list[dict], max_length: int, on_long_prompt: str = "error",
               source: str = "data", loss_on: str = "all") -> tuple[list[Encoded], EncodeStats]:
    """Tokenise SFT rows (`{prompt, response}`, `{prompt, completion}`, `{messages}`, `{text}`;
    every row the same shape) under the encoding rule. A chat's loss goes on each of its
    assistant turns (`loss_on="all"`, TRL's `assistant_only_loss`) or on the last (`"last"`)."""
    if loss_on not in ("all", "last"):
        raise TetherError(f"loss_on must be 'all' or 'last' (got {loss_on!r})")
    shape = same_shape(rows, sft_shape, source)
    if loss_on != "all" and not any(is_chat_sft_row(row, shape) for row in rows):
        raise TetherError(f"--loss-on {loss_on} chooses which assistant turns of a chat carry "
                          f"loss, and {source} has plain-text rows, which have no turns (the loss "
                          "is on each response); drop it, or give chat rows ({messages})")
    stats, out, prefix = EncodeStats(), [], special_prefix(tokenizer)
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        prompt, response, mask = _encode_sft_row(tokenizer, read_sft_row(row, shape, where),
                                                 loss_on, where, prefix)
        ex = _fit(prompt, [response], max_length, i, on_long_prompt, source, stats, mask)
        if ex is not None:
            out.append(ex)
    if not out:
        raise TetherError(f"{source}: every row was skipped (prompts over max_length={max_length})")
    return out, stats


def margin_of(row: dict, column: str, where: str) -> float:
    """The Bradley-Terry margin of a preference row: a number, finite in float32 (the loss's
    precision). A NaN or inf margin would train to a NaN loss, whose message points at the
    learning rate, far from the row that caused it."""
    value = row[column]
    try:
        margin = float(value)
    except (TypeError, ValueError):
        raise TetherError(f"{where} column {column!r} must be a number, got {value!r}") from None
    # torch.finfo(torch.float32).max: past it, a margin is inf
    if not math.isfinite(margin) or abs(margin) > 3.4028234663852886e38:
        raise TetherError(f"{where} column {column!r} is {value!r}, not a finite float32 "
                          "number; give every row a finite margin (0 for none), or drop "
                          "--margin-column")
    return margin


def encode_preferences(tokenizer, rows: list[dict], max_length: int, on_long_prompt: str = "error",
                       source: str = "data", margin_column: str = "") -> tuple[list[Encoded], EncodeStats]:
    """Tokenise preference rows under the encoding rule: `{prompt, chosen, rejected}` or
    `{chosen, rejected}` (implicit prompt), as plain text or as chat (`tether.data.chat`);
    identical chosen and rejected is an error."""
    same_shape(rows, preference_shape, source)
    if margin_column:
        require_columns(rows, [margin_column], source)
    stats, out, prefix = EncodeStats(), [], special_prefix(tokenizer)
    for i, row in enumerate(rows):
        prompt_text, texts, is_chat = preference_texts(tokenizer, row, f"{source}: row {i}")
        if texts[0] == texts[1]:
            raise TetherError(f"{source}: row {i} has identical chosen and rejected responses, "
                              "which carry no preference; remove or fix the row")
        prompt, responses = encode_pair(tokenizer, prompt_text, texts, is_chat, prefix)
        ex = _fit(prompt, responses, max_length, i, on_long_prompt, source, stats)
        if ex is None:
            continue
        if margin_column:
            ex.margin = margin_of(row, margin_column, f"{source}: row {i}")
        out.append(ex)
    if not out:
        raise TetherError(f"{source}: every row was skipped (prompts over max_length={max_length})")
    return out, stats
