"""bench/engine.py and bench/gpu.sh with vLLM, as docs/benchmarks.md runs them: a fresh process
from the repository root, in a venv built as docs/engine.md says (torch's CPU build, then the
vllm extra), whose vLLM CPU build pulls a torchvision built for CUDA torch. What the process
imports first is what is tested here: bench/engine.py once imported transformers before tether
and failed at import ("'torchvision' is not a package"), so the figure docs/benchmarks.md quotes
could not be reproduced by its own command.

Needs vLLM (`pip install -e '.[vllm]'`); CI runs this file in its vLLM venv with empty vLLM and
inductor caches and TETHER_REQUIRE_VLLM=1, so there it fails instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("TETHER_REQUIRE_VLLM"):
        raise RuntimeError("TETHER_REQUIRE_VLLM is set but vllm is not installed: "
                           "pip install -e '.[vllm]'")
    pytest.skip("vllm is not installed (pip install -e '.[vllm]')", allow_module_level=True)

from smoke import line_starting, row, run  # noqa: E402

# bench/gpu.sh runs `python bench/engine.py` from the repository root with GPU settings; with
# `--device cpu` and tiny flags after them (later flags win) it runs here, and one run covers
# both scripts: the vLLM venv's import of vLLM is the slowest part of either.
SMOKES = {"bench/engine.py": "test_gpu_sh_runs_engine_py_on_the_cpu",
          "bench/gpu.sh": "test_gpu_sh_runs_engine_py_on_the_cpu"}
ROLLOUT = "GPT-2 4x256 fp32 (GRPO)       8 x 4  "


@pytest.mark.slow
def test_gpu_sh_runs_engine_py_on_the_cpu(tmp_path):
    """The venv checks and the device line of bench/gpu.sh, then bench/engine.py's rollouts
    (native and vLLM: tokens/s, tokens per row, the ratio; vLLM's start-up and weight sync)
    and a GRPO run on each engine; TRL's side skipped with a line where TRL is absent."""
    out = run("bash", "bench/gpu.sh", "--device", "cpu", "--dtype", "float32", "--threads", "1",
              "--skip-large", "--repeats", "1", "--batch-size", "8", "--response-length", "4",
              "--episodes", "8", "--kv-cache-mb", "256",
              env={"VENV": sys.prefix, "OUT": str(tmp_path)}, timeout=600)
    assert out.startswith("CPU (--device cpu) | torch ")
    assert (tmp_path / "engine-gpu.txt").read_text() == out  # the log it keeps
    assert row(out, ROLLOUT + "native", 3)[2] == 1.0
    tokens_s, per_row, ratio = row(out, ROLLOUT + "vllm", 3)
    assert tokens_s > 0 and 0 < per_row <= 4 and ratio > 0
    assert "(vLLM start-up " in out and ", weight sync median " in out
    assert line_starting(out, "side ").split()[:4] == ["side", "wall", "s", "ep/s"]
    native, vllm = row(out, "tether native"), row(out, "tether vllm")
    assert native[2] == 1.0 and vllm[2] > 0  # wall-clock ratio to native
    assert 0 < vllm[-1] <= 4 and 0 < native[-1] <= 4  # mean response length
    assert "skipped: tether vllm" not in out
    if importlib.util.find_spec("trl") is None:
        assert ("skipped: TRL GRPOTrainer, use_vllm=False and True: `import trl` failed"
                in out)
