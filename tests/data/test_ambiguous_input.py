"""Rows and options that were read one way without a word (issue 33, clusters 5 and 9).

- `--loss-on last` with plain-text SFT rows (it chooses assistant turns; plain rows have none).
- An SFT row with two columns that each give its text: `response` and `completion`, `text`
  beside `prompt`, `response` or `completion` (before: whichever was looked up first).
- A prompt that is neither text nor chat (`{"prompt": 42}`), and a prompt file mixing plain and
  chat prompts (before: some rows through the chat template, some not), in the prompt files of
  ppo, rloo, grpo, eval and generate.
- A TRL tool-call assistant turn in a prompt file, under a template that writes no tool calls
  (before: the call vanished from the prompt, exit 0), and a prompt file's `tools` column
  (before: ignored; now rendered, as in SFT).
- A `--reward-model` that names a file (before: read as a model's config.json).

Each refusal goes through the CLI with `refused` (exit 2, one line, nothing written), on the GPT-2
(with a chat template where chat rows are needed) and the Llama-style tiny models; the checks
that need no model run before any model loads. Each has a valid neighbour that runs.
"""

from __future__ import annotations

import json

import pytest
from offline_fixtures import write_jsonl
from refusals import refused

from tether.cli import main

FAMILIES = ["gpt2_chat_dir", "tiny_llama_dir"]
PLAIN_FAMILIES = ["tiny_model_dir", "tiny_llama_dir"]

U = {"role": "user", "content": "the movie"}
A = {"role": "assistant", "content": "was fine."}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "name": "get_weather", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("ambiguous")
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [len(r) / 10 for r in responses]\n")
    (base / "runs").mkdir()
    return base


def sft(model, data, *extra):
    return ["sft", "--model", str(model), "--data", str(data), "--run-name", "x",
            "--output-dir", "runs", "--max-steps", "1", "--batch-size", "2", "--device", "cpu",
            "--report-to", "none", *extra]


def prompt_commands(model, prompts):
    """The five commands that read a prompt file, each refusing before it writes anything."""
    online = ["--policy", str(model), "--prompts", str(prompts), "--reward-fn",
              "rewards.py:score", "--run-name", "x", "--output-dir", "runs", "--device", "cpu",
              "--batch-size", "4", "--total-episodes", "4", "--max-new-tokens", "3",
              "--report-to", "none"]
    sampling = ["--model", str(model), "--prompts", str(prompts), "--device", "cpu",
                "--max-new-tokens", "3", "--batch-size", "2"]
    return {"ppo": ["ppo", *online], "rloo": ["rloo", *online], "grpo": ["grpo", *online],
            "eval": ["eval", *sampling, "--output", "runs/e.json"],
            "generate": ["generate", *sampling, "--output", "runs/g.jsonl"]}


# ----------------------------------------------------------------------------- --loss-on

@pytest.mark.parametrize("family", PLAIN_FAMILIES)
@pytest.mark.parametrize("row", [{"prompt": "the movie", "response": " was fine."},
                                 {"prompt": "the movie", "completion": " was fine."},
                                 {"text": "the movie was fine."}], ids=["response", "completion",
                                                                         "text"])
def test_loss_on_with_plain_rows(row, family, root, request, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    data = write_jsonl(root / "plain.jsonl", [row] * 2)
    refused(root, sft(request.getfixturevalue(family), data, "--loss-on", "last"),
            r"--loss-on last chooses which assistant turns of a chat carry loss, and .*plain.jsonl "
            r"has plain-text rows, which have no turns \(the loss is on each response\); drop it, "
            r"or give chat rows \(\{messages\}\)", capsys)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_on_with_chat_rows_trains(family, tmp_path, request, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [U, A, U, A]}] * 2)
    assert main(sft(request.getfixturevalue(family), data, "--loss-on", "last")) == 0
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "response": " b."}] * 2)
    assert main([*sft(request.getfixturevalue(family), plain), "--run-name", "y"]) == 0


# ----------------------------------------------------------------------------- rival columns

RIVALS = [
    ({"prompt": "the movie", "response": " was fine.", "completion": " was dull."},
     "'response' and 'completion'"),
    ({"text": "the movie was fine.", "prompt": "the movie"}, "'text' and 'prompt'"),
    ({"text": "the movie was fine.", "response": "was fine."}, "'text' and 'response'"),
    ({"text": "the movie was fine.", "completion": "was fine."}, "'text' and 'completion'"),
]


@pytest.mark.parametrize("family", PLAIN_FAMILIES)
@pytest.mark.parametrize(("row", "pair"), RIVALS, ids=[p for _, p in RIVALS])
def test_two_columns_that_give_the_text(row, pair, family, root, request, monkeypatch, capsys,
                                        no_loads):
    monkeypatch.chdir(root)
    data = write_jsonl(root / "rival.jsonl", [{"prompt": "a", "response": " b."}, row])
    refused(root, sft(request.getfixturevalue(family), data),
            rf"rival.jsonl: row 1 has both {pair}, which give its text two ways; keep one", capsys)


@pytest.mark.parametrize("family", FAMILIES)
def test_messages_beside_a_prompt_column_trains(family, tmp_path, request, monkeypatch):
    # hub chat sets (ultrachat_200k) keep the first user turn in `prompt` beside `messages`:
    # `messages` is read, as documented, and the row is no rival
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the movie", "messages": [U, A]}] * 2)
    assert main(sft(request.getfixturevalue(family), data)) == 0


# ----------------------------------------------------------------------------- prompt files

@pytest.mark.parametrize("family", PLAIN_FAMILIES)
@pytest.mark.parametrize("stage", ["ppo", "rloo", "grpo", "eval", "generate"])
@pytest.mark.parametrize(("value", "kind"), [(42, "int"), (True, "bool"), (1.5, "float")])
def test_a_prompt_that_is_neither_text_nor_chat(value, kind, stage, family, root, request,
                                                monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    prompts = write_jsonl(root / "p.jsonl", [{"prompt": value}, {"prompt": "it"}])
    argv = prompt_commands(request.getfixturevalue(family), prompts)[stage]
    refused(root, argv, rf"p.jsonl: row 0 'prompt' must be a string or chat messages \(got "
            rf"{kind}\); write it as text, or as \[\{{\"role\": \"user\"", capsys)


MIXED = [  # (rows, the kinds in the line)
    ([{"prompt": "the movie was"}, {"prompt": [U]}], "row 1 is a chat prompt but row 0 is plain text"),
    ([{"messages": [U]}, {"prompt": [U]}, {"prompt": "it"}],
     "row 2 is a plain text prompt but row 0 is chat"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage", ["ppo", "rloo", "grpo", "eval", "generate"])
@pytest.mark.parametrize(("rows", "line"), MIXED, ids=["plain-then-chat", "chat-then-plain"])
def test_a_prompt_file_mixing_plain_and_chat(rows, line, stage, family, root, request,
                                             monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    prompts = write_jsonl(root / "mixed.jsonl", rows)
    refused(root, prompt_commands(request.getfixturevalue(family), prompts)[stage],
            rf"mixed.jsonl: {line}; give every prompt the same way \(all text, or all chat "
            r"messages\)", capsys)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompts_of_both_forms_generate(family, tmp_path, request, monkeypatch):
    # `messages` rows and messages-valued `prompt` rows are both chat: one file may hold both
    monkeypatch.chdir(tmp_path)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [U]}, {"prompt": [U]}])
    argv = prompt_commands(request.getfixturevalue(family), prompts)["generate"]
    (tmp_path / "runs").mkdir()
    assert main(argv) == 0
    first, second = [json.loads(x)["prompt"] for x in (tmp_path / "runs" / "g.jsonl").open()]
    assert first == second


# ----------------------------------------------------------------------------- tool calls

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage", ["ppo", "rloo", "grpo", "eval", "generate"])
def test_a_tool_call_the_template_cannot_write(stage, family, root, request, monkeypatch, capsys,
                                              no_loads):
    monkeypatch.chdir(root)
    prompts = write_jsonl(root / "calls.jsonl", [{"prompt": TOOL_CHAT}] * 2)
    refused(root, prompt_commands(request.getfixturevalue(family), prompts)[stage],
            r"calls.jsonl: row 0 message 1 calls 'get_weather' but the chat template does not "
            r"write that call \(the rendered chat lacks it\); use a model whose template renders "
            "'tool_calls', or drop the calls", capsys)


def test_a_tools_column_beside_a_plain_prompt(root, tiny_llama_dir, monkeypatch, capsys,
                                              no_loads):
    monkeypatch.chdir(root)
    prompts = write_jsonl(root / "plain_tools.jsonl", [{"prompt": "weather?", "tools": TOOLS}])
    refused(root, prompt_commands(tiny_llama_dir, prompts)["generate"],
            "row 0 has a 'tools' column but a plain-text prompt, which cannot show the model its "
            "tools; give the prompt as chat messages, or drop 'tools'", capsys)


def test_tool_calls_and_schemas_reach_the_prompt(tmp_path, tiny_qwen2_tools_dir, monkeypatch):
    # a template that writes calls: the call turn is in the prompt, and the row's `tools`
    # schemas too (before: dropped without a word)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": TOOL_CHAT, "tools": TOOLS},
                                                 {"prompt": TOOL_CHAT}])
    argv = prompt_commands(tiny_qwen2_tools_dir, prompts)["generate"]
    assert main([*argv, "--max-prompt-len", "2048"]) == 0
    with_tools, without = [json.loads(x)["prompt"] for x in (tmp_path / "runs" / "g.jsonl").open()]
    assert "<tool_call>" in with_tools and '"get_weather"' in with_tools
    assert "The weather in a city." in with_tools and "The weather in a city." not in without
    assert "<tool_call>" in without


# ----------------------------------------------------------------------------- --reward-model

@pytest.mark.parametrize("family", PLAIN_FAMILIES)
def test_a_reward_model_that_is_a_file(family, root, request, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    model = request.getfixturevalue(family)
    write_jsonl(root / "prompts.jsonl", [{"prompt": "the movie"}, {"prompt": "it"}])
    grpo = ["grpo", "--policy", str(model), "--prompts", "prompts.jsonl", "--run-name", "x",
            "--output-dir", "runs", "--device", "cpu"]
    evaluate = ["eval", "--model", str(model), "--prompts", "prompts.jsonl", "--output",
                "runs/e.json", "--device", "cpu"]
    for argv in (grpo, evaluate):
        refused(root, [*argv, "--reward-model", str(model / "config.json")],
                rf"--reward-model {model}/config.json is a file; a reward model is a directory "
                r"\(a `tether rm` run's final/, or a sequence classifier saved with "
                rf"save_pretrained\): pass the directory that holds it \({model}\) if that is the "
                "model", capsys)
        refused(root, [*argv, "--reward-model", "rewards.py"],
                rf"--reward-model {root}/rewards.py is a file; .*: a Python reward function "
                rf"goes to --reward-fn {root}/rewards.py:FUNCTION$", capsys)
        # the directory: a causal LM, so the line says what it is (not a line about a file)
        refused(root, [*argv, "--reward-model", str(model)], "is not a reward model: it has no "
                "tether_reward.json", capsys)
