"""Where `tether eval`, `generate` and `report` write (`--output`), issue 23.

Refused, with one `error:` line, exit 2, before any model loads and with nothing on disk changed:
an existing directory, a path under a file, one of the command's inputs (the prompts file, a
reward function's file, any file inside a model directory eval or generate reads (issue 32), a
file of a run directory report reads). Accepted, and checked against the command's own
in-process result: a missing parent (created), an earlier output (replaced whole), eval's default
file beside its model, report's inside a run directory (report.html). The rules are tether.tools.outputs'; docs/errors.md lists the messages.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from pages import fake_run
from refusals import refused, snapshot

from tether.cli import main
from tether.tools import evaluate, generate, outputs
from tether.tools.config import EvalConfig, GenerateConfig

PROMPTS = ["the movie was", "it", "the plot and", "music"]
SAMPLING = ["--device", "cpu", "--max-new-tokens", "4", "--batch-size", "2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """Models (copies: nothing here may touch the session's), prompts, a reward file, a run."""
    base = tmp_path_factory.mktemp("outputs")
    shutil.copytree(tiny_model_dir, base / "gpt2")
    shutil.copytree(tiny_llama_dir, base / "llama")
    (base / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (base / "reward.py").write_text("def score(prompts, responses):\n"
                                    "    return [len(r) / 10 for r in responses]\n")
    (base / "raises.py").write_text("def score(prompts, responses):\n"
                                    "    raise ValueError('no score today')\n")
    (base / "a_dir").mkdir()
    fake_run(base, "run", {"model": "gpt2", "lr": 1e-3},
             [{"step": s, "train/loss": 3.0 / s} for s in (1, 2)])
    (base / "run" / "final").mkdir()
    (base / "run" / "final" / "model.safetensors").write_bytes(b"weights")
    return base


@pytest.fixture
def no_model_loads(monkeypatch):
    """A refusal must come before any tokenizer or model is read."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before --output was checked")
    for module in (evaluate, generate):
        monkeypatch.setattr(module, "load_tokenizer", loaded)
    monkeypatch.setattr(evaluate, "load_frozen_lm", loaded)  # both load policies by load_policy


def _eval(model, output, *extra):
    return ["eval", "--model", model, "--prompts", "prompts.jsonl", *SAMPLING,
            "--output", output, *extra]


def _generate(model, output, *extra):
    return ["generate", "--model", model, "--prompts", "prompts.jsonl", *SAMPLING,
            "--output", output, *extra]


def _report(output):
    return ["report", "run", "--output", output]


BAD = [  # (argv, pattern the one line must match); paths relative to `root`
    (_eval("gpt2", "a_dir"), r"--output \S*a_dir is a directory; name a file, e\.g\. "
                             r"--output \S*a_dir/eval\.json"),
    (_generate("gpt2", "a_dir"), r"a_dir is a directory; .*a_dir/generations\.jsonl"),
    (_report("a_dir"), r"a_dir is a directory; .*a_dir/report\.html"),
    (_generate("gpt2", "prompts.jsonl"), r"prompts\.jsonl is the --prompts file this command "
                                         r"reads; writing it would destroy it"),
    (_eval("gpt2", "prompts.jsonl"), r"is the --prompts file this command reads"),
    (_eval("gpt2", "reward.py", "--reward-fn", "reward.py:score"), r"is the --reward-fn file"),
    (_eval("gpt2", "reward.py", "--gold-fn", "reward.py:score"), r"is the --gold-fn file"),
    # A model directory the command reads gets no file at all (issue 32), new or not.
    (_eval("gpt2", "gpt2/config.json"), r"--output \S*gpt2/config\.json is inside --model "
                                        r"\S*gpt2, which this command reads; it never writes "
                                        r"into a model or data directory it reads: write the "
                                        r"output beside it, e\.g\. --output \S*/gpt2\.eval\.json"),
    (_eval("gpt2", "gpt2/model.safetensors"), r"is inside --model \S*gpt2, which"),
    (_eval("gpt2", "gpt2/eval.json"), r"is inside --model \S*gpt2, which"),  # a new file too
    (_generate("gpt2", "gpt2/tokenizer.json"), r"is inside --model \S*gpt2, which"),
    (_generate("gpt2", "gpt2/new.jsonl"), r"is inside --model \S*gpt2, which this command "
                                          r"reads; .* --output \S*/gpt2\.generations\.jsonl"),
    (_eval("llama", "llama/tokenizer_config.json"), r"is inside --model \S*llama, which"),
    (_generate("llama", "llama/config.json"), r"is inside --model \S*llama, which"),
    (_eval("gpt2", "llama/config.json", "--reference", "llama"),
     r"is inside --reference \S*llama, which"),
    (_eval("gpt2", "llama/new.json", "--reference", "llama"),
     r"is inside --reference \S*llama, which"),
    (_report("run/config.yaml"), r"would replace config\.yaml of run directory \S*run, which"),
    (_report("run/metrics.jsonl"), r"would replace metrics\.jsonl of run directory"),
    (_report("run/final/model.safetensors"), r"would replace model\.safetensors of run directory"),
    (_eval("gpt2", "prompts.jsonl/e.json"), r"prompts\.jsonl is a file, not a directory"),
    (_generate("gpt2", "prompts.jsonl/sub/g.jsonl"), r"prompts\.jsonl is a file, not a directory"),
    (_report("prompts.jsonl/r.html"), r"prompts\.jsonl is a file, not a directory"),
]


@pytest.mark.parametrize("argv, pattern", BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD])
def test_bad_output_is_one_line_and_nothing_changes(argv, pattern, root, monkeypatch, capsys,
                                                    no_model_loads):
    monkeypatch.chdir(root)
    refused(root, argv, pattern, capsys)


def test_an_unwritable_directory_is_refused_before_the_model(root, tmp_path, monkeypatch, capsys,
                                                            no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: deny it the way the permission bits would
        real = outputs.os.access
        monkeypatch.setattr(outputs.os, "access",
                            lambda path, mode: False if path == locked else real(path, mode))
    monkeypatch.chdir(root)
    assert main(_eval("gpt2", str(locked / "e.json"))) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --output {locked / 'e.json'}: cannot write in {locked} (permission "
                   "denied); choose a writable --output")
    assert not list(locked.iterdir())


def _eval_cfg(root, **overrides):
    values = dict(model=str(root / "gpt2"), prompts=str(root / "prompts.jsonl"), device="cpu",
                  max_new_tokens=4, batch_size=2) | overrides
    return EvalConfig(**values)


def test_missing_parents_are_created_and_hold_the_commands_results(root, tmp_path, monkeypatch):
    monkeypatch.chdir(root)
    assert main(_eval("gpt2", str(tmp_path / "new" / "sub" / "e.json"), "--seed", "4")) == 0
    written = json.loads((tmp_path / "new" / "sub" / "e.json").read_text())
    # the same evaluation in process, not written: the file holds exactly its numbers
    assert written["metrics"] == evaluate.run(_eval_cfg(root, seed=4), write=False).metrics
    assert main(_generate("gpt2", str(tmp_path / "gen" / "g.jsonl"), "--seed", "4")) == 0
    rows = [json.loads(x) for x in (tmp_path / "gen" / "g.jsonl").read_text().splitlines()]
    cfg = GenerateConfig(model=str(root / "gpt2"), prompts=str(root / "prompts.jsonl"),
                         device="cpu", max_new_tokens=4, batch_size=2, seed=4)
    assert rows == generate.generate(cfg)
    assert main(_report(str(tmp_path / "pages" / "r.html"))) == 0
    assert "train/ metrics" in (tmp_path / "pages" / "r.html").read_text()


def test_an_earlier_output_is_replaced_whole(root, tmp_path, monkeypatch):
    # An explicit --output that names an earlier result of the command is replaced, as users of
    # `-o` expect; the write goes through a temp file, so no half-written file and no temp file
    # is ever left, and a run that fails leaves the earlier file as it was.
    monkeypatch.chdir(root)
    out = tmp_path / "e.json"
    assert main(_eval("gpt2", str(out), "--seed", "1")) == 0
    assert main(_eval("gpt2", str(out), "--seed", "2")) == 0
    second = json.loads(out.read_text())
    assert second["config"]["seed"] == 2
    assert second["metrics"] == evaluate.run(_eval_cfg(root, seed=2), write=False).metrics
    assert second["metrics"] != evaluate.run(_eval_cfg(root, seed=1), write=False).metrics
    assert [p.name for p in tmp_path.iterdir()] == ["e.json"]
    kept = out.read_bytes()
    assert main(_eval("gpt2", str(out), "--reward-fn", "raises.py:score")) == 2
    assert out.read_bytes() == kept


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_the_default_file_beside_a_model_or_in_a_run_may_be_replaced(model, root, monkeypatch):
    # <model>.eval.json beside the model is eval's default place (issue 32: never inside it): a
    # second eval replaces it, and the model directory is byte for byte as it was. Likewise
    # report.html inside a run directory.
    monkeypatch.chdir(root)
    before = {k: v for k, v in snapshot(root).items() if k.startswith(f"{model}/")}
    for seed in ("1", "2"):
        assert main(["eval", "--model", model, "--prompts", "prompts.jsonl", *SAMPLING,
                     "--seed", seed]) == 0
    assert json.loads((root / f"{model}.eval.json").read_text())["config"]["seed"] == 2
    (root / f"{model}.eval.json").unlink()
    assert {k: v for k, v in snapshot(root).items() if k.startswith(f"{model}/")} == before
    for _ in range(2):
        assert main(_report("run/report.html")) == 0
    assert "train/ metrics" in (root / "run" / "report.html").read_text()
    (root / "run" / "report.html").unlink()
