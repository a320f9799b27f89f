"""How many CPU threads torch uses for one operation (`--threads`).

torch's default is one thread per core. For small models that gains nothing and often loses:
each matrix is too small to split, the hand-offs cost more than they save, and on a machine
shared with other work the idle threads spin and compete for the cores. Measured side by side
with bench/threads.py (docs/benchmarks.md, "CPU threads"), on 2 cores: a 3M-parameter GPT-2
shape ran 1.14-1.19x slower with 2 threads than with 1 on a quiet machine; a 19M one ran 0.89x
(2 threads faster), an 85M one 0.79x; under load, 2 threads were the slower at every size
(up to 2.4x). So `--threads 0` (auto) uses 1 thread for models under `SMALL_MODEL` parameters
on the CPU, and otherwise leaves the process's count alone: torch's default, or what
OMP_NUM_THREADS, torchrun (which sets 1 per rank) or an earlier `torch.set_num_threads` chose.
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_MODEL = 10_000_000  # parameters; the crossover measured above lies between 3M and 19M

_process_threads: int | None = None  # the count before tether first changed it


def choose_threads(requested: int, parameters: int, on_cpu: bool, current: int) -> int:
    """The thread count for a run: `requested` when > 0; else (auto) 1 for a model of fewer than
    SMALL_MODEL `parameters` on the CPU, else `current` (the process's own count)."""
    if requested > 0:
        return requested
    return 1 if on_cpu and parameters < SMALL_MODEL else current


def use_threads(requested: int, model: nn.Module, device: torch.device | str) -> int:
    """Set torch's intra-op thread count for the stage about to run `model` on `device` (by
    `choose_threads`) and return it. Auto starts from the count the process had before tether
    first set one, so one stage's choice does not become the next stage's default."""
    global _process_threads
    if _process_threads is None:
        _process_threads = torch.get_num_threads()
    parameters = sum(p.numel() for p in model.parameters())
    threads = choose_threads(requested, parameters, torch.device(device).type == "cpu",
                             _process_threads)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
