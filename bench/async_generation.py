"""Asynchronous generation against the synchronous loop: the same `tether grpo` run with
`--max-staleness 0` (the loop as it always was) and with `--max-staleness 1` (a copy of the
policy samples batch b + 1 in a second process while the trainer updates batch b), on a
GPT-2-shaped model built here from its config (no download), on CPU.

Each run is a fresh process calling tether's CLI, timed as a whole: start-up, the generator
process's start (the spawned interpreter, the copy of the model), every weight sync and the
final save are in the figure, as a user pays them. On 2 cores the settings are:

    sync, 2 threads   the synchronous loop with both cores for its one process
    sync, 1 thread    the synchronous loop on one core
    async             trainer 1 thread + generator 1 thread (the default split: half each)

The settings alternate over `--repeats` rounds; the medians are reported as seconds per episode
(a response), with the ratios sync / async: above 1 the asynchronous loop is faster. Beside the
whole run, the batches alone (the sum of each batch's time from its rollout to its metrics, from
metrics.jsonl): what a long run converges to, once start-up is paid. Absolute
times on a shared machine are noisy; the ratio measured side by side is the figure to quote
(docs/benchmarks.md, "Asynchronous generation"). On a GPU the comparison belongs in
bench/gpu.sh, where generation and training would take separate devices.

With `--reward-delay-ms D --reward-workers N` the prompts are scored by a reward that waits D ms
per response (an API judge), N calls at a time (the reward pool); sampled ahead, a batch is
then scored in the background too, while the trainer updates.

With `--task episodes` the runs are environment episodes (`--env`) of two turns instead: the
environment answers each turn after `--env-latency-ms` (a sandbox, a tool, a simulator), and
the episodes of batch b + 1, environment and all, run while batch b trains.

    python bench/async_generation.py [--size small] [--repeats 3] [--batches 8]
    python bench/async_generation.py --task episodes --env-latency-ms 200
    python bench/async_generation.py --reward-delay-ms 200 --reward-workers 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from threads import SIZES, inputs  # bench/threads.py: the same models, prompts and reward

SETTINGS = {  # name: (extra argv)
    "sync, 2 threads": ["--threads", "2"],
    "sync, 1 thread": ["--threads", "1"],
    "async": ["--max-staleness", "1", "--threads", "1", "--generator-threads", "1"],
}


# Two turns: the environment answers the first after its latency with a hint, and scores
# each turn as the reward function of the prompt runs does.
ENV = """
import time

LATENCY_S = {latency}


class Turns:
    def reset(self, row, seed):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        time.sleep(LATENCY_S)
        self.turn += 1
        return " then good", float(action.count("good")), self.turn == 2
"""


# The prompts' reward, waiting its delay per call (one response a call in the pool).
SLOW_REWARD = """
import time


def score(prompts, responses):
    time.sleep({delay} * len(responses))
    return [float(r.count("good")) for r in responses]
"""


def command(model: Path, root: Path, run: str, batches: int, batch_size: int,
            new_tokens: int, task: str, workers: int) -> list[str]:
    scored = (["--reward-fn", f"{root / 'slow_reward.py'}:score", "--reward-workers",
               str(workers)] if task == "prompts" else
              ["--env", f"{root / 'env.py'}:Turns", "--max-turns", "2", "--stop-strings", "."])
    return ["grpo", "--policy", str(model), *scored,
            "--prompts", str(root / "prompts.jsonl"), "--total-episodes",
            str(batches * batch_size), "--batch-size", str(batch_size), "--samples-per-prompt",
            "4", "--max-new-tokens", str(new_tokens), "--save-every", "0", "--run-name", run,
            "--output-dir", str(root / "runs"), "--device", "cpu"]


def timed(argv: list[str], metrics: Path) -> tuple[float, float]:
    """(wall seconds of one run in a fresh process, seconds of its batches alone: the sum of each
    batch's time from its rollout to its metrics, start-up and the final save left out)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tether", *argv], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return wall, sum(r["perf/rollout_s"] + r["perf/update_s"] for r in rows if "perf/update_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))  # threads.py's
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--task", default="prompts", choices=("prompts", "episodes"))
    parser.add_argument("--env-latency-ms", type=float, default=200.0)
    parser.add_argument("--reward-delay-ms", type=float, default=0.0)
    parser.add_argument("--reward-workers", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = inputs(root, [args.size])[args.size]
        (root / "env.py").write_text(ENV.format(latency=args.env_latency_ms / 1000))
        (root / "slow_reward.py").write_text(SLOW_REWARD.format(delay=args.reward_delay_ms / 1000))
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        loops: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for repeat in range(args.repeats):
            for i, (name, extra) in enumerate(SETTINGS.items()):
                argv = command(model, root, f"r{repeat}-{i}", args.batches, args.batch_size,
                               args.new_tokens, args.task, args.reward_workers) + extra
                wall, loop = timed(argv, root / "runs" / f"r{repeat}-{i}" / "metrics.jsonl")
                times[name].append(wall)
                loops[name].append(loop)
        episodes = args.batches * args.batch_size
        layers, width, _ = SIZES[args.size]
        what = (f"responses scored after {args.reward_delay_ms:g} ms each, "
                f"{args.reward_workers} at a time," if args.task == "prompts" else
                f"episodes of 2 turns, the environment answering after {args.env_latency_ms:g} ms,")
        print(f"tether grpo, GPT-2 {layers} x {width}, {args.batches} batches of "
              f"{args.batch_size} {what} (4 per prompt) of up to {args.new_tokens} tokens a "
              f"turn, medians of {args.repeats} (whole runs, start-up included)")
        print(f"{'setting':<18} {'s per episode':>14} {'run s':>8} {'batches s':>10} "
              f"{'s per episode, batches alone':>29}")
        medians = {name: statistics.median(t) for name, t in times.items()}
        loop = {name: statistics.median(t) for name, t in loops.items()}
        for name, median in medians.items():
            print(f"{name:<18} {median / episodes:>14.4f} {median:>8.1f} {loop[name]:>10.1f} "
                  f"{loop[name] / episodes:>29.4f}")
        for name in ("sync, 2 threads", "sync, 1 thread"):
            print(f"{name} / async: whole runs {medians[name] / medians['async']:.2f}x, "
                  f"batches alone {loop[name] / loop['async']:.2f}x")


if __name__ == "__main__":
    main()
