"""The one encoding rule: rows of text (or chat) into token ids with response masks.

Row formats
- SFT: `{prompt, response}` or `{messages}` (a chat; the last message is the assistant's reply,
  rendered with the tokenizer's chat template).
- Preference: `{prompt, chosen, rejected}` (+ optional numeric `margin` for reward modelling), as
  plain text or as chat messages (`tether.data.chat`).
- Prompts for generation (PPO): `{prompt}` or `{messages}` (`tether.data.prompts`).

Every stage turns text into ids by one rule (below), so PPO prompts are encoded exactly as SFT,
RM and DPO saw them.

Loss masks cover response tokens only. A prompt that leaves no room for a response within
`max_length` is never cut: it is an error, or (when asked) skipped and counted. Responses that
run past `max_length` are truncated and counted (`data/truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.data.chat import check_prompt, is_messages, preference_texts, split_chat
from tether.data.rows import require_columns
from tether.errors import TetherError

# ----------------------------------------------------------------------------- the encoding rule
# One rule for every stage (SFT, RM, DPO, PPO prompts):
# 1. A text gets the tokenizer's special prefix (e.g. Llama's BOS) unless it already starts with
#    it: a chat template that writes BOS (Llama 3) is not given a second one, a template that
#    relies on the tokenizer (Zephyr, Mistral) gets it, and so does a plain prompt.
# 2. A response is tokenised together with its prompt and its ids are what follows the prompt's:
#    SentencePiece-style tokenizers (Llama 2, Mistral) give a text other ids when it is tokenised
#    alone (a leading `▁`), so encoding apart would train on ids the model never sees in context.
# 3. A plain response gets EOS appended unless it already ends with it; a chat response carries
#    the template's own end-of-turn tokens.

def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before every text (Llama's `[BOS]`; `[]` for GPT-2, Qwen)."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def encode_prompt(tokenizer, text: str, prefix: list[int] | None = None) -> list[int]:
    """Ids of a prompt (or prompt + response) under rule 1. `prefix`: `special_prefix(tokenizer)`,
    passed when encoding many texts."""
    prefix = special_prefix(tokenizer) if prefix is None else prefix
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
        n = 0
        while n < min(shared, len(full)) and full[n] == prompt[n]:
            n += 1
        shared = n
    if shared == 0:  # nothing in common (e.g. a one-token prompt merged away): encode apart
        fulls = [prompt + tokenizer(t, add_special_tokens=False)["input_ids"] for t in response_texts]
        shared = len(prompt)
    eos = tokenizer.eos_token_id
    responses = []
    for full in fulls:
        ids = full[shared:]
        if not chat and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]  # the model must learn to stop: EOS carries loss
        responses.append(ids)
    return prompt[:shared], responses


# ----------------------------------------------------------------------------- tokenising

@dataclass
class Encoded:
    """One tokenised example: prompt ids and one or two response ids (EOS appended)."""

    prompt: list[int]
    responses: list[list[int]]
    margin: float = 0.0


@dataclass
class EncodeStats:
    skipped_long_prompt: int = 0
    truncated: int = 0

    def as_metrics(self) -> dict[str, float]:
        """The counts under their metric names, as every stage logs them."""
        return {"data/skipped_long_prompt": float(self.skipped_long_prompt),
                "data/truncated": float(self.truncated)}


def _fit(prompt: list[int], responses: list[list[int]], max_length: int, index: int,
         on_long_prompt: str, source: str, stats: EncodeStats) -> Encoded | None:
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
    return Encoded(prompt, [r[:room] for r in responses])


def _sft_texts(tokenizer, row: dict, where: str) -> tuple[str, str, bool]:
    """(prompt text, response text, chat) of one SFT row."""
    if row.get("messages") is not None:
        return (*split_chat(tokenizer, list(row["messages"]), where), True)
    check_prompt(row["prompt"], where)
    if is_messages(row["prompt"]):  # a chat prompt with the reply beside it
        reply = row["response"]
        reply = reply if isinstance(reply, dict) else {"role": "assistant", "content": str(reply)}
        return (*split_chat(tokenizer, list(row["prompt"]) + [reply], where), True)
    return str(row["prompt"]), str(row["response"]), False


def encode_sft(tokenizer, rows: list[dict], max_length: int, on_long_prompt: str = "error",
               source: str = "data") -> tuple[list[Encoded], EncodeStats]:
    """Tokenise SFT rows (`{prompt, response}` or `{messages}`) under the encoding rule."""
    chat = "messages" in rows[0]
    require_columns(rows, ["messages"] if chat else ["prompt", "response"], source)
    stats, out, prefix = EncodeStats(), [], special_prefix(tokenizer)
    for i, row in enumerate(rows):
        prompt_text, response_text, is_chat = _sft_texts(tokenizer, row, f"{source}: row {i}")
        prompt, responses = encode_pair(tokenizer, prompt_text, [response_text], is_chat, prefix)
        ex = _fit(prompt, responses, max_length, i, on_long_prompt, source, stats)
        if ex is not None:
            out.append(ex)
    if not out:
        raise TetherError(f"{source}: every row was skipped (prompts over max_length={max_length})")
    return out, stats


def encode_preferences(tokenizer, rows: list[dict], max_length: int, on_long_prompt: str = "error",
                       source: str = "data", margin_column: str = "") -> tuple[list[Encoded], EncodeStats]:
    """Tokenise preference rows under the encoding rule: `{prompt, chosen, rejected}` as plain
    text, or as chat (see `tether.data.chat`); identical chosen and rejected is an error."""
    chat = not isinstance(rows[0].get("prompt", ""), str) or is_messages(rows[0].get("chosen"))
    required = ["chosen", "rejected"] if chat else ["prompt", "chosen", "rejected"]
    require_columns(rows, required + ([margin_column] if margin_column else []), source)
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
            try:
                ex.margin = float(row[margin_column])
            except (TypeError, ValueError):
                raise TetherError(f"{source}: row {i} column {margin_column!r} must be a number, "
                                  f"got {row[margin_column]!r}") from None
        out.append(ex)
    if not out:
        raise TetherError(f"{source}: every row was skipped (prompts over max_length={max_length})")
    return out, stats
