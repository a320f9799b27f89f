"""How many torch CPU threads a stage command should use: the same `tether grpo` and `tether sft`
runs at 1 thread and at torch's default (one per core), side by side, for GPT-2-shaped models of
several sizes built here from their configs (no download).

Each run is a fresh `python -c` process that sets the thread count and calls tether's CLI, timed
as a whole (wall clock and the child's CPU time, all its threads). The two settings alternate
over `--repeats` rounds and the medians are reported, with the ratio default / 1-thread: above 1
the single thread is faster. Absolute times on a shared machine are noisy; the ratio measured
side by side is the figure to quote (docs/benchmarks.md, "CPU threads").

    python bench/threads.py [--sizes tiny,small,base] [--repeats 3] [--stages grpo,sft]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name: (layers, width, heads); the vocabulary is the tokenizer's (~500 tokens)
SIZES = {"tiny": (2, 64, 2), "small": (4, 256, 4), "medium": (6, 512, 8), "base": (12, 768, 12)}
WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite").split()
RUN = ("import sys, torch; n = int(sys.argv[1]); n and torch.set_num_threads(n); "
       "from tether.cli import main; sys.exit(main(sys.argv[2:]))")


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def inputs(root: Path, sizes: list[str]) -> dict[str, Path]:
    """Models of each size, SFT rows, prompts and a reward function under `root`."""
    from tether.models.tiny import save_tiny

    texts = sentences(600, seed=0)
    models = {}
    for name in sizes:
        layers, width, heads = SIZES[name]
        models[name] = save_tiny(root / name, texts, 512, n_layer=layers, n_embd=width,
                                 n_head=heads)
    with open(root / "sft.jsonl", "w") as f:
        for text in sentences(64, seed=1):
            words = text.split()
            f.write(json.dumps({"prompt": " ".join(words[:3]), "response": " ".join(words[3:])})
                    + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for text in sentences(64, seed=2):
            f.write(json.dumps({"prompt": " ".join(text.split()[:3])}) + "\n")
    (root / "reward.py").write_text(
        "def score(prompts, responses):\n    return [float(r.count('good')) for r in responses]\n")
    return models


def command(stage: str, model: Path, root: Path, run: str) -> list[str]:
    common = ["--run-name", run, "--output-dir", str(root / "runs"), "--device", "cpu"]
    if stage == "sft":
        return ["sft", "--model", str(model), "--data", str(root / "sft.jsonl"), "--max-steps",
                "8", "--batch-size", "8", *common]
    return ["grpo", "--policy", str(model), "--reward-fn", f"{root / 'reward.py'}:score",
            "--prompts", str(root / "prompts.jsonl"), "--total-episodes", "48", "--batch-size",
            "16", "--samples-per-prompt", "4", "--max-new-tokens", "16", *common]


def timed(threads: int, argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one run in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", RUN, str(threads), *argv], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,medium,base")
    parser.add_argument("--stages", default="grpo,sft")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes, stages = args.sizes.split(","), args.stages.split(",")
    print(f"{os.cpu_count()} cores; 1 thread against torch's default; medians of {args.repeats}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        models = inputs(root, sizes)
        for name in sizes:
            for stage in stages:
                times: dict[int, list[tuple[float, float]]] = {1: [], 0: []}
                for i in range(args.repeats):
                    for threads in (1, 0):
                        argv = command(stage, models[name], root, f"{stage}-{name}-{threads}-{i}")
                        times[threads].append(timed(threads, argv))
                one = [statistics.median(t[k] for t in times[1]) for k in (0, 1)]
                default = [statistics.median(t[k] for t in times[0]) for k in (0, 1)]
                print(f"{name:7s} {stage:5s} 1 thread {one[0]:6.1f} s wall {one[1]:6.1f} s CPU | "
                      f"default {default[0]:6.1f} s wall {default[1]:6.1f} s CPU | "
                      f"default / 1 thread {default[0] / one[0]:.2f}x wall")


if __name__ == "__main__":
    main()
