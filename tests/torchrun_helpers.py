"""Launching torchrun from the tests: this worktree's sources on the ranks' path, a free port,
gloo-friendly settings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args: list[str], env: dict | None = None,
                     nproc: int = 2) -> tuple[list[str], dict]:
    """The command line and environment of `torchrun --nproc-per-node NPROC ARGS` here."""
    full_env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}",
                             "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    return cmd, full_env


def torchrun(args: list[str], timeout: float = 240, env: dict | None = None,
             nproc: int = 2) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node 2 ARGS` on this worktree's sources."""
    cmd, full_env = torchrun_command(args, env, nproc)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=ROOT)

