"""Chat rows that are not chats, and the legitimate ones that look odd (issue 23).

Every place a chat can appear: SFT `messages`, `prompt` / `completion` as message lists,
preference `prompt` / `chosen` / `rejected` as message lists, and prompt files for ppo, grpo,
rloo, eval and generate. A value that is not a chat (a string, one dict, a list of strings, [],
a message without a role or content, a role that is not a name, content null) and a reply to
learn that is empty are one line `error: ...` with exit 2 and nothing written (before: 5
tracebacks from inside the template or 9 silent runs, DPO preferring an empty chosen reply).

Legitimate rows are checked against truth written out here: content as text parts trains exactly
as the joined string does (the same final weights, the ids of the hand-rendered template text); a
role the template renders (`robot`) is accepted and rendered as the template says, one it refuses
is the template's own line; an empty turn that nothing learns from (context under `--loss-on last`,
an empty system message) is accepted. Each runs on a Llama-style and a GPT-2-style tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import with_chat_template
from refusals import refused
from safetensors.torch import load_file

from tether.cli import main
from tether.data.encoding import encode_sft
from tether.data.prompts import load_prompts
from tether.models.pretrained import load_tokenizer

# The tiny GPT-2 has no chat template: conftest's gpt2_chat_dir gives it one.
# A template that knows four roles and raises on any other, as many hub templates do.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

U = {"role": "user", "content": "the movie"}
A = {"role": "assistant", "content": "was fine."}
B = {"role": "assistant", "content": "was dull."}
EMPTY_A = {"role": "assistant", "content": ""}
FORM = r'; write each message as \{"role": "user", "content": "..."\}'


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


# (name, row, the one line's pattern); every row is written twice, so a batch of 2 is possible
SFT_CASES = [
    ("messages a string", {"messages": "the movie was fine."},
     r"row 0 'messages' must be a list of \{role, content\} messages \(got a str\)" + FORM),
    ("messages one dict", {"messages": U}, r"'messages' must be a list .*\(got a dict\)" + FORM),
    ("messages strings", {"messages": ["the movie", "was fine."]},
     r"'messages' must be a list .*\(message 0 is a str, not a \{role, content\} object\)"),
    ("messages []", {"messages": []}, r"'messages' must be a list .*\(got an empty list\)"),
    ("message without role", {"messages": [{"content": "the movie"}, A]},
     r"\(message 0 has no 'role' \(keys: content\)\)" + FORM),
    ("role a number", {"messages": [{"role": 1, "content": "the movie"}, A]},
     r"\(message 0 has role 1, not a name such as 'user'\)"),
    ("role empty", {"messages": [{"role": "", "content": "the movie"}, A]},
     r"\(message 0 has role '', not a name such as 'user'\)"),
    ("message not a dict", {"messages": [U, "was fine."]}, r"\(message 1 is a str, not a"),
    ("content null", {"messages": [{"role": "user", "content": None}, A]},
     r"'messages' message 0 content must be a string or a list of text parts \(got null\); "
     r"give the message its text, or drop the message"),
    ("content missing", {"messages": [{"role": "user"}, A]}, r"\(message 0 has no 'content'\)"),
    ("reply null", {"messages": [U, {"role": "assistant", "content": None}]},
     r"'messages' message 1 content must be .*\(got null\)"),
    ("reply missing", {"messages": [U, {"role": "assistant"}]}, r"\(message 1 has no 'content'\)"),
    ("reply empty", {"messages": [U, EMPTY_A]},
     r"row 0 assistant message 1 \(a turn to learn\) is empty \(nothing to learn from\); fill in "
     r"the reply or drop the row"),
    ("reply blank", {"messages": [U, {"role": "assistant", "content": " \n"}]},
     r"assistant message 1 \(a turn to learn\) is empty"),
    ("reply empty parts", {"messages": [U, {"role": "assistant", "content": []}]},
     r"assistant message 1 \(a turn to learn\) is empty"),
    ("earlier turn empty", {"messages": [U, EMPTY_A, U, A]},
     r"assistant message 1 \(a turn to learn\) is empty .*or pass --loss-on last"),
    ("prompt []", {"prompt": [], "completion": "was fine."},
     r"'prompt' must be a string or a list of \{role, content\} messages \(got an empty list\)"),
    ("prompt strings", {"prompt": ["the movie"], "completion": "was fine."},
     r"'prompt' must be a string or a list .*\(message 0 is a str"),
    ("prompt without role", {"prompt": [{"content": "the movie"}], "completion": [A]},
     r"'prompt' must be .*\(message 0 has no 'role'"),
    ("completion []", {"prompt": [U], "completion": []},
     r"'completion' must be a string, an assistant message or a list of \{role, content\} "
     r"messages \(got an empty list\)"),
    ("completion strings", {"prompt": [U], "completion": ["was fine."]},
     r"'completion' must be .*\(message 0 is a str"),
    ("completion dict without role", {"prompt": [U], "completion": {"content": "was fine."}},
     r"'completion' must be .*\(message 0 has no 'role'"),
    ("completion content null", {"prompt": [U], "completion": [{"role": "assistant", "content": None}]},
     r"'completion' message 0 content must be .*\(got null\)"),
    ("completion empty string", {"prompt": [U], "completion": ""},
     r"assistant message 1 \(a turn to learn\) is empty"),
    ("plain response empty", {"prompt": "the movie", "response": ""},
     r"row 0 'response' is empty \(nothing to learn from\)"),
    ("text empty", {"text": " "}, r"row 0 'text' is empty \(nothing to learn from\); fill it in"),
]

PREFERENCE_CASES = [
    ("chosen []", {"prompt": [U], "chosen": [], "rejected": [B]},
     r"'chosen' must be a string, an assistant message or a list .*\(got an empty list\)"),
    ("chosen strings", {"prompt": [U], "chosen": ["was fine."], "rejected": [B]},
     r"'chosen' must be .*\(message 0 is a str"),
    ("chosen without role", {"prompt": [U], "chosen": [{"content": "was fine."}], "rejected": [B]},
     r"'chosen' must be .*\(message 0 has no 'role'"),
    ("chosen dict without content", {"prompt": [U], "chosen": {"role": "assistant"}, "rejected": [B]},
     r"'chosen' must be .*\(message 0 has no 'content'\)"),
    ("chosen content null", {"prompt": [U], "chosen": [{"role": "assistant", "content": None}],
                             "rejected": [B]}, r"'chosen' message 0 content must be .*\(got null\)"),
    ("chosen empty", {"prompt": [U], "chosen": [EMPTY_A], "rejected": [B]},
     r"row 0 'chosen' is empty \(nothing to learn from\); fill in the reply or drop the row"),
    ("chosen empty string", {"prompt": [U], "chosen": "", "rejected": "was dull."},
     r"row 0 'chosen' is empty"),
    ("rejected empty", {"prompt": [U], "chosen": [A], "rejected": [{"role": "assistant",
                                                                    "content": parts()}]},
     r"row 0 'rejected' is empty"),
    ("plain chosen empty", {"prompt": "the movie", "chosen": "", "rejected": " was dull."},
     r"row 0 'chosen' is empty"),
    ("prompt []", {"prompt": [], "chosen": [A], "rejected": [B]},
     r"'prompt' must be a string or a list .*\(got an empty list\)"),
    ("prompt one dict", {"prompt": U, "chosen": [A], "rejected": [B]},
     r"'prompt' must be a string or a list .*\(got a dict\)"),
    ("prompt without role", {"prompt": [{"content": "x"}], "chosen": [A], "rejected": [B]},
     r"'prompt' must be .*\(message 0 has no 'role'"),
    ("prompt content null", {"prompt": [{"role": "user", "content": None}], "chosen": [A],
                             "rejected": [B]}, r"'prompt' message 0 content must be .*\(got null\)"),
    ("conversation reply null", {"chosen": [U, {"role": "assistant", "content": None}],
                                 "rejected": [U, B]}, r"'chosen' message 1 content .*\(got null\)"),
    ("role a number", {"prompt": [{"role": 2, "content": "x"}], "chosen": [A], "rejected": [B]},
     r"'prompt' must be .*\(message 0 has role 2, not a name"),
]

PROMPT_CASES = [
    ("messages a string", {"messages": "the movie"}, r"'messages' must be a list .*\(got a str\)"),
    ("messages one dict", {"messages": U}, r"'messages' must be a list .*\(got a dict\)"),
    ("messages strings", {"messages": ["the movie"]}, r"\(message 0 is a str, not a"),
    ("messages []", {"messages": []}, r"'messages' must be a list .*\(got an empty list\)"),
    ("message without role", {"messages": [{"content": "the movie"}]}, r"\(message 0 has no 'role'"),
    ("content null", {"messages": [{"role": "user", "content": None}]}, r"content .*\(got null\)"),
    ("content missing", {"messages": [{"role": "user"}]}, r"\(message 0 has no 'content'\)"),
    ("role a number", {"messages": [{"role": 3, "content": "the movie"}]}, r"has role 3, not a name"),
    ("prompt []", {"prompt": []}, r"'prompt' must be a string or a list .*\(got an empty list\)"),
    ("prompt without role", {"prompt": [{"content": "x"}]}, r"'prompt' must be .*has no 'role'"),
    ("every content empty", {"messages": [{"role": "system", "content": ""}, {"role": "user",
                                                                             "content": parts()}]},
     r"row 0 has an empty prompt \(every message's content is empty\); fill it in or remove"),
]


def _write(path: Path, row: dict) -> Path:
    path.write_text((json.dumps(row) + "\n") * 2, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def strict_dir(tiny_llama_dir, tmp_path_factory):
    """The Llama model with a template that raises on a role it does not know."""
    return with_chat_template(tiny_llama_dir, STRICT_TEMPLATE,
                              tmp_path_factory.mktemp("strict") / "model")


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_llama_dir):
    """The bad files, a reward function, and a finished run that no bad call may touch."""
    base = tmp_path_factory.mktemp("chat_rows")
    for kind, cases in (("sft", SFT_CASES), ("pref", PREFERENCE_CASES), ("prompt", PROMPT_CASES)):
        for k, (_, row, _) in enumerate(cases):
            _write(base / f"{kind}{k}.jsonl", row)
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [float(len(r)) for r in responses]\n")
    good = _write(base / "good.jsonl", {"messages": [U, A]})
    assert main(["sft", "--model", str(tiny_llama_dir), "--data", str(good), "--run-name", "done",
                 "--output-dir", str(base / "runs"), "--max-steps", "1", "--batch-size", "2",
                 "--device", "cpu"]) == 0
    return base


FAMILIES = ["tiny_llama_dir", "gpt2_chat_dir"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", range(len(SFT_CASES)), ids=[c[0] for c in SFT_CASES])
def test_bad_sft_chat_rows_are_one_line(k, family, root, request, capsys):
    _, _, pattern = SFT_CASES[k]
    argv = ["sft", "--model", str(request.getfixturevalue(family)), "--data",
            str(root / f"sft{k}.jsonl"), "--run-name", "bad", "--output-dir", str(root / "runs"),
            "--max-steps", "1", "--batch-size", "2", "--device", "cpu"]
    refused(root, argv, pattern, capsys)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage", ["rm", "dpo"])
@pytest.mark.parametrize("k", range(len(PREFERENCE_CASES)), ids=[c[0] for c in PREFERENCE_CASES])
def test_bad_preference_chat_rows_are_one_line(k, stage, family, root, request, capsys):
    _, _, pattern = PREFERENCE_CASES[k]
    argv = [stage, "--model", str(request.getfixturevalue(family)), "--data",
            str(root / f"pref{k}.jsonl"), "--run-name", "bad", "--output-dir", str(root / "runs"),
            "--max-steps", "1", "--batch-size", "2", "--device", "cpu"]
    refused(root, argv, pattern, capsys)


def _prompt_argv(stage: str, model: Path, prompts: Path, root: Path) -> list[str]:
    if stage in ("ppo", "grpo", "rloo"):
        return [stage, "--policy", str(model), "--prompts", str(prompts), "--reward-fn",
                f"{root / 'rewards.py'}:score", "--run-name", "bad", "--output-dir",
                str(root / "runs"), "--batch-size", "2", "--samples-per-prompt",
                "1" if stage == "ppo" else "2", "--total-episodes", "2", "--max-new-tokens", "2",
                "--device", "cpu"]
    return [stage, "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "2",
            "--output", str(root / f"{stage}_out.json"), "--device", "cpu"]


@pytest.mark.parametrize("stage", ["ppo", "grpo", "rloo", "eval", "generate"])
@pytest.mark.parametrize("k", range(len(PROMPT_CASES)), ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_chat_rows_are_one_line(k, stage, root, tiny_llama_dir, capsys):
    _, _, pattern = PROMPT_CASES[k]
    refused(root, _prompt_argv(stage, tiny_llama_dir, root / f"prompt{k}.jsonl", root),
            pattern, capsys)


@pytest.mark.parametrize("k", range(len(PROMPT_CASES)), ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_chat_rows_on_gpt2(k, root, gpt2_chat_dir, capsys):
    _, _, pattern = PROMPT_CASES[k]
    refused(root, _prompt_argv("ppo", gpt2_chat_dir, root / f"prompt{k}.jsonl", root), pattern,
            capsys)


# ----------------------------------------------------------------------------- legitimate rows

def _train(stage: str, model: Path, rows: list[dict], out: Path, name: str) -> dict:
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert main([stage, "--model", str(model), "--data", str(data), "--run-name", name,
                 "--output-dir", str(out / "runs"), "--max-steps", "1", "--batch-size", "2",
                 "--device", "cpu", "--seed", "3"]) == 0
    weights = sorted((out / "runs" / name / "final").glob("*.safetensors"))
    assert weights
    return {f"{w.name}:{k}": v for w in weights for k, v in load_file(w).items()}


def _as_parts(message: dict) -> dict:
    """The message with its content split into two text parts (joined: the same string)."""
    text = message["content"]
    return dict(message, content=parts(text[:3], text[3:]))


def _render(family: str, tok, messages: list[dict], generation_prompt: bool) -> str:
    """The fixtures' templates written out by hand (the truth tether's rendering must match)."""
    if family == "gpt2_chat_dir":
        text = "".join(f"<|{m['role']}|>{m['content']}{tok.eos_token}" for m in messages)
        return text + ("<|assistant|>" if generation_prompt else "")
    text = tok.bos_token + "".join(f"<|{m['role']}|>\n{m['content']}{tok.eos_token}\n"
                                   for m in messages)
    return text + ("<|assistant|>\n" if generation_prompt else "")


U2 = {"role": "user", "content": "it was"}
ROWS = {  # two rows of one shape each; every content a string
    "sft-messages": [{"messages": [U, A]}, {"messages": [U2, B, U, A]}],
    "sft-completion": [{"prompt": [U], "completion": [A]}, {"prompt": [U2], "completion": B["content"]}],
    "rm": [{"prompt": [U], "chosen": [A], "rejected": [B]},
           {"prompt": [U2], "chosen": [U2, B], "rejected": [U2, A]}],
    "dpo": [{"chosen": [U, A], "rejected": [U, B]}, {"chosen": [U2, B], "rejected": [U2, A]}],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", list(ROWS))
def test_content_parts_train_as_the_joined_string(shape, family, request, tmp_path):
    model, stage, rows = request.getfixturevalue(family), shape.split("-")[0], ROWS[shape]
    with_parts = [{k: ([_as_parts(m) for m in v] if isinstance(v, list) else v)
                   for k, v in row.items()} for row in rows]
    assert with_parts != rows  # the content really is a list of parts
    strings = _train(stage, model, rows, tmp_path, "strings")
    from_parts = _train(stage, model, with_parts, tmp_path, "parts")
    assert strings.keys() == from_parts.keys()
    assert all(strings[k].equal(from_parts[k]) for k in strings), "parts trained other weights"


def test_content_parts_give_the_ids_of_the_hand_rendered_chat(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    row = {"messages": [_as_parts(U), _as_parts(A)]}
    ex = encode_sft(tok, [row], max_length=256)[0][0]
    # The Llama template, written out: BOS, `<|role|>\n`, content, EOS, `\n` per message; the
    # `\n` after the last reply's EOS is dropped (generation stops at EOS).
    prompt = _render("tiny_llama_dir", tok, [U], generation_prompt=True)
    reply = f"was fine.{tok.eos_token}"
    assert ex.prompt == tok(prompt, add_special_tokens=False)["input_ids"]
    assert ex.prompt + ex.responses[0] == tok(prompt + reply, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_content_parts_prompt_as_the_joined_string(family, request, tmp_path):
    model = request.getfixturevalue(family)
    rows = [{"messages": [U]}, {"prompt": [{"role": "user", "content": "it was"}]}]
    with_parts = [{k: [_as_parts(m) for m in v] for k, v in row.items()} for row in rows]
    outputs = []
    for name, prompt_rows in (("strings", rows), ("parts", with_parts)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows))
        out = tmp_path / f"{name}_samples.jsonl"
        assert main(["generate", "--model", str(model), "--prompts", str(path), "--max-new-tokens",
                     "4", "--output", str(out), "--device", "cpu", "--seed", "1"]) == 0
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outputs[0] == outputs[1]
    tok = load_tokenizer(str(model))
    assert outputs[1][0]["prompt"] == _render(family, tok, [U], generation_prompt=True)


def test_a_role_the_template_renders_is_accepted(tiny_llama_dir, tmp_path):
    # The Llama template writes any role as <|role|>: a role it renders is the user's to choose.
    tok = load_tokenizer(str(tiny_llama_dir))
    robot = {"role": "robot", "content": "the movie"}
    ex = encode_sft(tok, [{"messages": [robot, A]}], max_length=256)[0][0]
    prompt = _render("tiny_llama_dir", tok, [robot], generation_prompt=True)
    assert ex.prompt == tok(prompt, add_special_tokens=False)["input_ids"]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [robot]}) + "\n")
    assert load_prompts(str(path), tok, 256)[0] == [prompt]
    _train("sft", tiny_llama_dir, [{"messages": [robot, A]}] * 2, tmp_path, "robot")


def test_a_role_the_template_refuses_is_its_one_line(strict_dir, tmp_path, capsys):
    robot = {"role": "robot", "content": "the movie"}
    (tmp_path / "rewards.py").write_text("def score(p, r):\n    return [0.0] * len(r)\n")
    line = r"row 0: the chat template refuses these messages \(Unknown role: robot\); fix the roles"
    refused(tmp_path, ["sft", "--model", str(strict_dir), "--data",
                       str(_write(tmp_path / "sft.jsonl", {"messages": [robot, A]})),
                       "--run-name", "r", "--output-dir", str(tmp_path / "runs"),
                       "--device", "cpu"], line, capsys)
    refused(tmp_path, _prompt_argv("ppo", strict_dir, _write(tmp_path / "p.jsonl",
                                                             {"messages": [robot]}), tmp_path),
            line, capsys)
    # the roles it knows, tool included, train
    tool = {"role": "tool", "content": "it was long"}
    _train("sft", strict_dir, [{"messages": [U, tool, A]}] * 2, tmp_path, "known")


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_turns_that_nothing_learns_from_are_accepted(family, request, tmp_path):
    model = request.getfixturevalue(family)
    tok = load_tokenizer(str(model))
    # Under --loss-on last an earlier empty assistant turn is context, as is an empty system
    # message: the row trains its last turn, "was fine." and its EOS, after the rest as prompt.
    row = {"messages": [{"role": "system", "content": ""}, U, EMPTY_A, U, A]}
    ex = encode_sft(tok, [row], max_length=256, loss_on="last")[0][0]
    prompt = _render(family, tok, row["messages"][:-1], generation_prompt=True)
    ids = tok(prompt + "was fine." + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert ex.prompt == tok(prompt, add_special_tokens=False)["input_ids"]
    assert ex.prompt + ex.responses[0] == ids and ex.loss_mask is None
    data = tmp_path / "last.jsonl"
    _write(data, row)
    assert main(["sft", "--model", str(model), "--data", str(data), "--run-name", "last",
                 "--loss-on", "last", "--output-dir", str(tmp_path / "runs"), "--max-steps", "1",
                 "--batch-size", "2", "--device", "cpu"]) == 0
