"""Typed Python functions as tools (tether.rl.env.tools), against the chat template itself:

- an episode of call, result and answer holds exactly the tokens the template writes for that
  conversation in TRL's data shape (an assistant `tool_calls` message and a `tool` message), so
  what the policy sees while it trains is what it sees at inference and in SFT data;
- every way a call can go wrong (bad JSON, an unclosed block, an unknown tool, arguments the
  function refuses, a tool that raises) goes back to the model as the tool's message, is counted
  in env/tool_errors, and the episode goes on;
- the call formats: `<tool_call>` tags, Mistral's `[TOOL_CALLS]`, a bare JSON object; schemas
  from type hints and docstrings.
"""

from __future__ import annotations

import json
import os

import pytest
from episode_helpers import Scripted, scripted_episodes

from tether.data.chat import render_chat
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.rl.env.tools import call_format, parse_calls, tool_schema, tools_environment


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide one number by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def says_five(prompts, responses):
    return [float("5" in r) for r in responses]


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ROWS = [{"prompt": "What is 2 plus 3?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_tools_dir):
    return load_tokenizer(str(tiny_qwen2_tools_dir))


def two_turns(first: str, answer: str = "It is 5."):
    """A script: `first` until a tool response is in the context, then `answer`."""
    return lambda context: answer if "<tool_response>" in context else first


def test_an_episode_is_the_conversation_the_template_writes(tokenizer):
    make_env, schemas = tools_environment([add, divide], says_five, tokenizer)
    engine = Scripted(tokenizer, two_turns(CALL))
    out = scripted_episodes(engine, make_env, ROWS, tools=schemas)

    # The same conversation in TRL's data shape, rendered by the template.
    transcript = [{"role": "user", "content": ROWS[0]["prompt"]},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "add",
                                                        "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "name": "add", "content": "5"},
                  {"role": "assistant", "content": "It is 5."}]
    rendered = render_chat(tokenizer, transcript, False, tools=schemas)
    row = out.records[0]
    assert tokenizer.decode(row["token_ids"], skip_special_tokens=False) == rendered.rstrip("\n")
    # The second turn was sampled from the template's text up to the next assistant turn.
    assert engine.contexts[1] == render_chat(tokenizer, transcript[:3], True, tools=schemas)
    # The loss sees the two assistant turns (each closed by the <|im_end|> the policy sampled),
    # nothing of the tool's answer or the template's role markers.
    ids, mask = row["token_ids"], row["action_mask"]
    sampled = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert sampled == CALL + "<|im_end|>" + "It is 5." + "<|im_end|>"
    first_action = mask.index(1)
    between = [t for k, (t, m) in enumerate(zip(ids, mask)) if not m and k > first_action]
    assert tokenizer.decode(between, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert row["turn_rewards"] == [0.0, 1.0] and float(out.rewards[0]) == 1.0
    assert out.stats["env/tool_calls"] == 1 and out.stats["env/tool_errors"] == 0
    assert out.stats["env/segments"] == 0 and row["done"]


@pytest.mark.parametrize("first, says", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>', "is not JSON"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}', "block is not closed"),
    ('<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
     "no tool named 'mul'; the tools are add, divide"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', "TypeError"),
    ('<tool_call>\n{"name": "divide", "arguments": {"a": 2, "b": 0}}\n</tool_call>',
     "ZeroDivisionError"),
    ('<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>', "needs a 'name'"),
    ('<tool_call>\n{"name": "add", "arguments": "[1, 2]"}\n</tool_call>', "not a JSON object"),
], ids=["bad-json", "unclosed", "unknown-tool", "bad-arguments", "tool-raises", "no-name",
        "arguments-not-object"])
def test_a_failed_call_is_the_tool_s_answer_and_the_episode_goes_on(tokenizer, first, says):
    make_env, schemas = tools_environment([add, divide], says_five, tokenizer)
    engine = Scripted(tokenizer, two_turns(first))
    out = scripted_episodes(engine, make_env, ROWS, tools=schemas)
    row = out.records[0]
    assert row["turns"] == 2 and row["reward"] == 1.0  # the model answered after the error
    assert out.stats["env/tool_errors"] == 1
    response = engine.contexts[1].split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert response.startswith("error: ") and says in response, response


def test_several_calls_in_one_turn_answer_in_order(tokenizer):
    two = CALL + '\n<tool_call>\n{"name": "divide", "arguments": {"a": 9, "b": 2}}\n</tool_call>'
    make_env, schemas = tools_environment([add, divide], says_five, tokenizer)
    engine = Scripted(tokenizer, two_turns(two))
    out = scripted_episodes(engine, make_env, ROWS, tools=schemas)
    assert "<tool_response>\n5\n</tool_response>\n<tool_response>\n4.5\n</tool_response>" in (
        engine.contexts[1])
    assert out.stats["env/tool_calls"] == 2 and out.stats["env/tool_errors"] == 0


def test_an_answer_without_a_call_ends_the_episode_scored(tokenizer):
    make_env, schemas = tools_environment([add], says_five, tokenizer)
    out = scripted_episodes(Scripted(tokenizer, lambda c: "5, surely"), make_env, ROWS * 2,
                            tools=schemas)
    assert [r["turns"] for r in out.records] == [1, 1]
    assert out.rewards.tolist() == [1.0, 1.0] and out.stats["env/tool_calls"] == 0


def test_schemas_come_from_hints_and_docstrings():
    assert tool_schema(add) == {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.",
                     "parameters": {"type": "object",
                                    "properties": {"a": {"type": "integer",
                                                         "description": "The first number."},
                                                   "b": {"type": "integer",
                                                         "description": "The second number."}},
                                    "required": ["a", "b"]},
                     "return": {"type": "integer"}}}

    def bare(a, b):
        return a

    with pytest.raises(TetherError, match=r"tool .*bare has no usable schema \(.*no docstring") as caught:
        tool_schema(bare)
    assert "\n" not in str(caught.value)


def test_two_tools_of_one_name_are_refused(tokenizer):
    def other():
        pass
    other.__name__ = "add"
    with pytest.raises(TetherError, match="two tools are named 'add'"):
        tools_environment([add, other], says_five, tokenizer)


# The call formats, on text alone.
MISTRAL_TOOLS = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                 "{% if m.get('tool_calls') %}[TOOL_CALLS]{{ m['tool_calls'] | map(attribute="
                 "'function') | list | tojson }}{% else %}{{ m['content'] }}{% endif %}"
                 "{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
                 "{% endfor %}")
JSON_TOOLS = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('tool_calls') %}"
              "{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", "
              "\"parameters\": {{ c['function']['arguments'] | tojson }}}{% endfor %}"
              "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template, form", [(MISTRAL_TOOLS, "mistral"), (JSON_TOOLS, "json")])
def test_the_format_is_read_off_the_template(tiny_llama_dir, template, form):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    tokenizer.chat_template = template
    assert call_format(tokenizer, [tool_schema(add)]) == form


def test_the_tags_format_and_a_template_without_calls(tokenizer, tiny_llama_dir):
    assert call_format(tokenizer, [tool_schema(add)]) == "tags"
    plain = load_tokenizer(str(tiny_llama_dir))  # its template drops tool_calls
    with pytest.raises(TetherError, match="writes no tool calls"):
        call_format(plain, [tool_schema(add)])


@pytest.mark.parametrize("form, text, calls", [
    ("tags", CALL, [("add", {"a": 2, "b": 3})]),
    ("tags", 'I will add.\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
             '</tool_call>', [("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "divide", "arguments": {"a": 1, "b": 4}}]',
     [("add", {"a": 1, "b": 2}), ("divide", {"a": 1, "b": 4})]),
    ("json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
])
def test_calls_parse_in_each_format(form, text, calls):
    assert parse_calls(text, form) == (calls, None)


@pytest.mark.parametrize("form", ["tags", "mistral", "json"])
def test_an_answer_is_no_call_in_any_format(form):
    assert parse_calls("The answer is 5.", form) == ([], None)


def test_a_plain_text_reset_cannot_use_tools(tokenizer):
    from tether.rl.env.render import Renderer

    renderer = Renderer(tokenizer, 64, 16, [tool_schema(add)])
    with pytest.raises(TetherError, match="return chat messages from reset"):
        renderer.first("What is 2 plus 3?", "episode 0")


def test_the_schemas_reach_the_first_prompt(tokenizer):
    make_env, schemas = tools_environment([add], says_five, tokenizer)
    engine = Scripted(tokenizer, lambda c: "5")
    scripted_episodes(engine, make_env, ROWS, tools=schemas)
    assert json.dumps(schemas[0]) in engine.contexts[0]
    assert engine.contexts[0] == render_chat(
        tokenizer, [{"role": "user", "content": ROWS[0]["prompt"]}], True, tools=schemas)


HERE = os.path.relpath(__file__)  # the tool's file, as a tool's error names it


def pair(a: int, b: int) -> set:
    """Both numbers, as a set.

    Args:
        a: The first number.
        b: The second number.
    """
    return {a, b}


def raw(a: int, b: int) -> bytes:
    """Both numbers, as bytes.

    Args:
        a: The first number.
        b: The second number.
    """
    return bytes([a, b])


async def later(a: int, b: int) -> int:
    """Add two integers, on the event loop.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def wrapped(a: int, b: int) -> int:
    """Add two integers: a plain function handing back an async one's coroutine (a decorator).

    Args:
        a: The first number.
        b: The second number.
    """
    return later(a, b)


async def later_set(a: int, b: int) -> set:
    """Both numbers, as a set, on the event loop.

    Args:
        a: The first number.
        b: The second number.
    """
    return {a, b}


@pytest.mark.parametrize("tool, says", [
    (pair, f"error: pair ({HERE}:{pair.__code__.co_firstlineno}) returned a set, which is not "
           "JSON; return a str or JSON data"),
    (raw, f"error: raw ({HERE}:{raw.__code__.co_firstlineno}) returned a bytes, which is not"),
    (later_set, f"error: later_set ({HERE}:{later_set.__code__.co_firstlineno}) returned a set"),
    (later, "5"),  # an `async def` tool is awaited on the process's loop, as async rewards are
    (wrapped, "5"),  # and so is the coroutine a plain function returns
], ids=["set", "bytes", "async-set", "async", "async-wrapped"])
def test_a_result_json_cannot_write_is_the_tool_s_error(tokenizer, tool, says):
    """Before: the run stopped, blaming tether's own factory and json's encoder.py."""
    call = CALL.replace('"add"', f'"{tool.__name__}"')
    make_env, schemas = tools_environment([tool], says_five, tokenizer)
    engine = Scripted(tokenizer, two_turns(call))
    out = scripted_episodes(engine, make_env, ROWS, tools=schemas, max_observation=200)
    assert out.records[0]["turns"] == 2 and out.records[0]["reward"] == 1.0  # it went on
    response = engine.contexts[1].split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert response == says if says == "5" else response.startswith(says), response
    assert out.stats["env/tool_errors"] == (0 if says == "5" else 1)
