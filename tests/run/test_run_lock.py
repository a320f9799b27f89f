"""One run directory, one writer (tether.run.lock): a second process on a directory in use stops
with one line naming the holder's pid and touches none of its files; a holder killed with
SIGKILL leaves no lock behind; under torchrun one job takes the lock once.

The holder is a real training process (tests/lock_holder.py) stopped inside step 3 while a
checkpoint is half-written, which is what the issue's `--resume` deleted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from offline_fixtures import sft_rows, write_jsonl
from torchrun_helpers import ROOT, torchrun

from tether.cli import main
from tether.errors import TetherError
from tether.run import lock
from tether.run.rundir import RunDir
from tether.train import ppo
from tether.train.ppo_config import GRPOConfig
from tether.train.sft import SFTConfig

ENV = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
IN_USE = (r"error: run directory {dir} is in use by pid {pid} \(host {host}, since "
          r"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it to finish or choose another --run-name")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _in_use(run_dir: Path, pid: int) -> str:
    return IN_USE.format(dir=re.escape(str(run_dir)), pid=pid, host=re.escape(socket.gethostname()))


def _start_holder(tmp_path: Path, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """tests/lock_holder.py ARGV; returns once it holds the run inside step 3."""
    ready = tmp_path / "holder_ready"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "lock_holder.py"), *argv],
                            env=ENV | {"READY_FILE": str(ready)} | (env or {}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the holder did not start: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _flock_is_free(directory: Path) -> bool:
    """Whether a new descriptor can take `directory`'s flock (a new open conflicts even with a
    lock of this same process)."""
    fd = os.open(directory / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def sft_run(tmp_path, tiny_llama_dir):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))
    out = tmp_path / "runs"
    argv = ["sft", "--model", str(tiny_llama_dir), "--data", str(data), "--run-name", "r",
            "--output-dir", str(out), "--max-steps", "5", "--batch-size", "4", "--save-every", "1",
            "--log-every", "1", "--device", "cpu", "--report-to", "none"]
    return argv, out / "r"


def test_sft_resume_while_the_run_trains_is_refused_then_takes_over_after_kill9(
        tmp_path, sft_run, capsys):
    argv, run_dir = sft_run
    holder = _start_holder(tmp_path, argv)
    try:
        assert (run_dir / "checkpoints" / ".tmp-step_3-holder").is_dir()  # being written
        before = _snapshot(run_dir)
        assert {"checkpoints/step_2/model.safetensors", "metrics.jsonl", ".lock"} <= set(before)
        # The issue: a --resume in another process while the run trains.
        second = subprocess.run([sys.executable, "-m", "tether", *argv, "--resume"], env=ENV,
                                capture_output=True, text=True, timeout=240)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2, second.stderr[-3000:]
        assert len(lines) == 1 and re.fullmatch(_in_use(run_dir, holder.pid), lines[0]), lines
        # Without --resume: the same line, not "already has results; pass --resume".
        capsys.readouterr()
        assert main(argv) == 2
        assert re.fullmatch(_in_use(run_dir, holder.pid), capsys.readouterr().err.strip())
        assert _snapshot(run_dir) == before  # the half-written checkpoint included
        assert holder.poll() is None  # and the holder is still running
    finally:
        _kill9(holder)
    # SIGKILL left the lock file, with its flock free: the next --resume takes it over.
    assert json.loads((run_dir / ".lock").read_text())["pid"] == holder.pid
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"removed {run_dir / 'checkpoints' / '.tmp-step_3-holder'}" in err
    assert f"resuming {run_dir} from step 2" in err
    assert (run_dir / "final").is_dir()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()  # rewritten
    assert _flock_is_free(run_dir)  # released when the run closed its directory


def test_grpo_resume_while_the_run_trains_is_refused_then_takes_over_after_kill9(
        tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie", "a film"]))
    (tmp_path / "rewards.py").write_text("def length_reward(prompts, responses):\n"
                                         "    return [len(r) / 10.0 for r in responses]\n")
    out, run_dir = tmp_path / "runs", tmp_path / "runs" / "g"
    holder = _start_holder(tmp_path, [
        "grpo", "--policy", str(tiny_model_dir), "--prompts", str(prompts), "--run-name", "g",
        "--output-dir", str(out), "--reward-fn", f"{tmp_path / 'rewards.py'}:length_reward",
        "--batch-size", "4", "--samples-per-prompt", "2", "--total-episodes", "16",
        "--max-new-tokens", "4", "--save-every", "1", "--log-every", "1", "--device", "cpu",
        "--report-to", "none"])
    cfg = GRPOConfig(policy=str(tiny_model_dir), prompts=str(prompts), run_name="g",
                     output_dir=str(out), batch_size=4, samples_per_prompt=2, total_episodes=16,
                     max_new_tokens=4, save_every=1, log_every=1, device="cpu", report_to="none",
                     reward_fn=f"{tmp_path / 'rewards.py'}:length_reward", resume=True)
    try:
        before = _snapshot(run_dir)
        assert "checkpoints/step_2/policy.safetensors" in before
        with pytest.raises(TetherError) as refused:
            ppo.run(cfg)
        assert re.fullmatch(_in_use(run_dir, holder.pid), f"error: {refused.value}")
        assert _snapshot(run_dir) == before
    finally:
        _kill9(holder)
    result = ppo.run(cfg)
    assert result.output_path == run_dir / "final" and result.output_path.is_dir()
    assert not (run_dir / "checkpoints" / ".tmp-step_3-holder").exists()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert _flock_is_free(run_dir)


@pytest.mark.slow
def test_torchrun_job_takes_the_lock_once_and_a_second_job_is_refused(tmp_path, sft_run):
    argv, run_dir = sft_run
    holder = _start_holder(tmp_path, argv)
    try:
        before = _snapshot(run_dir)
        driver = [str(ROOT / "tests" / "lock_holder.py"), *argv, "--resume"]
        # Rank 0 meets the lock as its RunDir is made (before joining); the job ends on its line.
        job = torchrun(driver, env={"HOLD": "0"}, timeout=240)
        errors = [x for x in job.stderr.splitlines() if x.startswith("error:")]
        assert job.returncode != 0 and len(errors) == 1, job.stderr[-3000:]
        assert re.fullmatch(_in_use(run_dir, holder.pid), errors[0])
        # Met where it is taken (save_config, after joining): every rank raises the same error,
        # none is left waiting in a collective (the CLI prints rank 0's line for the job).
        ranks = tmp_path / "rank_errors"
        ranks.mkdir()
        job = torchrun(driver, env={"HOLD": "0", "NO_PROBE": "1", "RANK_ERRORS": str(ranks)},
                       timeout=240)
        errors = [x for x in job.stderr.splitlines() if x.startswith("error:")]
        assert job.returncode != 0 and len(errors) == 1, job.stderr[-3000:]
        assert re.fullmatch(_in_use(run_dir, holder.pid), errors[0])
        assert sorted(p.name for p in ranks.iterdir()) == ["rank0", "rank1"]
        assert {f"error: {p.read_text()}" for p in ranks.iterdir()} == {errors[0]}
        assert _snapshot(run_dir) == before
    finally:
        _kill9(holder)
    # Two ranks, one lock: had rank 1 tried to take it too, one of the two would be refused.
    job = torchrun([str(ROOT / "tests" / "lock_holder.py"), *argv, "--resume"],
                   env={"HOLD": "0"}, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (run_dir / "final").is_dir() and _flock_is_free(run_dir)
    assert json.loads((run_dir / ".lock").read_text())["pid"] not in (holder.pid, os.getpid())


# ----------------------------------------------------------------------------- in-process units

def _config(tmp_path, **kw) -> SFTConfig:
    return SFTConfig(**{"model": "m", "data": "d", "run_name": "r",
                        "output_dir": str(tmp_path / "runs"), "report_to": "none"} | kw)


def _hold_in_subprocess(run_dir: Path) -> subprocess.Popen:
    """A process that takes `run_dir`'s lock through RunDir (a fresh run) and sleeps."""
    code = ("import sys, time; from pathlib import Path; from tether.run.rundir import RunDir; "
            "from tether.train.sft import SFTConfig; p = Path(sys.argv[1]); "
            "RunDir(p.parent, p.name).save_config(SFTConfig(model='m', data='d', run_name=p.name, "
            "output_dir=str(p.parent))); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_fresh_run_racing_into_a_directory_just_taken_is_refused_at_save_config(tmp_path):
    """Both checked `runs/r` before it existed (nothing to probe); the later one meets the lock
    where it is taken, before it deletes or writes anything."""
    racer = RunDir(tmp_path / "runs", "r")
    holder = _hold_in_subprocess(tmp_path / "runs" / "r")
    try:
        before = _snapshot(tmp_path / "runs")
        with pytest.raises(TetherError) as refused:
            racer.save_config(_config(tmp_path))
        assert re.fullmatch(_in_use(racer.path, holder.pid), f"error: {refused.value}")
        assert _snapshot(tmp_path / "runs") == before
    finally:
        _kill9(holder)
    racer.save_config(_config(tmp_path))  # the flock died with its process
    assert json.loads((racer.path / ".lock").read_text())["pid"] == os.getpid()
    racer.close()
    assert _flock_is_free(racer.path)


def test_a_stale_record_is_rewritten_and_a_live_one_not_yet_written_is_waited_for(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (run_dir / ".lock").write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(),
                                               "started": "2026-01-01 00:00:00"}))
    run = RunDir(tmp_path / "runs", "r", resume=True)  # the probe finds the flock free
    run.save_config(_config(tmp_path, resume=True))
    record = json.loads((run_dir / ".lock").read_text())
    assert record["pid"] == os.getpid() and record["started"] != "2026-01-01 00:00:00"
    run.close()
    # A holder that has the flock but has not written its record yet: no dead pid is named.
    (run_dir / ".lock").write_text("")
    fd = os.open(run_dir / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        started = time.monotonic()
        message = lock.in_use_message(run_dir, "run directory", "wait")
        assert message == f"run directory {run_dir} is in use by another process; wait"
        assert time.monotonic() - started >= lock.WAIT_S  # it read again before giving up
    finally:
        os.close(fd)


def test_a_new_run_in_the_same_process_takes_over_from_an_earlier_one(tmp_path):
    """A notebook re-running a stage after an error: the earlier RunDir (kept alive by its
    traceback) does not block it, and its late release does not free the new holder's lock."""
    earlier = RunDir(tmp_path / "runs", "r")
    earlier.save_config(_config(tmp_path))
    assert not _flock_is_free(earlier.path)
    later = RunDir(tmp_path / "runs", "r", resume=True)
    later.save_config(_config(tmp_path, resume=True))
    earlier.close()  # the earlier holder's file was handed over; closing it frees nothing
    assert not _flock_is_free(later.path)
    later.close()
    assert _flock_is_free(later.path)


def test_without_flock_support_the_run_goes_on_with_a_warning(tmp_path, monkeypatch, capsys):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    run = RunDir(tmp_path / "runs", "r")
    run.save_config(_config(tmp_path))
    assert run.config_path.is_file()
    assert capsys.readouterr().err.strip() == (
        f"warning: cannot lock {run.path} (No locks available); nothing stops a second process "
        "from writing into it at the same time")
    run.close()


def test_other_torchrun_ranks_never_probe(tmp_path, monkeypatch):
    """Rank 1 by its environment, before the group is joined: it must not touch the lock (a
    probe would hold the flock for a moment, and could make rank 0's attempt fail)."""
    held = _hold_in_subprocess(tmp_path / "runs" / "r")
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        RunDir(tmp_path / "runs", "r", resume=True)  # no error: rank 0 decides
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(TetherError, match=f"is in use by pid {held.pid} "):
            RunDir(tmp_path / "runs", "r", resume=True)
    finally:
        _kill9(held)


# ----------------------------------------------------------------------------- tether sweep

def _grid(tmp_path, model_dir) -> Path:
    import yaml

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the movie"}\n{"prompt": "a film"}\n')
    (tmp_path / "rewards.py").write_text("def length_reward(prompts, responses):\n"
                                         "    return [len(r) / 10.0 for r in responses]\n")
    spec = {"name": "s", "output_dir": str(tmp_path / "runs"), "seeds": [0],
            "ppo": {"policy": str(model_dir), "prompts": str(tmp_path / "prompts.jsonl"),
                    "reward_fn": f"{tmp_path / 'rewards.py'}:length_reward",
                    "eval_prompts": str(tmp_path / "prompts.jsonl"),
                    "gold_fn": f"{tmp_path / 'rewards.py'}:length_reward", "batch_size": 4,
                    "total_episodes": 8, "max_new_tokens": 4, "device": "cpu", "save_every": 1,
                    "report_to": "none", "beta": [0.0, 0.1]}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "grid.yaml"


def test_a_sweep_worker_on_a_run_in_use_fails_that_run_only(tmp_path, tiny_model_dir, capsys):
    from tether.tools.sweep_plan import plan

    grid = _grid(tmp_path, tiny_model_dir)
    held_run, free_run = plan(str(grid)).runs
    held_dir = Path(held_run.fields["output_dir"]) / held_run.name
    holder = _hold_in_subprocess(held_dir)
    try:
        before = _snapshot(held_dir)
        assert main(["sweep", str(grid), "--jobs", "2"]) == 1  # worker processes
        out = capsys.readouterr().out
        said = _in_use(held_dir, holder.pid).removeprefix("error: ")  # the error line, its log
        assert re.search(rf"{held_run.name} failed in \d+ s: {said} \(logs/{held_run.name}.log\)",
                         out), out
        assert (Path(free_run.fields["output_dir"]) / free_run.name / "final").is_dir()
        assert _snapshot(held_dir) == before
    finally:
        _kill9(holder)


def test_a_second_sweep_on_a_sweep_in_use_stops_at_once(tmp_path, tiny_model_dir, capsys):
    grid = _grid(tmp_path, tiny_model_dir)
    root = tmp_path / "runs" / "s"
    root.mkdir(parents=True)
    code = ("import sys, time; from tether.run import lock; "
            "lock.acquire(sys.argv[1], 'sweep directory', 'wait'); print('held', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(root)], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    try:
        before = _snapshot(root)
        capsys.readouterr()
        assert main(["sweep", str(grid)]) == 2
        err = capsys.readouterr().err.strip()
        assert re.fullmatch(rf"error: sweep directory {re.escape(str(root))} is in use by pid "
                            rf"{holder.pid} \(host .*\); wait for it to finish or give this one "
                            r"another name or --output-dir", err), err
        assert _snapshot(root) == before  # no plan/ or logs/ rewritten, no run started
    finally:
        _kill9(holder)
