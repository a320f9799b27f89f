"""A core install (`pip install -e .`) has no matplotlib, tensorboard or vaderSentiment: each test
runs the CLI in a fresh interpreter where they cannot be imported (as tests/rl/env/test_env_load.py
hides the environment extras). A stage that needs one says which extra installs it, in one line,
with exit code 2 and nothing written; a training stage runs to the end without any of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from offline_fixtures import sft_rows, write_jsonl

from tether.run.extras import EXTRAS, STAGE_NEEDS

SRC = str(Path(__file__).resolve().parents[1] / "src")
OPTIONAL = ("matplotlib", "tensorboard", "vaderSentiment")


def tether(argv: list[str], hidden=OPTIONAL, cwd=None) -> subprocess.CompletedProcess:
    """`tether <argv>` in a child where the `hidden` packages cannot be imported (an import, and
    importlib.util.find_spec, both see None in sys.modules and find nothing)."""
    code = ("import sys\n"
            f"for name in {tuple(hidden)!r}: sys.modules[name] = None\n"
            "from tether.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def one_error_line(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"error: {expected}"], done.stderr


def test_every_extra_named_is_one_of_pyproject():
    toml = (Path(SRC).parent / "pyproject.toml").read_text(encoding="utf-8")
    for extra in {*(e for _, e in EXTRAS.values()), *STAGE_NEEDS}:
        if extra != "sweep":  # the sweep needs the report extra; it has none of its own
            assert f"\n{extra} = [" in toml, extra
    assert all(p in EXTRAS for needs in STAGE_NEEDS.values() for p in needs)


def test_demo_names_the_demo_extra_and_writes_nothing(tmp_path):
    done = tether(["demo", "--quick", "--output-dir", str(tmp_path / "runs")], cwd=tmp_path)
    one_error_line(done, "tether demo needs the demo extra (matplotlib, vaderSentiment are not "
                         "installed): pip install -e '.[demo]'")
    assert list(tmp_path.iterdir()) == []
    # one of the two missing is enough to stop it
    done = tether(["demo", "--quick", "--output-dir", str(tmp_path / "runs")],
                  hidden=("vaderSentiment",), cwd=tmp_path)
    one_error_line(done, "tether demo needs the demo extra (vaderSentiment is not installed): "
                         "pip install -e '.[demo]'")
    assert list(tmp_path.iterdir()) == []


def test_report_names_the_report_extra_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("stage: sft\nlr: 0.001\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    before = sorted(tmp_path.rglob("*"))
    done = tether(["report", str(run), "--output", str(tmp_path / "report.html")])
    one_error_line(done, "tether report needs the report extra (matplotlib is not installed): "
                         "pip install -e '.[report]'")
    assert sorted(tmp_path.rglob("*")) == before


def test_sweep_names_the_report_extra_before_any_run(tmp_path, tiny_model_dir):
    # a grid that would train: the runs need no extra, but the page at the end does, so the
    # sweep must stop before the first run, not after the last
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": p}) + "\n" for p in ("a b", "c d")))
    (tmp_path / "rewards.py").write_text(
        "def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    fn = f"{tmp_path / 'rewards.py'}:length"
    grid = {"name": "s", "output_dir": str(tmp_path / "runs"), "seeds": [0],
            "ppo": {"policy": str(tiny_model_dir), "prompts": str(tmp_path / "prompts.jsonl"),
                    "eval_prompts": str(tmp_path / "prompts.jsonl"), "reward_fn": fn,
                    "gold_fn": fn, "batch_size": 2, "total_episodes": 2, "max_new_tokens": 3,
                    "device": "cpu", "beta": [0.0, 0.1]}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    done = tether(["sweep", "--grid", str(tmp_path / "grid.yaml")], cwd=tmp_path)
    one_error_line(done, "tether sweep needs the report extra (matplotlib is not installed): "
                         "pip install -e '.[report]'")
    assert not (tmp_path / "runs").exists()


def test_serve_rm_names_its_extra(tmp_path):
    done = tether(["serve-rm", str(tmp_path), "--port", "0"], hidden=("uvicorn",))
    one_error_line(done, "tether serve-rm needs the serve-rm extra (uvicorn is not installed): "
                         "pip install -e '.[serve-rm]'")
    assert "loading torch" not in done.stdout  # refused before torch and the model load


def test_report_to_tensorboard_without_it_names_the_extra(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(4))
    done = tether(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "t",
                   "--output-dir", str(tmp_path / "runs"), "--device", "cpu",
                   "--report-to", "tensorboard"], hidden=("tensorboard",))
    one_error_line(done, "--report-to tensorboard needs the tensorboard package, which is not "
                         "installed: pip install -e '.[tensorboard]' (or --report-to none)")
    assert not (tmp_path / "runs").exists()
    assert "loading torch" not in done.stdout  # refused before torch and the model load


@pytest.mark.slow
def test_sft_trains_to_the_end_without_any_optional_package(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(8))
    done = tether(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "t",
                   "--output-dir", str(tmp_path / "runs"), "--max-steps", "2", "--batch-size",
                   "4", "--log-every", "1", "--device", "cpu"])
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "t"
    assert (run_dir / "final" / "config.json").exists()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (run_dir / "tb").exists()  # the default, auto, found no TensorBoard
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["report_to"] == "auto"
    # the one note, at the start, says where the metrics go and how to get TensorBoard
    notes = [line for line in done.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: TensorBoard is not installed, so this run logs to metrics.jsonl only "
                     "(pip install -e '.[tensorboard]' adds TensorBoard events; --report-to none "
                     "says no tracker outright)"]
    assert done.stdout.splitlines()[1] == notes[0]  # right after the first line, before torch

