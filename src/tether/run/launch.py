"""Starting a stage: its device, its place among torchrun's ranks, and its seeds.

Checked before anything is written, identically on every rank, so a bad device, a batch that does
not split over the ranks or an unreachable peer is one line and exit 2 on every rank.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import tempfile

import numpy as np
import torch

from tether.errors import TetherError
from tether.run import distributed, parent
from tether.run.config import RunConfig


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TetherError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA). NumPy takes 0 .. 2**32 - 1 alone: another
    seed (-1, as torch and ppo take it) is reduced into that range, so it is valid in every
    stage; one in range is NumPy's seed as it was."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


TIMEOUT_ENV = "TETHER_DIST_TIMEOUT_S"  # seconds a rank waits for the others (default 600)


def join(cfg: RunConfig, global_batch: int) -> distributed.Dist:
    """Resolve `cfg.device` and join torchrun's ranks (one process: the plain `Dist`).

    Checked before anything is written, identically on every rank: the world size divides the
    global batch (`--batch-size` keeps its one-process meaning, each rank takes its slice), and a
    rank that cannot reach the others gives up after `TETHER_DIST_TIMEOUT_S` seconds. A torchrun
    rank first ties its life to torchrun's (`parent.follow_launcher`: killed with it).
    """
    if parent.under_torchrun():
        parent.follow_launcher()  # the `tether` command did it already; a Python script did not
    device = resolve_device(cfg.device)
    world = int(os.environ["WORLD_SIZE"]) if distributed.launched() else 1
    if global_batch % world:
        raise TetherError(f"--batch-size {global_batch} is the global batch and must be divisible "
                          f"by the {world} ranks (each rank takes an equal slice); use a multiple "
                          f"of {world} or another --nproc-per-node")
    timeout = os.environ.get(TIMEOUT_ENV, str(distributed.TIMEOUT_S))
    if not timeout.isdigit() or int(timeout) < 1:
        raise TetherError(f"{TIMEOUT_ENV}={timeout!r} must be a whole number of seconds >= 1")
    with _stderr_kept_on_success():
        return distributed.setup(device, cfg.fsdp, timeout_s=int(timeout))


@contextlib.contextmanager
def _stderr_kept_on_success():
    """Hold back what C++ code writes to stderr (fd 2) inside the block: replayed if the block
    succeeds, dropped if it raises. c10d logs every retry of an unreachable store with a C++
    stack trace (dozens of lines); `distributed.setup` turns the failure into one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:  # (a raise goes on from here: what was held back is dropped)
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        os.write(2, held.read())

