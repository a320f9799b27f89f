"""The reward pool (--reward-workers) against one call per batch: the time to score one batch,
side by side, for rewards of four kinds.

    api        a plain function that waits --delay-ms per response (an HTTP judge: time.sleep)
    async_api  the same as `async def`, waiting with asyncio.sleep
    verifier   a plain function that computes for --delay-ms per response in pure Python, a fixed
               amount of work measured alone (it holds the GIL)
    instant    a plain function that returns at once: the pool's own cost per response

Each kind is scored through `RewardFunctions.score`, the call the training loop makes, once per
batch with no pool (today's path: one call on every row) and once with a pool of --workers
(one call per row), alternating over --repeats rounds; the medians per batch are printed with
the ratio sequential / pool (above 1: the pool is faster). The scores of both paths are checked
equal before anything is timed.

    python bench/reward_pool.py [--rows 32] [--workers 8] [--delay-ms 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from tether.rl.reward.functions import reward_from_functions
from tether.rl.reward.pool import RewardPool


def spin_count(seconds: float) -> int:
    """The loop count that takes `seconds` of pure Python on this machine, alone."""
    n, took = 100_000, 0.0
    while took < 0.05:
        n *= 2
        started, total = time.perf_counter(), 0
        for i in range(n):
            total += i
        took = time.perf_counter() - started
    return max(1, int(n * seconds / took))


def kinds(delay: float) -> dict:
    def api(prompts, responses):
        scores = []
        for r in responses:
            time.sleep(delay)
            scores.append(len(r) / 10)
        return scores

    async def async_api(prompts, responses):
        scores = []
        for r in responses:
            await asyncio.sleep(delay)
            scores.append(len(r) / 10)
        return scores

    work = spin_count(delay)

    def verifier(prompts, responses):  # a fixed amount of work, not a wall-clock wait
        scores = []
        for r in responses:
            total = 0
            for i in range(work):
                total += i
            scores.append(len(r) / 10)
        return scores

    def instant(prompts, responses):
        return [len(r) / 10 for r in responses]
    return {"api": api, "async_api": async_api, "verifier": verifier, "instant": instant}


def timed(reward, prompts: list[str], responses: list[str]) -> float:
    started = time.perf_counter()
    reward.score(prompts, responses, None, None)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prompts = [f"prompt {i}" for i in range(args.rows)]
    responses = ["word " * (i % 7 + 1) for i in range(args.rows)]
    print(f"{os.cpu_count()} cores; a batch of {args.rows} responses, {args.delay_ms:g} ms per "
          f"response; one call per batch against a pool of {args.workers}; medians of "
          f"{args.repeats}")
    pool = RewardPool(args.workers)
    for name, fn in kinds(args.delay_ms / 1000).items():
        sequential, pooled = reward_from_functions([fn]), reward_from_functions([fn], pool=pool)
        same = (sequential.score(prompts, responses, None, None).scores.tolist()
                == pooled.score(prompts, responses, None, None).scores.tolist())
        assert same, f"{name}: the pool's scores differ from the sequential call's"
        times: dict[str, list[float]] = {"sequential": [], "pool": []}
        for _ in range(args.repeats):
            times["sequential"].append(timed(sequential, prompts, responses))
            times["pool"].append(timed(pooled, prompts, responses))
        one, many = (statistics.median(times[k]) for k in ("sequential", "pool"))
        print(f"{name:9s} sequential {one * 1000:8.1f} ms/batch | pool of {args.workers} "
              f"{many * 1000:8.1f} ms/batch | sequential / pool {one / many:5.2f}x")


if __name__ == "__main__":
    main()
