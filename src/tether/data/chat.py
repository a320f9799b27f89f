"""Chat rows: rendering messages with the tokenizer's chat template, and reading chat preference
rows into (prompt text, response texts).

Chat preference rows come in the shapes most public preference sets use:
- `prompt` as messages, `chosen` / `rejected` as one assistant message (a dict, a one-message
  list, or a plain string, taken as the assistant's content);
- `prompt` as messages, `chosen` / `rejected` as full conversations that start with the prompt;
- no `prompt`: `chosen` / `rejected` as full conversations; the prompt is their common prefix.

Each side is rendered exactly as SFT renders `{messages}`: the prompt with the generation prompt,
the response as what the full chat adds after it (so the template's end-of-turn tokens, e.g.
EOS or `<|im_end|>`, are part of the response and carry loss).

A message's content is a string or a list of text parts (`{"type": "text", "text": ...}`, the
OpenAI and Hugging Face form); the parts are joined into one string before rendering, so a
template never writes the list's Python repr.

Tool-calling transcripts (TRL's form, `tether.data.tool_calls`): an assistant message may carry
`tool_calls`, with content null when it only calls; `tool` messages keep their `name` and
`tool_call_id`; a row's `tools` schemas go to every render of the row. A call turn is an assistant
turn like any other (its calls' text carries loss), a tool result is context like a user turn.

A value that is not a chat (a string, one dict where a list belongs, [], a message without a
string role or without content, content null outside a pure call, malformed calls) is one line
naming the message (`message_problem`, `check_tool_calls`), never an error from inside the
template; a role the template renders is the user's choice, one it refuses is its own line
(`render_chat`). A reply to learn must not be empty (`check_reply`).
"""

from __future__ import annotations

from typing import Any

import jinja2

from tether.data.tool_calls import calls_of, check_tool_calls, prepare_tool_chat, row_tools
from tether.errors import TetherError

MESSAGE_FORM = 'write each message as {"role": "user", "content": "..."}'
MESSAGE_LIST = '[{"role": "user", "content": "..."}]'


def message_problem(value: Any) -> str | None:
    """What keeps `value` from being a chat (a non-empty list of {role, content} dicts whose
    roles are names), in words for an error line; None for a chat."""
    if not isinstance(value, list):
        return f"got a {type(value).__name__}"
    if not value:
        return "got an empty list"
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {j} is a {type(message).__name__}, not a {{role, content}} object"
        if "role" not in message:
            return f"message {j} has no 'role' (keys: {', '.join(map(str, message)) or 'none'})"
        if not isinstance(message["role"], str) or not message["role"]:
            return f"message {j} has role {message['role']!r}, not a name such as 'user'"
        if "content" not in message:
            return f"message {j} has no 'content'"
    return None


def is_messages(value: Any) -> bool:
    """True for a non-empty list of {role, content} dicts with named roles (a chat)."""
    return message_problem(value) is None


def chat_messages(value: Any, what: str, where: str, expected: str = "") -> list[dict]:
    """`value` (a row's `messages` or `prompt`) checked to be a chat, each content one string;
    the first problem (a string, one dict, [], a message without a role or content) is one line
    naming it, never an error from inside the template. `expected`: what the column may be, in
    that line ("a list", "a string or a list" for a prompt, unless given)."""
    problem = message_problem(value)
    if problem is not None:
        expected = expected or ("a string or a list" if what == "prompt" else "a list")
        raise TetherError(f"{where} {what!r} must be {expected} of {{role, content}} messages "
                          f"({problem}); {MESSAGE_FORM}")
    return [_normal_message(m, f"{where} {what!r} message {j}") for j, m in enumerate(value)]


def content_text(content: Any, where: str) -> str:
    """A message's content as one string: a string as it is, a list of text parts joined with
    nothing between them (what templates that accept parts write, one part after another).
    Anything else (an image part, a number, a list of strings) is an error, never its repr."""
    if isinstance(content, str):
        return content
    if content is None:  # JSON null: a turn without text would train or prompt an empty turn
        raise TetherError(f"{where} content must be a string or a list of text parts (got "
                          "null); give the message its text, or drop the message")
    if not isinstance(content, list):
        raise TetherError(f"{where} content must be a string or a list of text parts (got "
                          f"{type(content).__name__}); write it as a string")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise TetherError(f"{where} content part {k} is a {type(part).__name__}, not a "
                              "{'type': 'text', 'text': ...} part; give the content as a string "
                              "or a list of text parts")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TetherError(f"{where} content part {k} has type {part.get('type')!r}, not a "
                              "text part with a string 'text'; tether trains on text only: drop "
                              "the part or give the content as a string")
        texts.append(part["text"])
    return "".join(texts)


def _normal_message(message: dict, where: str) -> dict:
    """A copy of `message` (already checked `is_messages`) with its content as one string (null
    kept on an assistant message that only makes tool calls) and its calls checked; other keys
    (`tool_calls`, a tool result's `name` and `tool_call_id`) are kept as they are, null-valued
    ones dropped."""
    # A Parquet/Arrow file gives every message every key any message has (`tool_calls`, `name`,
    # `tool_call_id`), null where it has none; templates that test `'tool_calls' in message`
    # would take those nulls for calls, so they go, as if the JSON had left them out.
    message = {k: v for k, v in message.items() if v is not None or k == "content"}
    check_tool_calls(message, where)
    if message["content"] is None:
        if calls_of(message):  # a pure call: null content beside tool_calls, as TRL passes it
            return dict(message)
        if message["role"] == "assistant":
            raise TetherError(f"{where} content must be a string or a list of text parts (got "
                              "null); give the message its text or its tool_calls, or drop it")
    return dict(message, content=content_text(message["content"], where))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                where: str = "data", tools: list[dict] | None = None) -> str:
    """`messages` rendered by the tokenizer's chat template, with the JSON schemas of `tools`
    when given (the template writes them where the model expects them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TetherError(f"{where} uses chat messages but the tokenizer has no chat template; "
                          "give plain-text rows or use a tokenizer with a chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:  # e.g. a template that demands alternating roles
        raise TetherError(f"{where}: the chat template refuses these messages ({exc}); fix the "
                          "roles it names or give plain-text rows") from None


def turn_spans(tokenizer, messages: list[dict], trained: list[int], where: str,
               tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character span `(start, end)` of each trained assistant turn
    in it (`trained`: ascending message indices, the last one the final message), every render
    with the row's `tools` (a tool-call turn is a turn like any other: `prepare_tool_chat`).

    Turn i starts where `messages[:i]` rendered with the generation prompt ends, and ends where
    `messages[:i+1]` rendered without it ends, less the whitespace the template writes after the
    turn's end-of-turn token (`_end_at_turn_token`); the text stops there after the last turn.
    Both renderings must be prefixes of the whole chat's: true of templates that render each turn
    on its own, not of one that rewrites earlier turns (e.g. drops their reasoning).
    """
    messages = prepare_tool_chat(lambda ms, ts: render_chat(tokenizer, ms, False, where, ts),
                                 messages, tools, where)
    full = render_chat(tokenizer, messages, add_generation_prompt=False, where=where, tools=tools)
    spans: list[tuple[int, int]] = []
    for i in trained:
        start = render_chat(tokenizer, messages[:i], True, where, tools)
        end = full if i == len(messages) - 1 else render_chat(tokenizer, messages[:i + 1], False,
                                                              where, tools)
        in_order = len(end) >= len(start) and (not spans or len(start) >= spans[-1][1])
        if not (full.startswith(start) and full.startswith(end) and in_order):
            if len(trained) == 1:
                raise TetherError(f"{where}: the chat template renders the prompt differently "
                                  "inside the full chat; use plain-text rows for this tokenizer")
            raise TetherError(f"{where}: the chat template renders message {i} differently inside "
                              "the full chat, so the assistant turns cannot be located in it; "
                              "pass --loss-on last or give plain-text rows")
        spans.append((len(start), len(start) + len(_end_at_turn_token(tokenizer, end[len(start):]))))
    return full[:spans[-1][1]], spans


def _end_at_turn_token(tokenizer, response: str) -> str:
    """Drop the whitespace a template writes after the reply's end-of-turn token ("</s>\n",
    "<|im_end|>\n"): generation stops at that token, so the policy never emits what follows,
    and a reward model must read its score at the token, as it does on PPO's samples."""
    stripped = response.rstrip()
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    if stripped != response and any(stripped.endswith(s) for s in specials if s):
        return stripped
    return response


def as_turns(value: Any, what: str, where: str) -> list[dict]:
    """A reply column (`chosen`, `rejected`, `completion`, `response`) as a list of messages: a
    string is the assistant's content, a message is one turn."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    turns = [value] if isinstance(value, dict) else value  # one message is one turn
    return chat_messages(turns, what, where, "a string, an assistant message or a list")


def check_prompt(value: Any, where: str) -> list[dict] | None:
    """A `prompt` is text or a chat; anything else (a list of strings, a dict, []) is an error
    naming what is wrong, never its Python repr. Returns the chat (`chat_messages`), or None for
    text or no prompt."""
    if isinstance(value, (list, dict)):
        return chat_messages(value, "prompt", where)
    if value is not None and not isinstance(value, str):  # a number, a bool: never its repr
        raise TetherError(f"{where} 'prompt' must be a string or chat messages (got "
                          f"{type(value).__name__}); write it as text, or as {MESSAGE_LIST}")
    return None


def check_reply(text: str, what: str, where: str,
                fix: str = "fill in the reply or drop the row") -> None:
    """A reply to learn (an SFT response or assistant turn, a preference's chosen or rejected)
    must say something: an empty one would teach the model to answer with nothing (in DPO: to
    prefer, or avoid, the empty answer), which is a broken row far more often than a plan."""
    if not text.strip():
        raise TetherError(f"{where} {what} is empty (nothing to learn from); {fix}")


def common_start(a, b) -> int:
    """How many leading items two sequences (messages, token ids, characters) share."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _reply(turns: list[dict], prompt: list[dict], what: str, where: str) -> dict:
    """The one assistant message that `turns` adds after `prompt`."""
    if len(turns) > len(prompt) and turns[:len(prompt)] == prompt:
        turns = turns[len(prompt):]  # a full conversation that starts with the prompt
    if len(turns) != 1 or turns[0].get("role") != "assistant":
        roles = [m.get("role") for m in turns]
        raise TetherError(f"{where} '{what}' must be one assistant message after the prompt "
                          f"(got roles {roles}); give the reply alone or the prompt plus the reply")
    return turns[0]


def chat_preference_texts(tokenizer, row: dict, where: str) -> tuple[str, list[str]]:
    """(prompt text, [chosen text, rejected text]) of a chat preference row, rendered as SFT
    renders `{messages}` (with the row's `tools`)."""
    prompt = row.get("prompt")
    tools = row_tools(row, where)
    chosen = as_turns(row["chosen"], "chosen", where)
    rejected = as_turns(row["rejected"], "rejected", where)
    prompt_messages = check_prompt(prompt, where)
    if prompt is None:
        prompt_messages = chosen[:common_start(chosen, rejected)]
        if prompt_messages and prompt_messages[-1].get("role") == "assistant":
            prompt_messages = prompt_messages[:-1]
    elif prompt_messages is None:
        raise TetherError(f"{where} mixes a plain-text prompt with chat responses; give the "
                          "prompt as a list of messages too, or all three as plain text")
    if not prompt_messages:
        raise TetherError(f"{where} has no prompt messages; give a 'prompt' list or conversations "
                          "that share their opening turns")
    texts = []
    for what, turns in (("chosen", chosen), ("rejected", rejected)):
        reply = _reply(turns, prompt_messages, what, where)
        if not calls_of(reply):  # a pure call says something: its calls
            check_reply(reply["content"], f"'{what}'", where)
        # the prompt text is what comes before the reply's turn
        text, [(start, _)] = turn_spans(tokenizer, prompt_messages + [reply],
                                        [len(prompt_messages)], where, tools)
        texts.append(text[start:])
    return text[:start], texts


def truncate_chat(tokenizer, messages: list[dict], max_tokens: int, encode,
                  tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """Render `messages` with the generation prompt in at most `max_tokens` ids, cutting the start
    of the oldest non-system content first; template tokens (BOS, role markers, generation
    prompt) and the system message are kept. `encode(text) -> ids` is the prompt-encoding rule.
    """
    messages = [dict(m) for m in messages]
    for _ in range(len(messages) + 8):  # each pass empties a message or lands within a token or two
        text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools)
        ids = encode(text)
        excess = len(ids) - max_tokens
        if excess <= 0:
            return text, ids
        index = next((i for i, m in enumerate(messages)  # null content (a pure call): no text
                      if m.get("role") != "system" and m["content"]), None)
        if index is None:
            break
        content = tokenizer(messages[index]["content"], add_special_tokens=False)["input_ids"]
        messages[index]["content"] = tokenizer.decode(content[min(excess, len(content)):])
    raise TetherError(f"a chat prompt cannot fit max_prompt_len={max_tokens} tokens even with its "
                      "content cut (the template and system message alone are longer); raise "
                      "--max-prompt-len or shorten the system message")
