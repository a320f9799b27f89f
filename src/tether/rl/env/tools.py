"""Typed Python functions as an environment (`--tools file.py:add,file.py:lookup`): the model
calls them, reads their results, and answers.

    schemas    each function's JSON schema, built by transformers (`get_json_schema`, from its
               type hints and docstring); the chat template renders them where the model
               expects them (`apply_chat_template(tools=...)`)
    calls      parsed from the policy's turn in the format its template writes tool calls: the
               tokenizer's own response parser when it declares one (transformers'
               `parse_response`), else the format a probe call renders in (`<tool_call>{...}
               </tool_call>` of Hermes and Qwen, Mistral's `[TOOL_CALLS][...]`, a bare JSON
               call as Llama 3.1 writes it)
    results    each call's result as a `tool` message (a str as it is, else as JSON). Bad JSON,
               an unknown tool, arguments the function refuses, a tool that raises (or calls
               sys.exit), returns what JSON cannot write (a set, bytes), or does not
               return within --env-timeout seconds go back to the model as that tool message
               ("error: ..."), counted in `env/tool_errors`; they never stop the run (a tool's
               hang is the model's observation, as a slow web search is an agent's; the first
               hang of each tool is said once, as a warning, since nothing can stop the hung
               call: its thread is left running). A tool may be `async def` (run on the
               process's event loop, tether.run.user_code.calls); a KeyboardInterrupt it raises
               stops the run as Ctrl-C does
    end        the first turn without a call ends the episode, scored by the reward functions on
               that final answer (`tether.rl.reward.functions`): tether's form reads
               `([last user message of the first prompt], [answer])`; TRL's form the row's prompt
               as given, the answer as a string or assistant message and the row's columns, but
               no `completion_ids` (the answer's ids are one turn of an episode that holds the
               tools' tokens too, so no list of ids is the completion TRL means)

The episode's first prompt is the row's `prompt` or `messages` (a plain prompt becomes a user
message: tools are rendered by a chat template).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from functools import partial

from tether.data.chat import chat_messages, render_chat
from tether.data.tool_calls import parse_arguments, probe_call
from tether.errors import TetherError
from tether.rl.reward.functions import RewardFunctions, reward_from_functions
from tether.run.user_code.calls import Call, Runner
from tether.run.user_code.load import defined_at, function_name, is_async_function, raised

_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of `fn` as transformers builds it; one line naming what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' own message says which hint or docstring line
        raise TetherError(f"tool {function_name(fn)} has no usable schema ({exc}); give it type "
                          "hints and a Google-style docstring with an Args section") from None


def call_format(tokenizer, schemas: list[dict]) -> str:
    """How the template writes a tool call: "parser" (the tokenizer's response parser), "tags"
    (`<tool_call>` JSON), "mistral" (`[TOOL_CALLS]`) or "json" (a bare JSON object)."""
    if getattr(tokenizer, "response_template", None) and hasattr(tokenizer, "parse_response"):
        return "parser"
    text = probe_call(lambda ms: render_chat(tokenizer, ms, False, "the tool-call probe", schemas),
                      {"x": 1})
    if "<tool_call>" in text:
        return "tags"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "tether_probe" in text:
        return "json"
    raise TetherError("the chat template writes no tool calls (a probe call rendered to "
                      "nothing); use a model whose template supports tools, or an --env")


def parse_calls(text: str, form: str, tokenizer=None, tools: list[dict] | None = None
                ) -> tuple[list[tuple[str, dict]], str | None]:
    """([(name, arguments)], None), or ([], what is wrong) for a turn that tries a call and
    fails; ([], None) for a turn without a call (the answer)."""
    if form == "parser":
        try:
            parsed = tokenizer.parse_response(text, prefix="", tools=tools)
        except Exception as exc:
            return [], f"the tool call could not be parsed ({type(exc).__name__}: {exc})"
        raw = [c.get("function", c) for c in parsed.get("tool_calls") or []]
    else:
        if form == "tags":  # each block one call
            blocks = _CALL_BLOCK.findall(text)
            if not blocks:
                return [], ("a <tool_call> block is not closed" if "<tool_call>" in text else None)
        else:  # one JSON value: a call, or a list of calls
            start = text.find("[TOOL_CALLS]") if form == "mistral" else 0
            body = text[start + len("[TOOL_CALLS]"):] if form == "mistral" and start >= 0 else text
            if form == "mistral" and start < 0 or form == "json" and not body.lstrip().startswith("{"):
                return [], None
            blocks = [body.strip()]
        raw = []
        for block in blocks:
            try:
                value = json.loads(block)
            except json.JSONDecodeError as exc:
                return [], f"the tool call is not JSON ({exc.msg} at character {exc.pos})"
            raw += value if form != "tags" and isinstance(value, list) else [value]
    calls = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return [], "a tool call needs a 'name' and its 'arguments'"
        # some formats send the arguments as a JSON string
        arguments = parse_arguments(item.get("arguments", item.get("parameters", {})))
        if arguments is None:
            return [], f"the arguments of {item['name']} are not a JSON object"
        calls.append((item["name"], arguments))
    return calls, None


class ToolsEnv:
    """One episode with the tools (see the module docstring). `timeout`: seconds a tool call
    may take (--env-timeout); `hung`: the tools whose hang was said already (shared by the
    episodes)."""

    def __init__(self, functions: dict[str, Callable], schemas: list[dict], form: str,
                 reward: RewardFunctions | None, tokenizer, timeout: float, hung: set[str]):
        self.functions, self.schemas, self.form = functions, schemas, form
        self.reward, self.tokenizer = reward, tokenizer
        self.timeout, self.hung = timeout, hung
        self.prompt, self.row = "", {}
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0}

    def reset(self, row: dict, seed: int) -> list[dict]:
        where = "a tools episode's prompt row"
        if row.get("messages") is not None or isinstance(row.get("prompt"), list):
            messages = chat_messages(row.get("messages", row.get("prompt")), "messages", where)
        elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise TetherError(f"{where} has neither a 'prompt' nor 'messages'; give one of them")
        self.prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"),
                           messages[-1]["content"])
        self.row = row
        return messages

    def step(self, action: str):
        calls, problem = parse_calls(action, self.form, self.tokenizer, self.schemas)
        if problem is not None:
            self.counts["tool_errors"] += 1
            return [{"role": "tool", "content": f"error: {problem}"}], 0.0, False
        if not calls:  # the answer
            if self.reward is None:
                return None, 0.0, True
            scored = self.reward.score([self.prompt], [action], [self.row], None)
            return None, float(scored.scores[0]), True
        return [self._result(name, arguments) for name, arguments in calls], 0.0, False

    def _result(self, name: str, arguments: dict) -> dict:
        self.counts["tool_calls"] += 1
        content, failed = self._content(name, arguments)
        self.counts["tool_errors"] += failed
        return {"role": "tool", "name": name, "content": content}

    def _content(self, name: str, arguments: dict) -> tuple[str, bool]:
        """(the tool message's text, whether the call failed): a failure is "error: ..." (the
        tool's failure is the model's observation)."""
        fn = self.functions.get(name)
        if fn is None:
            return f"error: no tool named {name!r}; the tools are {', '.join(self.functions)}", True
        # In a daemon thread of its own, or on the loop (`async def`); a hung one is left running
        call = Call(partial(fn, **arguments), is_async=is_async_function(fn), label=f"tool {name}")
        [outcome] = Runner(timeout=self.timeout, timeout_flag="--env-timeout").run([call])
        if outcome.cause is not None:
            if outcome.error is not None:
                return f"error: {raised(outcome.error)}", True
            if name not in self.hung:  # said once per tool
                self.hung.add(name)
                print(f"warning: tool {name} did not return within {self.timeout:g} s "
                      "(--env-timeout); the call went back to the model as an error (counted in "
                      "env/tool_errors) and is left running; fix the tool or raise --env-timeout",
                      file=sys.stderr, flush=True)
            return f"error: {name} did not return within {self.timeout:g} s", True
        result = outcome.value
        try:  # a set, bytes or an object JSON cannot write is the tool's failure too
            return (result if isinstance(result, str) else json.dumps(result)), False
        except (TypeError, ValueError):
            return (f"error: {name} ({defined_at(fn)}) returned a {type(result).__name__}, "
                    "which is not JSON; return a str or JSON data"), True

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)


def tools_environment(tools: Sequence[Callable], reward: RewardFunctions | Callable | None,
                      tokenizer, timeout: float = 0.0) -> tuple[Callable, list[dict]]:
    """(an environment factory for these tools, their schemas); `reward`: the reward functions,
    or one plain function; `timeout`: seconds a tool call may take (0: no limit)."""
    if reward is not None and not isinstance(reward, RewardFunctions):
        reward = reward_from_functions([reward])
    functions = {}
    for fn in tools:
        name = getattr(fn, "__name__", None)
        if name in functions:
            raise TetherError(f"two tools are named {name!r}; give each tool a distinct name")
        functions[name] = fn
    schemas = [tool_schema(fn) for fn in tools]
    form = call_format(tokenizer, schemas)
    hung: set[str] = set()

    def make_env() -> ToolsEnv:
        return ToolsEnv(functions, schemas, form, reward, tokenizer, timeout, hung)
    # tether names a factory `module:qualname` in its errors: here `--tools:add,lookup`
    make_env.__module__, make_env.__qualname__ = "--tools", ",".join(functions)
    return make_env, schemas
