"""`tether tiny-model` (issue 47): every --arch builds offline, loads through the stages' own
loading code and samples with `tether generate`; --chat gives the family's chat template and
its absence none; an --output that holds anything is refused with one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from offline_fixtures import write_jsonl
from refusals import refused

from tether.cli import main
from tether.demo.tiny_model import tiny_model
from tether.models.pretrained import load_tokenizer

USER = [{"role": "user", "content": "the movie was"}]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "qwen2"])
def test_each_arch_builds_loads_and_generates(arch, tmp_path, capsys):
    assert main(["tiny-model", "--arch", arch, "--output", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == arch  # the family asked for
    assert load_tokenizer(str(tmp_path / "m")).chat_template is None  # no --chat: a base model
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the movie was"}, {"prompt": "i loved"}])
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.jsonl"),
                 "--max-new-tokens", "4", "--device", "cpu", "--output",
                 str(tmp_path / "out.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < row["length"] <= 4 for row in rows)


@pytest.mark.parametrize("arch, rendered", [
    ("qwen2", "<|im_start|>user\nthe movie was<|im_end|>\n<|im_start|>assistant\n"),
    ("llama", "<s><|user|>\nthe movie was</s>\n<|assistant|>\n"),
    ("mistral", "[INST] the movie was [/INST]")], ids=["qwen2", "llama", "mistral"])
def test_chat_gives_the_family_template(arch, rendered, tmp_path):
    out = tiny_model(tmp_path / "m", arch, chat=True)  # the Python function, as the command
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.apply_chat_template(USER, add_generation_prompt=True,
                                         tokenize=False) == rendered
    write_jsonl(tmp_path / "p.jsonl", [{"messages": USER}])
    assert main(["generate", "--model", str(out), "--prompts", str(tmp_path / "p.jsonl"),
                 "--max-new-tokens", "4", "--device", "cpu", "--output",
                 str(tmp_path / "out.jsonl")]) == 0


def test_the_command_s_chat_flag_gives_the_template(tmp_path):
    assert main(["tiny-model", "--arch", "qwen2", "--chat", "--output", str(tmp_path / "m")]) == 0
    tokenizer = load_tokenizer(str(tmp_path / "m"))
    assert tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nthe movie was<|im_end|>\n<|im_start|>assistant\n")


def test_an_output_that_holds_anything_is_refused(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    refused(tmp_path, ["tiny-model", "--arch", "llama", "--output", str(tmp_path / "m")],
            r"--output .*m exists and is not empty; tiny-model writes nothing over it", capsys)
    refused(tmp_path, ["tiny-model", "--chat", "--output", str(tmp_path / "g")],
            "--chat: GPT-2 has no chat template; pass --arch qwen2", capsys)


def test_a_build_that_fails_leaves_nothing_beside_the_output(tmp_path, monkeypatch):
    from tether.demo import tiny_model as module

    def broken(path, texts, **sizes):
        (Path(path) / "half.json").write_text("{")
        raise MemoryError("out of memory")

    monkeypatch.setitem(module.ARCHS, "llama", broken)
    with pytest.raises(MemoryError):
        tiny_model(tmp_path / "m", "llama")
    assert list(tmp_path.iterdir()) == []
