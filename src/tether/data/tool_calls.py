"""Tool-calling transcripts in TRL's conversational form (the OpenAI / Hugging Face messages):

    calls      an assistant message's `tool_calls`: `[{"type": "function", "function": {"name":
               str, "arguments": object or the JSON text of one}}]` (the bare `{"name",
               "arguments"}` form too); its `content` may be null or "" (a pure call)
    results    `{"role": "tool", "content": str, "name"?, "tool_call_id"?}`: context, never loss
    tools      a row's `tools` column: the functions' JSON schemas as transformers'
               `get_json_schema` builds them, a list of objects or the JSON text of one; every
               render of the row gets them (`apply_chat_template(tools=...)`)

Messages reach the template as they are, with one exception: JSON-text arguments become objects
when the template would write them as a quoted string (`tojson` on a string, as Qwen2.5's and
Llama 3.1's templates do); a template that writes a string as it is (Qwen3's) gets it unchanged.
A template that drops calls or schemas (one written before tools) is refused, found by rendering:
training on the text would teach the model to answer without the calls it was shown.

`render(messages, tools) -> str` is the tokenizer's template without the generation prompt
(`tether.data.chat.render_chat`), passed in so this module needs no tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from tether.errors import TetherError

CALL_FORM = ('write each call as {"type": "function", "function": {"name": "...", '
             '"arguments": {...}}}')
_PROBE_ARGUMENTS = '{"tether_probe": 1}'


def calls_of(message: dict) -> list:
    """The message's tool calls; `[]` for none (a Parquet/Arrow file gives every message the key,
    null where a message has no calls)."""
    return message.get("tool_calls") or []


def _function(call: dict) -> Any:
    return call["function"] if "function" in call else call  # the bare {"name", "arguments"} form


def parse_arguments(arguments: Any) -> dict | None:
    """A call's arguments as an object: an object as it is, JSON text of an object parsed; None
    for anything else (a number, a list, text that is not a JSON object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return arguments if isinstance(arguments, dict) else None


def check_tool_calls(message: dict, where: str) -> None:
    """A message's `tool_calls`, when it has any, are a list of calls, each naming a function and
    giving its arguments as an object (or its JSON text); only an assistant makes calls."""
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise TetherError(f"{where} 'tool_calls' must be a list of calls (got a "
                          f"{type(calls).__name__}); {CALL_FORM}")
    if calls and message["role"] != "assistant":
        raise TetherError(f"{where} has 'tool_calls' but role {message['role']!r}; only an "
                          "assistant message makes tool calls: move them to one")
    for k, call in enumerate(calls):
        if not isinstance(call, dict):
            raise TetherError(f"{where} tool call {k} is a {type(call).__name__}, not an object; "
                              f"{CALL_FORM}")
        function = _function(call)
        if not isinstance(function, dict):
            raise TetherError(f"{where} tool call {k} 'function' is a {type(function).__name__}, "
                              f"not an object; {CALL_FORM}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise TetherError(f"{where} tool call {k} has no function name; {CALL_FORM}")
        if parse_arguments(function.get("arguments")) is None:
            got = function.get("arguments")
            got = "text that is not a JSON object" if isinstance(got, str) else type(got).__name__
            raise TetherError(f"{where} tool call {k} ({name}) has arguments that are neither an "
                              f"object nor the JSON text of one (got {got}); give them as "
                              '{"name": value, ...}, {} for none')


def row_tools(row: dict, where: str) -> list[dict] | None:
    """A row's `tools` column as a list of schema objects (JSON text of one parsed); None when the
    row has none (no column, null, or [])."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise TetherError(f"{where} 'tools' is text but not JSON ({exc.msg} at character "
                              f"{exc.pos}); give a list of function schemas or its JSON "
                              "text") from None
    if not tools:
        return None
    if not isinstance(tools, list):
        raise TetherError(f"{where} 'tools' must be a list of function schemas (got a "
                          f"{type(tools).__name__}); give [{{\"type\": \"function\", "
                          "\"function\": {...}}, ...] or its JSON text")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TetherError(f"{where} 'tools' item {k} is a {type(tool).__name__}, not a "
                              "function schema object; give each tool as transformers' "
                              "get_json_schema writes it")
    return tools


def probe_call(render, arguments: Any) -> str:
    """`render(messages)` of a chat whose one assistant turn calls `tether_probe(arguments)`, to
    read off how a template writes calls; "" when the template refuses it."""
    call = {"type": "function", "function": {"name": "tether_probe", "arguments": arguments}}
    try:
        return render([{"role": "user", "content": "q"},
                       {"role": "assistant", "content": "", "tool_calls": [call]}])
    except TetherError:
        return ""


def _object_arguments(call: dict) -> dict:
    """`call` with its arguments as an object (JSON text parsed), in the form it came in."""
    function = dict(_function(call), arguments=parse_arguments(_function(call)["arguments"]))
    return dict(call, function=function) if "function" in call else function


def _check_calls_written(render, messages: list[dict], tools: list[dict] | None,
                         where: str) -> None:
    """Each call's function name appears in the whole chat's text more often than when its
    message's calls are left out: counted, so the schemas or another turn naming the function
    do not hide a dropped call, and in the whole chat, as it is trained on (a template that
    writes calls only in the last turn drops the earlier ones)."""
    full = render(messages, tools)
    for i, message in enumerate(messages):
        names = Counter(_function(c)["name"] for c in calls_of(message))
        if not names:
            continue
        # the key goes (templates test `'tool_calls' in message`), null content becomes ""
        bare = {k: v for k, v in message.items() if k != "tool_calls"}
        bare["content"] = message["content"] or ""
        without = render(messages[:i] + [bare] + messages[i + 1:], tools)
        for name, n in names.items():
            if full.count(name) - without.count(name) < n:
                raise TetherError(f"{where} message {i} calls {name!r} but the chat template does "
                                  "not write that call (the rendered chat lacks it); use a model "
                                  "whose template renders 'tool_calls', or drop the calls")


def prepare_tool_chat(render, messages: list[dict], tools: list[dict] | None,
                      where: str) -> list[dict]:
    """`messages` as the template gets them (see the module docstring), checked to render every
    call and, when given, the tools' schemas; `render(messages, tools) -> str`."""
    if not tools and not any(calls_of(m) for m in messages):
        return messages  # an ordinary chat: no extra renders
    # JSON-text arguments go as objects when the template writes them as a quoted JSON string (it
    # applies `tojson` to them), found by rendering a probe call (a template that refuses the
    # probe: left as they are, and the row's own render will say why)
    quoted = json.dumps(_PROBE_ARGUMENTS)
    if any(isinstance(_function(c).get("arguments"), str) for m in messages for c in calls_of(m)) \
            and quoted in probe_call(lambda ms: render(ms, None), _PROBE_ARGUMENTS):
        messages = [dict(m, tool_calls=[_object_arguments(c) for c in calls_of(m)])
                    if calls_of(m) else m for m in messages]
    _check_calls_written(render, messages, tools, where)
    if tools and render(messages, tools) == render(messages, None):
        raise TetherError(f"{where} has 'tools' but the chat template does not write tool schemas "
                          "(the chat renders the same without them); use a model whose template "
                          "renders tools, or drop the 'tools' column")
    return messages
