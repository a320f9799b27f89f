"""How often a torchrun rank that finished its work aborts on its way out.

The failure docs/scaling.md ("When a rank succeeds") describes: a gloo worker thread still
letting go of the last collective's tensors when the interpreter finalizes ends inside a C++
destructor, the rank prints "terminate called without an active exception" and exits with
SIGABRT, and torchrun fails the whole launch. It is a race, so this script launches many times,
optionally beside busy processes that load the machine (where the race was seen), and counts.

    python bench/scale/torchrun_exit.py [--mode cli] [--launches 25] [--burners 2]

Modes:
- `cli`: `torchrun --nproc-per-node 2 -m tether sft` on a tiny GPT-2 (2 steps), as users run it.
- `late-import`: a minimal script, one DDP step, an all-reduce, a barrier,
  `destroy_process_group`, then the plain interpreter exit; `torch.distributed.nn.functional`
  is first imported by DDP, after the group exists (the bug).
- `early-import`: the same with that module imported before the group, as
  `tether.distributed.setup` does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MINIMAL = """
import os, torch, torch.distributed as dist
from torch import nn
if os.environ["EARLY_IMPORT"] == "1":
    import torch.distributed.nn.functional  # noqa: F401
dist.init_process_group("gloo")
def step():
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.barrier()
step()
dist.destroy_process_group()
"""

WORDS = "the movie was good bad great fine dull fun plot actor scene story music".split()


def tiny_sft(root: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 and an SFT file, as the tests make them."""
    from tether.models.tiny import save_tiny

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "."
             for _ in range(200)]
    model = save_tiny(root / "model", texts, vocab_size=300)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": t[:10], "response": t[10:]}) + "\n"
                            for t in texts[:64]))
    return model, data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cli", "late-import", "early-import"), default="cli")
    parser.add_argument("--launches", type=int, default=25)
    parser.add_argument("--burners", type=int, default=2,
                        help="busy-looping processes beside the launches (0: an idle machine)")
    args = parser.parse_args()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                        "EARLY_IMPORT": "1" if args.mode == "early-import" else "0"}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burners)]
    aborts = failures = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            if args.mode == "cli":
                model, data = tiny_sft(root)
            else:
                (root / "minimal.py").write_text(MINIMAL)
            for i in range(args.launches):
                if args.mode == "cli":
                    command = ["-m", "tether", "sft", "--run-name", f"r{i}", "--output-dir",
                               str(root / "runs"), "--model", str(model), "--data", str(data),
                               "--device", "cpu", "--max-steps", "2", "--batch-size", "4",
                               "--report-to", "none"]
                else:
                    command = [str(root / "minimal.py")]
                out = launch(command, env)
                aborted = "terminate called without an active exception" in out.stderr
                aborts += aborted
                failures += out.returncode != 0
                if out.returncode != 0:
                    print(f"  launch {i + 1}: exit {out.returncode}"
                          f"{', a rank aborted at exit' if aborted else ''}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print(f"{args.mode}: {aborts} of {args.launches} launches had a rank abort at exit "
          f"({failures} failed in all), {args.burners} burner(s)")


if __name__ == "__main__":
    main()
