"""Turning rows into token ids with response masks, PPO's prompts and their order, batching.

Rows are read by `tether.rows` (`load_rows` is importable from here too).

Row formats
- SFT: `{prompt, response}` or `{messages}` (a chat; the last message is the assistant's reply,
  rendered with the tokenizer's chat template).
- Preference: `{prompt, chosen, rejected}` (+ optional numeric `margin` for reward modelling), as
  plain text or as chat messages (`tether.chat`).
- Prompts for generation (PPO): `{prompt}` or `{messages}`.

Every stage turns text into ids by one rule (see "the encoding rule" below), so PPO prompts are
encoded exactly as SFT, RM and DPO saw them.

Loss masks cover response tokens only. A prompt that leaves no room for a response within
`max_length` is never cut: it is an error, or (when asked) skipped and counted. Responses that
run past `max_length` are truncated and counted (`data/truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tether.chat import (
    check_prompt,
    is_messages,
    preference_texts,
    render_chat,
    split_chat,
    truncate_chat,
)
from tether.errors import TetherError
from tether.rows import FORMATS, load_rows, require_columns  # noqa: F401 - part of this module's API

# ----------------------------------------------------------------------------- text rendering

def format_prompt(tokenizer, row: dict) -> str:
    """The text a policy continues: `prompt`, or `messages` (or a messages-valued `prompt`)
    rendered with the generation prompt."""
    messages = row.get("messages")
    check_prompt(row.get("prompt"), "a prompt row")
    if messages is None and is_messages(row.get("prompt")):
        messages = row["prompt"]
    if messages is not None:
        return render_chat(tokenizer, list(messages), add_generation_prompt=True)
    return str(row["prompt"])


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


def _special_head(tokenizer, ids: list[int]) -> list[int]:
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    n = 0
    while n < len(ids) and ids[n] in special:
        n += 1
    return ids[:n]


def encode_prompt_row(tokenizer, row: dict, max_tokens: int, prefix: list[int] | None = None
                      ) -> tuple[str, list[int]]:
    """(text, ids) of a generation prompt row (`{prompt}` or `{messages}`) under rule 1, in at
    most `max_tokens` ids.

    A long prompt loses the start of its content, never its special prefix: a chat is re-rendered
    with the oldest non-system content cut (BOS, role markers, system message and generation
    prompt stay); a plain prompt keeps its leading special tokens (BOS) and its last tokens.
    The text is the full prompt (what a reward function reads).
    """
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    text = format_prompt(tokenizer, row)
    ids = encode_prompt(tokenizer, text, prefix)
    if len(ids) <= max_tokens:
        return text, ids
    messages = row.get("messages")
    if messages is None and is_messages(row.get("prompt")):
        messages = row["prompt"]
    if messages is not None:
        return text, truncate_chat(tokenizer, list(messages), max_tokens,
                                   lambda t: encode_prompt(tokenizer, t, prefix))[1]
    head = _special_head(tokenizer, ids)
    if len(head) >= max_tokens:
        raise TetherError(f"max_prompt_len={max_tokens} leaves no room for prompt content after "
                          f"{len(head)} special tokens; raise --max-prompt-len")
    return text, head + ids[len(ids) - (max_tokens - len(head)):]


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
    text, or as chat (see `tether.chat`); identical chosen and rejected is an error."""
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


# ----------------------------------------------------------------------------- PPO's prompts

def load_prompts(source: str, tokenizer, max_len: int) -> tuple[list[str], list[list[int]]]:
    """Prompt texts and ids for generation, `{prompt}` or `{messages}` rows, encoded by the rule
    every stage uses, each cut to `max_len` ids without losing its special prefix."""
    rows = load_rows(source)
    texts, ids, prefix = [], [], special_prefix(tokenizer)
    for i, row in enumerate(rows):
        if "prompt" not in row and "messages" not in row:
            raise TetherError(f"{source}: row {i} has neither a 'prompt' nor a 'messages' field; "
                              "give one of them per row")
        text, tokens = encode_prompt_row(tokenizer, row, max_len, prefix)
        if not tokens or not text.strip():
            raise TetherError(f"{source}: row {i} has an empty prompt; remove it")
        texts.append(text)
        ids.append(tokens)
    return texts, ids


def prompt_indices(n_prompts: int, batch_size: int, seed: int, batch: int) -> list[int]:
    """Prompt rows of rollout batch `batch`: a stream of seeded per-epoch shuffles, cut into
    batches. A pure function of (seed, batch), so a resumed run sees the prompts an uninterrupted
    one would, and a batch may be larger than the prompt set."""
    out: list[int] = []
    position = batch * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, n_prompts)
        perm = torch.randperm(n_prompts,
                              generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        take = perm[offset: offset + batch_size - len(out)].tolist()
        out += take
        position += len(take)
    return out


# ----------------------------------------------------------------------------- batching

def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response rows: `input_ids`, `attention_mask`, `response_mask` (all [N, T]).

    `response_mask[i, t]` is 1 where token t of row i belongs to the response (the tokens that
    carry loss); prompt and padding are 0.
    """
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    n = len(prompts)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p): len(p) + len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


def collate_sft(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    return pad_sequences([e.prompt for e in examples], [e.responses[0] for e in examples], pad_id)


def collate_pairs(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one batch `[2B, T]`, so one forward pass scores both."""
    prompts = [e.prompt for e in examples] * 2
    responses = [e.responses[0] for e in examples] + [e.responses[1] for e in examples]
    batch = pad_sequences(prompts, responses, pad_id)
    batch["margin"] = torch.tensor([e.margin for e in examples], dtype=torch.float32)
    return batch


def batch_order(n_rows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Row indices of optimizer step `step` (0-based): a fresh seeded shuffle each epoch.

    The order is a pure function of (seed, step), so a resumed run sees the same batches as an
    uninterrupted one without saving an iterator.
    """
    per_epoch = -(-n_rows // batch_size)
    epoch, index = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n_rows, generator=generator).tolist()
    return perm[index * batch_size: (index + 1) * batch_size]


def split_holdout(items: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seeded (train, held-out) split; held-out gets round(fraction * n) items, at least 1 if > 0."""
    if fraction <= 0:
        return items, []
    n_eval = max(1, round(fraction * len(items)))
    if n_eval >= len(items):
        raise TetherError(f"eval_fraction={fraction} leaves no training rows out of {len(items)}; lower it")
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed + 7)).tolist()
    held = set(perm[:n_eval])
    return ([x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held])
