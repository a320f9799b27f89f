"""`tether demo --resume`: an interrupted demo goes on where it stopped, keeps what it finished,
and ends with the numbers an uninterrupted demo gives; a root that holds a demo is refused
without it, and with other settings than the demo was started with."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tether.cli import main
from tether.demo import pipeline
from tether.demo.config import DemoConfig
from tether.demo.resume import interrupted, record_settings, resume_command
from tether.run import interrupt

SMALL = ["--quick", "--ppo-batches", "4", "--sweep-batches", "2"]


def test_a_demo_there_is_refused_without_resume_and_with_other_settings(tmp_path, capsys):
    root = tmp_path / "demo"
    record_settings(root, DemoConfig(quick=True, ppo_batches=4, sweep_batches=2))
    assert main(["demo", *SMALL, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a demo; pass --resume to continue it" in err and "\n" not in err
    # --quick given the first time and not now: the difference is named
    assert main(["demo", "--resume", "--ppo-batches", "4", "--sweep-batches", "2",
                 "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume with other settings") and "quick: True -> False" in err
    assert "\n" not in err and not (root / "data").exists()  # nothing run
    # --jobs changes no number: not a difference (here the demo would go on; it is finished)
    (root / "report.html").write_text("a finished demo")
    assert main(["demo", "--resume", *SMALL, "--jobs", "1", "--output-dir", str(tmp_path)]) == 0
    assert "already holds a finished demo" in capsys.readouterr().err
    assert (root / "report.html").read_text() == "a finished demo"


def test_a_finished_demo_resumed_with_other_settings_is_refused_as_an_unfinished_one(tmp_path,
                                                                                      capsys):
    root = tmp_path / "demo"
    record_settings(root, DemoConfig(quick=True, ppo_batches=4, sweep_batches=2))
    (root / "report.html").write_text("a finished demo")
    for options, named in ((["--seed", "5", *SMALL], "seed: 0 -> 5"),
                           (["--ppo-batches", "4", "--sweep-batches", "2"], "quick: True -> False")):
        assert main(["demo", "--resume", *options, "--output-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --resume with other settings than the demo in {root} was "
                              f"started with ({named}); give the same options") and "\n" not in err
    assert (root / "report.html").read_text() == "a finished demo"  # nothing rewritten
    # a finished demo made before settings were recorded: nothing to run, as before
    (root / "demo.yaml").unlink()
    assert main(["demo", "--resume", "--output-dir", str(tmp_path)]) == 0
    assert "already holds a finished demo" in capsys.readouterr().err


def test_a_demo_made_before_settings_were_recorded_is_not_resumed(tmp_path, capsys):
    (tmp_path / "demo" / "sft").mkdir(parents=True)
    assert main(["demo", "--resume", "--output-dir", str(tmp_path)]) == 2
    assert "recorded no settings" in capsys.readouterr().err


def test_resume_with_no_demo_there_starts_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "_run", lambda cfg, root, *rest: root / "report.html")
    assert main(["demo", "--resume", *SMALL, "--jobs", "1", "--output-dir", str(tmp_path)]) == 0
    assert f"nothing to resume in {tmp_path / 'demo'}: starting a new demo" in (
        capsys.readouterr().out)
    assert (tmp_path / "demo" / "demo.yaml").is_file()  # its settings, for a later --resume


def test_the_interrupt_message_says_how_to_continue_the_demo():
    cfg = DemoConfig(quick=True, ppo_batches=4, sweep_betas=[0.0, 0.5], output_dir="out dir")
    assert resume_command(cfg) == ("tether demo --resume --output-dir 'out dir' --quick "
                                   "--ppo-batches 4 --sweep-betas 0 0.5")
    stage = interrupt.Interrupted("SIGTERM: stopped at step 2 with a checkpoint in x/checkpoints; "
                                  "continue with --resume", signal.SIGTERM)
    demo = interrupted(stage, cfg)
    assert str(demo) == ("SIGTERM: stopped at step 2 with a checkpoint in x/checkpoints; the "
                         "demo's finished stages are kept: continue it with: "
                         + resume_command(cfg))
    assert demo.exit_code == 128 + signal.SIGTERM
    assert interrupted(KeyboardInterrupt(), cfg).exit_code == 130


def _files(root: Path, names: list[str]) -> dict[str, tuple[int, bytes]]:
    """(mtime, bytes) of every file under root/<name>: rewritten, even identically, shows."""
    out = {}
    for name in names:
        for path in sorted([root / name] if (root / name).is_file() else
                           (root / name).rglob("*")):
            if path.is_file():
                out[str(path.relative_to(root))] = (path.stat().st_mtime_ns, path.read_bytes())
    return out


def _numbers(root: Path) -> dict[str, list]:
    """Every run's metric lines without perf/ timings (bench/demo_time.py's `numbers`), and
    every evaluation's metrics and samples."""
    out: dict[str, list] = {}
    for path in sorted(root.rglob("metrics.jsonl")):
        out[str(path.relative_to(root))] = [
            {k: v for k, v in json.loads(x).items() if not k.startswith("perf/")}
            for x in path.read_text().splitlines()]
    for path in sorted(root.rglob("eval.json")):
        record = json.loads(path.read_text())
        out[str(path.relative_to(root))] = [record["metrics"], record["samples"]]
    return out


def _interrupt_at(monkeypatch, run_name: str, step: int) -> None:
    """A Ctrl-C while PPO run `run_name` is at `step`, as the CLI's handler records one (the
    loop checks `interrupt.requested` after each step, saves a checkpoint, then stops)."""
    real_run_ppo, real_requested = pipeline.run_ppo, interrupt.requested
    state = {"armed": False, "steps": 0}

    def run_ppo(root, cfg, paths, policy, reward_model, name, seed):
        state["armed"] = f"{name}-seed{seed}" == run_name
        return real_run_ppo(root, cfg, paths, policy, reward_model, name, seed)

    def requested():
        if state["armed"]:
            state["steps"] += 1
            if state["steps"] == step:
                interrupt._received.append(signal.SIGINT)
        return real_requested()
    monkeypatch.setattr(pipeline, "run_ppo", run_ppo)
    monkeypatch.setattr(interrupt, "requested", requested)


@pytest.mark.slow
def test_an_interrupted_demo_resumes_to_the_numbers_of_one_never_stopped(tmp_path, capsys,
                                                                        monkeypatch):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["demo", *SMALL, "--jobs", "1", "--output-dir", str(whole)]) == 0
    capsys.readouterr()

    # --jobs 1 runs the stages here, longest first: dpo, ipo, ppo-no-kl, then ppo-fixed, which
    # a Ctrl-C stops at step 2 of 4 (a checkpoint every step at this size).
    _interrupt_at(monkeypatch, "ppo-fixed-seed0", step=2)
    assert main(["demo", *SMALL, "--jobs", "1", "--output-dir", str(cut)]) == 130
    err = capsys.readouterr().err
    assert ("interrupted: SIGINT: stopped at step 2 with a checkpoint in "
            f"{cut / 'demo' / 'ppo-fixed-seed0' / 'checkpoints'}; the demo's finished stages "
            "are kept: continue it with: tether demo --resume --output-dir") in err
    assert err.rstrip().endswith("--quick --ppo-batches 4 --sweep-batches 2")
    root = cut / "demo"
    assert not (root / "report.html").exists() and not (root / "ppo-fixed-seed0" / "final").exists()
    monkeypatch.undo()
    finished = ["data", "base", "sft", "rm", "dpo", "ipo", "ppo-no-kl-seed0"]
    before = _files(root, finished)

    # The rest in two worker processes (--jobs changes no number): finished stages are read
    # back, not run again; ppo-fixed goes on from its checkpoint.
    assert main(["demo", *SMALL, "--jobs", "2", "--resume", "--output-dir", str(cut)]) == 0
    out = capsys.readouterr().out
    assert "[5/11] SFT and the reward model done" in out  # 2 + dpo, ipo and ppo-no-kl
    assert "3 stages finished before, 6 stages to run" in out and "[11/11] " in out
    assert "sft: finished before; kept as it is" in out
    assert _files(root, finished) == before  # not a byte rewritten
    assert f"resuming {root / 'ppo-fixed-seed0'} from step 2" in (
        root / "logs" / "ppo-fixed-seed0.log").read_text()
    assert (root / "report.html").is_file()
    assert _numbers(root) == _numbers(whole / "demo")
    assert len(_numbers(root)) == 12  # sft, rm, dpo, ipo, 3 PPO, 2 sweep runs; 3 evaluations
