"""How the suite compares numbers across processes, thread counts or recorded files (issue 49).

Every such comparison checks one of two contracts, and says which beside it:

- **the same computation** (the same thread count, dtype and device on both sides): the results
  are bit-identical, on any CPU, and the test asserts `torch.equal` / `==`. The test pins the
  settings on both sides: a child process gets this process's thread count (`same_settings_env`,
  and `pinned_threads()` for a tether command), torchrun's ranks one thread each
  (tests/torchrun_helpers.py) beside a reference run at one thread. A CPU may round a reduction
  differently with another thread count (seen on an Intel Xeon with 1 and 2 threads: 1.834007263
  against 1.834007740), so a count left to each process's default holds on one machine only.
- **a different computation** (another process layout: ranks that add their gradient halves in
  another order; another thread count; another machine): equal within a tolerance derived from
  float32 rounding (`FLOAT32_EPS`) and said at the comparison.

Such tests carry `@pytest.mark.across_processes`; CI runs them a second time with the suite at
another thread count (TETHER_TEST_THREADS, tests/conftest.py), so a test whose sides are not
pinned fails on the developers' machine too, where the default counts would agree by chance.
tests/test_process_contracts.py holds every test file that starts another process to this.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FLOAT32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: one rounding, relative


def same_settings_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that computes as this one does: this checkout's tether
    first on its path, offline, and this process's torch thread count (OMP_NUM_THREADS, which
    torch reads at start-up)."""
    return os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1",
                         "OMP_NUM_THREADS": str(torch.get_num_threads())} | extra


def pinned_threads() -> list[str]:
    """`--threads N` with this process's count: a tether command's own thread rule (auto: one
    thread for a tiny model) could otherwise choose another one than this process runs with."""
    return ["--threads", str(torch.get_num_threads())]
