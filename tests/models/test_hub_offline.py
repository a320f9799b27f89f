"""A hub name on a machine that cannot reach the hub, with HF_HUB_OFFLINE unset (issue 13).

huggingface_hub retries each request with back-off (27-51 s and a page of warnings before it
gives up). tether asks the hub once, with a short timeout, and fails in one line; a name that is in
the local hub cache still loads, from the cache, without the retries.

Each test runs the CLI in a subprocess, because huggingface_hub reads HF_HUB_OFFLINE and
HF_ENDPOINT once, at import, and this suite's conftest sets HF_HUB_OFFLINE=1. The "hub" is a local
socket that accepts connections and never answers: the worst case, a network that hangs rather
than refuses, and the same on any machine, with or without internet.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from offline_fixtures import sft_rows, write_jsonl


@pytest.fixture
def silent_hub():
    """HF_ENDPOINT of a server that completes the TCP handshake and then says nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # connections wait in the backlog, never accepted, never answered
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _env(tmp_path, endpoint):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_CACHE": str(tmp_path / "hub_cache"), "PYTHONPATH": os.pathsep.join(sys.path)}
    return env


def _tether(args, env):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tether.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("what", ["model", "data"])
def test_unreachable_hub_name_fails_fast_in_one_line(what, silent_hub, tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(4))
    model, data_arg = ("nosuch/model", str(data)) if what == "model" else (str(tiny_model_dir), "nosuch/data")
    out = tmp_path / "runs"
    proc, seconds = _tether(["sft", "--model", model, "--data", data_arg, "--run-name", "r",
                             "--output-dir", str(out), "--device", "cpu"], _env(tmp_path, silent_hub))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "cannot be reached" in lines[0] and "nosuch/" in lines[0], lines
    assert not out.exists()
    # A bound on a hang, not a speed goal: the retries alone take 23 s per file, the probe 3 s.
    # Measured against the same command failing on a missing local path (same imports, no
    # network), so a loaded machine's slow start-up does not count.
    missing = str(tmp_path / "missing.jsonl")
    model, data_arg = (missing, str(data)) if what == "model" else (str(tiny_model_dir), missing)
    baseline, base_seconds = _tether(["sft", "--model", model, "--data", data_arg, "--run-name", "r",
                                      "--output-dir", str(out), "--device", "cpu"],
                                     _env(tmp_path, silent_hub))
    assert baseline.returncode == 2 and "not" in baseline.stderr, baseline.stderr
    assert seconds - base_seconds < 15, (seconds, base_seconds)


def _cache_as_hub_repo(model_dir, cache, repo_id):
    """Lay a saved model out as huggingface_hub's cache does after a download of `repo_id`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_cached_hub_name_loads_from_the_cache_without_retries(family, request, silent_hub, tmp_path):
    _cache_as_hub_repo(request.getfixturevalue(family), tmp_path / "hub_cache", "tiny/lm")
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(4))
    out = tmp_path / "runs"
    proc, _ = _tether(["sft", "--model", "tiny/lm", "--data", str(data), "--run-name", "r",
                       "--output-dir", str(out), "--max-steps", "1", "--batch-size", "2",
                       "--device", "cpu"], _env(tmp_path, silent_hub))
    assert proc.returncode == 0, proc.stderr
    assert (out / "r" / "final" / "model.safetensors").exists()
    assert "Retrying" not in proc.stderr and "thrown while requesting" not in proc.stderr
