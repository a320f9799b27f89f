"""Row shapes: the columns each offline stage reads (tether's own and TRL's conventions), checked to
be the same in every row of a file, and read into plain texts or chat messages.

SFT (`tether sft`; also `tether rm --normalize-data`):
- `{prompt, response}` or `{prompt, completion}`: plain strings, or `prompt` as messages and the
  reply as the assistant's (a string, a message, or a list of messages: TRL's conversational
  prompt-completion). Loss on the reply.
- `{messages}`: a conversation that ends with an assistant turn; loss on its assistant turns.
- `{text}`: language modelling (TRL's `text` rows): loss on every token, and on the EOS appended.
Preferences (`tether rm`, `tether dpo`):
- `{prompt, chosen, rejected}`, plain or chat (`tether.data.chat`);
- `{chosen, rejected}` without a prompt: plain texts share an implicit prompt (their common start,
  cut at a word boundary: `implicit_prompt`), conversations their opening turns.
A message's content is a string or a list of text parts. Any chat shape may carry a `tools`
column (function schemas, TRL's tool-calling form: `tether.data.tool_calls`); a plain-text row may
not, since only a chat template writes them. docs/data.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.data.chat import (
    as_turns,
    chat_messages,
    chat_preference_texts,
    check_prompt,
    check_reply,
    common_start,
)
from tether.data.tool_calls import row_tools
from tether.errors import TetherError

SFT_SHAPES = "{prompt, completion}, {prompt, response}, {messages} or {text}"


def _has(row: dict, key: str) -> bool:
    return row.get(key) is not None  # a missing Parquet/Arrow value reads as None


def _columns(row: dict) -> str:
    return ", ".join(sorted(row))


# Pairs of columns that each give an SFT row's text one way: a row with both would be read by
# whichever is looked up first, the other dropped without a word (a merge of two sets, or a
# column renamed without removing the old one). `messages` beside them is read first, as
# documented: hub chat sets keep the first user turn in a `prompt` column beside `messages`.
RIVAL_COLUMNS = (("response", "completion"), ("text", "prompt"), ("text", "response"),
                 ("text", "completion"))


def sft_shape(row: dict, where: str) -> tuple[str, ...]:
    """The columns an SFT row is read by: `messages` first, then `prompt` with `completion` or
    `response`, then `text`; two rival columns (`RIVAL_COLUMNS`) are an error."""
    if _has(row, "messages"):
        return ("messages",)
    for first, second in RIVAL_COLUMNS:
        if _has(row, first) and _has(row, second):
            raise TetherError(f"{where} has both {first!r} and {second!r}, which give its text two "
                              "ways; keep one (docs/data.md lists the row shapes)")
    if _has(row, "prompt"):
        for key in ("completion", "response"):
            if _has(row, key):
                return ("prompt", key)
        raise TetherError(f"{where} has no column 'response' (or 'completion') beside its 'prompt' "
                          f"(columns found: {_columns(row)}); add the reply under one of them")
    if _has(row, "text"):
        return ("text",)
    raise TetherError(f"{where} is not an SFT row (columns found: {_columns(row)}); give "
                      f"{SFT_SHAPES} rows (docs/data.md)")


def is_chat_sft_row(row: dict, shape: tuple[str, ...]) -> bool:
    """True for an SFT row read as a chat: `{messages}`, or a prompt given as messages."""
    return shape == ("messages",) or (shape[0] == "prompt"
                                      and isinstance(row["prompt"], (list, dict)))


def preference_shape(row: dict, where: str) -> tuple[str, ...]:
    """`(prompt, chosen, rejected)`, or `(chosen, rejected)` when the prompt is implicit."""
    for key in ("chosen", "rejected"):
        if not _has(row, key):
            raise TetherError(f"{where} has no column {key!r} (columns found: {_columns(row)}); "
                              f"add the column or rename it to {key!r}")
    return ("prompt", "chosen", "rejected") if _has(row, "prompt") else ("chosen", "rejected")


def same_shape(rows: list[dict], shape_of, source: str) -> tuple[str, ...]:
    """Row 0's shape, checked to be every row's: a file that mixes shapes (some rows with
    `response`, some with `completion`; some with a prompt, some without) is a merge gone wrong
    more often than a plan, and reading each row its own way would hide it."""
    first = shape_of(rows[0], f"{source}: row 0")
    for i, row in enumerate(rows[1:], 1):
        shape = shape_of(row, f"{source}: row {i}")
        if shape != first:
            raise TetherError(f"{source}: row {i} is a {{{', '.join(shape)}}} row but row 0 is a "
                              f"{{{', '.join(first)}}} row; give every row the same columns")
    return first


def plain_text(row: dict, key: str, where: str) -> str:
    """A plain-text column's string; any other value is an error, never its Python repr."""
    value = row[key]
    if not isinstance(value, str):
        raise TetherError(f"{where} {key!r} must be a string (got {type(value).__name__}); write "
                          "it as text, or give chat messages where the stage accepts them")
    return value


@dataclass
class SFTRow:
    """One SFT row read: plain text (loss on `response`), or a chat whose assistant turns from
    message `reply_from` on carry loss (`tether.data.encoding` picks all or the last), rendered
    with the schemas of `tools`."""

    prompt: str = ""
    response: str = ""
    messages: list[dict] | None = None
    reply_from: int = 0
    tools: list[dict] | None = None


def _no_tools(row: dict, where: str) -> None:
    """Tool schemas in a plain-text row would be dropped: only a chat template writes them."""
    if row_tools(row, where):
        raise TetherError(f"{where} has a 'tools' column but plain-text rows, which cannot show "
                          "the model its tools; give the rows as chat messages, or drop 'tools'")


def read_sft_row(row: dict, shape: tuple[str, ...], where: str) -> SFTRow:
    """The texts or messages of one SFT row of shape `shape` (`sft_shape`)."""
    if shape == ("text",):
        text = plain_text(row, "text", where)
        check_reply(text, "'text'", where, "fill it in or drop the row")
        _no_tools(row, where)
        return SFTRow(response=text)  # no prompt: every token trains
    if shape == ("messages",):
        return SFTRow(messages=chat_messages(row["messages"], "messages", where),
                      tools=row_tools(row, where))
    key = shape[1]
    prompt = check_prompt(row["prompt"], where)
    if prompt is not None:  # TRL's conversational prompt-completion
        return SFTRow(messages=prompt + as_turns(row[key], key, where), reply_from=len(prompt),
                      tools=row_tools(row, where))
    _no_tools(row, where)
    if isinstance(row[key], (list, dict)):
        raise TetherError(f"{where} mixes a plain-text prompt with a chat {key!r}; give the prompt "
                          "as a list of messages too, or both as plain text")
    response = plain_text(row, key, where)
    check_reply(response, repr(key), where)
    return SFTRow(prompt=plain_text(row, "prompt", where), response=response)


def implicit_prompt(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """(prompt, chosen reply, rejected reply) of two plain texts that begin alike.

    The prompt is their longest common start (TRL's convention for implicit prompts) cut back to
    the whitespace before the word where they part, and that whitespace goes to the replies:
    "The sky is blue." / "The sky is bleak." share "The sky is bl" and give "The sky is" with
    " blue." / " bleak.". TRL cuts at the differing character ("bl" + "ue."), splitting a word
    into pieces a tokenizer never produces for it in running text; cutting at the word keeps each
    reply tokenised as in the full text, and the separator starts the reply, as in tether's plain
    rows (byte-level BPE reads " blue" as one token).
    """
    cut = common_start(chosen, rejected)
    while cut > 0 and not chosen[cut - 1].isspace():  # back to the start of the parting word
        cut -= 1
    while cut > 0 and chosen[cut - 1].isspace():  # the whitespace before it goes to the replies
        cut -= 1
    if cut == 0:
        raise TetherError(f"{where} has no 'prompt', and its chosen and rejected texts share no "
                          "opening words to take as one; add a 'prompt' column")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def preference_texts(tokenizer, row: dict, where: str) -> tuple[str, list[str], bool]:
    """(prompt text, [chosen text, rejected text], chat) of one preference row, plain or chat,
    with an explicit or an implicit prompt."""
    if any(isinstance(row.get(k), (list, dict)) for k in ("prompt", "chosen", "rejected")):
        return (*chat_preference_texts(tokenizer, row, where), True)
    chosen, rejected = plain_text(row, "chosen", where), plain_text(row, "rejected", where)
    _no_tools(row, where)
    for what, text in (("chosen", chosen), ("rejected", rejected)):
        check_reply(text, repr(what), where)
    if not _has(row, "prompt"):
        prompt, chosen, rejected = implicit_prompt(chosen, rejected, where)
        return prompt, [chosen, rejected], False
    return plain_text(row, "prompt", where), [chosen, rejected], False
