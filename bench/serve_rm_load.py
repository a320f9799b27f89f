"""`tether serve-rm` under load: one client posting large batches and --small-clients posting
small ones, all at once, and the latency each sees (p50, p95), beside each client alone and beside
what one request at a time (the server before issue 48: a lock around the model) gives them.

The server is `tether serve-rm` in a process of its own (one torch thread, --batch-size B), on a
GPT-2-shaped sequence classifier built here from its config (no download); the clients are
threads of this process calling `score_remote`, the call a trainer's `--reward-url` makes.

    alone      the small requests one after another with nothing else in flight, then the large
               one alone (its time T, and T over its chunks: one chunk's time)
    together   the large client posting back to back while each small client posts --requests
               requests one after another
    burst      --burst connections opened at once, each GET /info: how many are answered (the old
               server's backlog of 5 reset 619 of 1,000)

With one request at a time a small request that arrives while a large one is scored waits for the
rest of it: T/2 on average, 0.95 T at p95 (arrivals uniform over the large request), the column
`one at a time` (an expectation from T, not a measurement: that server is gone). With turns it
waits for at most one chunk of each request ahead of it.

    python bench/serve_rm_load.py [--small-clients 4] [--requests 30] [--large-rows 256]
                                  [--small-rows 4] [--batch-size 16] [--burst 256]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tether.models.tiny import EOS, make_tokenizer
from tether.rl.reward.remote import connect, score_remote

WORDS = "the movie was good bad great dull fun plot actor scene film story music ending".split()


def build_model(root: Path, width: int, layers: int) -> Path:
    """A GPT-2 sequence classifier (one label) and its tokenizer, saved under `root`."""
    # transformers only here, after tether (tests/bench/test_bench_import_order.py)
    from transformers import AutoModelForSequenceClassification, GPT2Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    texts = [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(200)]
    tokenizer = make_tokenizer(texts, vocab_size=200)
    tokenizer.pad_token = EOS
    model = AutoModelForSequenceClassification.from_config(GPT2Config(
        vocab_size=len(tokenizer), n_layer=layers, n_embd=width, n_head=4, n_positions=512,
        num_labels=1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def rows(n: int, seed: int) -> tuple[list[str], list[str]]:
    """n (prompt, response) pairs of 8 and 16 words (about 130 tokens a row)."""
    rng = random.Random(seed)
    return ([" ".join(rng.choices(WORDS, k=8)) for _ in range(n)],
            [" " + " ".join(rng.choices(WORDS, k=16)) + "." for _ in range(n)])


def start_server(model: Path, batch_size: int, max_rows: int) -> tuple[subprocess.Popen, str]:
    """`tether serve-rm MODEL` on a free port, one torch thread; (the process, its URL)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tether", "serve-rm", str(model), "--port", "0", "--device",
         "cpu", "--threads", "1", "--batch-size", str(batch_size), "--max-rows", str(max_rows)],
        stdout=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("serving"):
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"tether serve-rm exited ({child.wait()}) before serving")
    return child, line.split(" on ")[1].split()[0]


def latencies(endpoints, pair: tuple[list[str], list[str]], count: int) -> list[float]:
    """Seconds each of `count` requests of `pair`'s rows took, one after another."""
    took = []
    for _ in range(count):
        started = time.perf_counter()
        score_remote(endpoints, *pair, timeout=600)
        took.append(time.perf_counter() - started)
    return took


def together(endpoints, large, small, clients: int, count: int) -> tuple[list[float], list[float]]:
    """The large client posting back to back while `clients` small ones post `count` each:
    (every small request's seconds, every large request's)."""
    small_took, large_took, done = [], [], threading.Event()

    def large_client():
        while not done.is_set():
            large_took.extend(latencies(endpoints, large, 1))

    def small_client():
        small_took.extend(latencies(endpoints, small, count))
    big = threading.Thread(target=large_client)
    big.start()
    time.sleep(0.05)  # the large request in flight first
    threads = [threading.Thread(target=small_client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    big.join()
    return small_took, large_took


def burst(url: str, n: int) -> int:
    """How many of `n` GET /info sent at once are answered."""
    answered, barrier = [], threading.Barrier(n)

    def one():
        barrier.wait()
        try:
            with urllib.request.urlopen(url + "/info", timeout=120) as answer:
                answered.append(answer.status == 200)
        except OSError:
            pass
    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(answered)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=30, help="per small client")
    parser.add_argument("--large-rows", type=int, default=256)
    parser.add_argument("--small-rows", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    large, small = rows(args.large_rows, 0), rows(args.small_rows, 1)
    with tempfile.TemporaryDirectory() as tmp:
        child, url = start_server(build_model(Path(tmp), args.width, args.layers),
                                  args.batch_size, max(args.large_rows, args.small_rows))
        try:
            endpoints = connect([url])
            latencies(endpoints, large, 1)  # warm-up
            small_alone = latencies(endpoints, small, args.requests)
            large_alone = latencies(endpoints, large, 3)
            small_with, large_with = together(endpoints, large, small, args.small_clients,
                                              args.requests)
            answered = burst(url, args.burst)
        finally:
            child.terminate()
            child.wait(60)
    big = sorted(large_alone)[1]  # T: the median of 3
    chunks = math.ceil(args.large_rows / args.batch_size)
    print(f"{os.cpu_count()} cores; serve-rm --batch-size {args.batch_size}, one torch thread; "
          f"1 large client ({args.large_rows} rows a request, T = {big * 1000:.0f} ms, one chunk "
          f"{big / chunks * 1000:.1f} ms), {args.small_clients} small ({args.small_rows} rows, "
          f"{args.requests} requests each)")
    print("ms                 alone p50     p95 | together p50     p95 | one at a time p50     p95")
    one_at_a_time = (percentile(small_alone, 0.5) + big / 2, percentile(small_alone, 0.95)
                     + 0.95 * big)
    for name, alone, with_others, expected in (
            ("small", small_alone, small_with, one_at_a_time),
            ("large", large_alone, large_with, (big, big))):
        figures = [percentile(alone, 0.5), percentile(alone, 0.95), percentile(with_others, 0.5),
                   percentile(with_others, 0.95), *expected]
        print(f"{name:16s}" + "".join(f"{x * 1000:8.1f}" + (" |" if i in (1, 3) else "")
                                      for i, x in enumerate(figures)))
    print(f"burst: {answered} of {args.burst} connections answered (GET /info, all at once)")


if __name__ == "__main__":
    main()
