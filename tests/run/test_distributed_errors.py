"""Bad input and failures under torchrun: one line, nothing written, no hang.

The world-size checks run before the process group is joined, so they are tested in this process
with torchrun's environment variables set; an unreachable rendezvous and a rank that fails on its
own run as real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from offline_fixtures import sft_rows, write_jsonl
from torchrun_helpers import ROOT, free_port, torchrun

from tether.errors import TetherError
from tether.train import sft


def _config(tmp_path, model, **kw) -> sft.SFTConfig:
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(12))
    return sft.SFTConfig(**{"run_name": "r", "output_dir": str(tmp_path / "runs"),
                            "model": str(model), "data": str(data), "device": "cpu",
                            "max_steps": 2, "report_to": "none"} | kw)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_batch_the_world_size_does_not_divide_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TetherError, match=r"--batch-size 6 is the global batch and must be "
                                          r"divisible by the 4 ranks"):
        sft.run(_config(tmp_path, tiny_model_dir, batch_size=6))
    assert not (tmp_path / "runs").exists()


def test_fsdp_outside_torchrun_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TetherError, match="--fsdp needs several processes"):
        sft.run(_config(tmp_path, tiny_model_dir, fsdp=True))
    assert not (tmp_path / "runs").exists()


def test_a_bad_timeout_setting_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_DIST_TIMEOUT_S", "soon")
    with pytest.raises(TetherError, match="TETHER_DIST_TIMEOUT_S='soon' must be a whole number"):
        sft.run(_config(tmp_path, tiny_model_dir))


@pytest.mark.slow
def test_unreachable_ranks_give_one_line_and_exit_2(tiny_model_dir, tmp_path):
    """Rank 0 of 2 whose partner never comes: after TETHER_DIST_TIMEOUT_S one line, not c10d's
    retries with C++ stack traces, and no run directory."""
    cfg = _config(tmp_path, tiny_model_dir)
    env = os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "TETHER_DIST_TIMEOUT_S": "2", "PYTHONPATH": str(ROOT / "src"),
                        "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "tether", "sft", "--run-name", "r",
                          "--output-dir", cfg.output_dir, "--model", cfg.model, "--data", cfg.data,
                          "--device", "cpu", "--max-steps", "2", "--batch-size", "4"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert _error_lines(out.stderr) == [line for line in out.stderr.splitlines()
                                        if "cannot reach" in line]
    assert len(_error_lines(out.stderr)) == 1 and "frame #" not in out.stderr
    assert "rank 0 cannot reach the other ranks at 127.0.0.1" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [1])
def test_one_failing_rank_ends_the_job_with_its_one_line(tiny_model_dir, tmp_path, fail_rank):
    """Rank 1 fails alone in step 2 while rank 0 waits for it in a collective: the job ends soon
    after, with rank 1's line only (rank 0 is stopped by torchrun, silently)."""
    cfg = _config(tmp_path, tiny_model_dir)
    stamp = tmp_path / "failed_at"
    out = torchrun([str(ROOT / "tests" / "dist_fail.py"), "sft", "--run-name", "r",
                    "--output-dir", cfg.output_dir, "--model", cfg.model, "--data", cfg.data,
                    "--device", "cpu", "--max-steps", "4", "--batch-size", "4",
                    "--report-to", "none", "--log-every", "1"],
                   env={"FAIL_RANK": str(fail_rank), "FAIL_TIME_FILE": str(stamp)}, timeout=180)
    ended = time.time()
    assert out.returncode != 0
    assert _error_lines(out.stderr) == [f"error: rank {fail_rank} failed on its own in step 2"]
    assert ended - float(stamp.read_text()) < 30
    assert not (Path(cfg.output_dir) / "r" / "final").exists()
    # only rank 0 printed progress and wrote metrics (step 1 completed on both ranks)
    assert out.stderr.count("sft r: step 1/4") == 1
    assert (Path(cfg.output_dir) / "r" / "metrics.jsonl").read_text().count('"step": 1,') == 1
