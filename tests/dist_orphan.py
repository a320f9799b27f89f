"""A rank for tests/run/test_launcher_death.py: it joins through `tether.run.launch.join`, as every
stage does, writes OUT/rank<R> = "<pid> <death signal>", then works until OUT/go exists, after
which rank 0 writes OUT/final/ like a finished run.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_orphan.py OUT
"""

import ctypes
import os
import sys
import time
from pathlib import Path

from tether.run import distributed
from tether.run.config import RunConfig
from tether.run.launch import join

PR_GET_PDEATHSIG = 2  # <linux/prctl.h>


def death_signal() -> int:
    """The signal the kernel sends this process when its parent dies (0: none), by prctl(2)."""
    if not sys.platform.startswith("linux"):
        return 0
    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


out = Path(sys.argv[1])
d = join(RunConfig(run_name="orphan", device="cpu"), global_batch=2)
distributed.barrier()
tmp = out / f".rank{d.rank}"
tmp.write_text(f"{os.getpid()} {death_signal()}")
os.replace(tmp, out / f"rank{d.rank}")  # whole or absent for the test's reads
while not (out / "go").exists():  # the training that a dead launcher must cut short
    time.sleep(0.05)
distributed.barrier()
if d.is_main:
    (out / "final").mkdir()
distributed.teardown()
distributed.exit_process(0)
