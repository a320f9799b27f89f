"""Prompts for generation: `{prompt}` or `{messages}` rows encoded by the one encoding rule
(`tether.data.encoding`) and the seeded order they are drawn in.

A prompt row has `prompt` (a string, or a list of messages) or `messages`; other columns (TRL's
`completion`, `chosen`, `rejected`, a reference answer) are ignored, so a prompt-completion or
preference file serves as a prompt file. A chat prompt may end in any turn: the template's
generation prompt opens the assistant's next turn, after a user or tool turn or after an
assistant turn alike (then the policy writes a new turn, it does not continue the old one).

A long prompt loses the start of its content, never its special prefix (BOS, role markers, the
system message and the generation prompt stay), so PPO, `tether eval` and `tether generate`
prompt a policy exactly as SFT, RM and DPO encoded their rows.
"""

from __future__ import annotations

from itertools import takewhile

import torch

from tether.data.chat import (
    chat_messages,
    check_prompt,
    render_chat,
    truncate_chat,
)
from tether.data.encoding import encode_prompt, special_prefix
from tether.data.rows import load_rows
from tether.data.shapes import plain_text
from tether.data.tool_calls import prepare_tool_chat, row_tools
from tether.errors import TetherError


def prompt_messages(row: dict, where: str = "a prompt row") -> list[dict] | None:
    """The chat of a prompt row (`messages`, or a messages-valued `prompt`), each content one
    string; None for a plain-text prompt."""
    prompt = check_prompt(row.get("prompt"), where)
    messages = (chat_messages(row["messages"], "messages", where)
                if row.get("messages") is not None else prompt)
    if messages is None:
        return None
    # the template's role markers alone (null content: an assistant turn that only calls tools)
    if not any((m["content"] or "").strip() for m in messages):
        raise TetherError(f"{where} has an empty prompt (every message's content is empty); "
                          "fill it in or remove the row")
    return messages


def _prompt(tokenizer, row: dict, where: str, tools: list[dict] | None
            ) -> tuple[str, list[dict] | None, list[dict] | None]:
    """(the text a policy continues, the chat as the template got it or None for a plain-text
    prompt, the tool schemas it was rendered with: `tools` when given (--tools), else the row's
    `tools` column (TRL's form, `tether.data.tool_calls`), which only a chat prompt can show).

    A chat is rendered with the generation prompt. After an assistant turn, a template without one
    (Mistral's `[INST]` format) would leave the policy after that turn's EOS, with no turn open.
    Tool calls and schemas are checked to be written (`prepare_tool_chat`): a template made
    before tools would drop them, and the policy answer a prompt it never saw."""
    messages = prompt_messages(row, where)
    if tools is None:
        tools = row_tools(row, where)
        if tools and messages is None:
            raise TetherError(f"{where} has a 'tools' column but a plain-text prompt, which "
                              "cannot show the model its tools; give the prompt as chat messages, "
                              "or drop 'tools'")
    if messages is None:
        return plain_text(row, "prompt", where), None, tools
    messages = prepare_tool_chat(lambda ms, ts: render_chat(tokenizer, ms, False, where, ts),
                                 messages, tools, where)
    text = render_chat(tokenizer, messages, add_generation_prompt=True, where=where, tools=tools)
    if messages[-1].get("role") == "assistant" and text == render_chat(tokenizer, messages, False,
                                                                       where, tools):
        raise TetherError(f"{where} ends with an assistant message and the chat template writes no "
                          "generation prompt to open a new assistant turn after it; end the prompt "
                          "with a user turn, or use a template with a generation prompt")
    return text, messages, tools


def format_prompt(tokenizer, row: dict, where: str = "a prompt row",
                  tools: list[dict] | None = None) -> str:
    """The text a policy continues: `prompt`, or `messages` (or a messages-valued `prompt`)
    rendered with the generation prompt (and the schemas of `tools`, when given)."""
    return _prompt(tokenizer, row, where, tools)[0]


def encode_prompt_row(tokenizer, row: dict, max_tokens: int, prefix: list[int],
                      where: str = "a prompt row", tools: list[dict] | None = None
                      ) -> tuple[str, list[int]]:
    """(text, ids) of a generation prompt row (`{prompt}` or `{messages}`) under rule 1, in at
    most `max_tokens` ids; `prefix`: `special_prefix(tokenizer)`, read once by the caller.

    A long prompt loses the start of its content, never its special prefix: a chat is re-rendered
    with the oldest non-system content cut (BOS, role markers, system message and generation
    prompt stay); a plain prompt keeps its leading special tokens (BOS) and its last tokens.
    The text is the full prompt (what a reward function reads).
    """
    text, messages, tools = _prompt(tokenizer, row, where, tools)
    ids = encode_prompt(tokenizer, text, prefix)
    if len(ids) <= max_tokens:
        return text, ids
    if messages is not None:
        return text, truncate_chat(tokenizer, messages, max_tokens,
                                   lambda t: encode_prompt(tokenizer, t, prefix), tools)[1]
    # the special tokens (BOS, role markers) `ids` starts with
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    head = list(takewhile(special.__contains__, ids))
    if len(head) >= max_tokens:
        raise TetherError(f"max_prompt_len={max_tokens} leaves no room for prompt content after "
                          f"{len(head)} special tokens; raise --max-prompt-len")
    return text, head + ids[len(ids) - (max_tokens - len(head)):]


def prompt_kind(row: dict) -> str:
    """"chat" for a `{messages}` row or a messages-valued `prompt`, else "plain text"."""
    chat = row.get("messages") is not None or isinstance(row.get("prompt"), (list, dict))
    return "chat" if chat else "plain text"


def load_prompts(source: str, tokenizer, max_len: int) -> tuple[list[str], list[list[int]]]:
    """Prompt texts and ids for generation, `{prompt}` or `{messages}` rows (other columns
    ignored), all plain or all chat, encoded by the rule every stage uses, each cut to `max_len`
    ids without losing its special prefix."""
    rows = load_rows(source)
    for i, row in enumerate(rows):
        if row.get("prompt") is None and row.get("messages") is None:
            raise TetherError(f"{source}: row {i} has neither a 'prompt' nor a 'messages' field; "
                              "give one of them per row")
        check_prompt(row.get("prompt"), f"{source}: row {i}")
    # every prompt plain text, or every one a chat: a file mixing them (two sets merged?) would
    # prompt some rows through the chat template and some not, a policy seeing two formats where
    # SFT taught it one
    first = prompt_kind(rows[0])
    for i, row in enumerate(rows[1:], 1):
        if prompt_kind(row) != first:
            raise TetherError(f"{source}: row {i} is a {prompt_kind(row)} prompt but row 0 is "
                              f"{first}; give every prompt the same way (all text, or all chat "
                              "messages)")
    texts, ids, prefix = [], [], special_prefix(tokenizer)
    for i, row in enumerate(rows):
        text, tokens = encode_prompt_row(tokenizer, row, max_len, prefix, f"{source}: row {i}")
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
