"""What loss on every assistant turn costs at encoding time: `encode_sft` on the same multi-turn
chats with `loss_on="last"` (the prompt is everything before the last reply) and `"all"` (every
reply's token boundaries found by rendering each prefix of the chat), side by side in one process.

The tokenizer is the test suite's Llama-style one (BOS, a chat template; built here from text, no
download); the chats are `--rows` conversations of `--turns` user/assistant exchanges of 3-10
words each. The two encodings alternate over `--repeats` rounds and the medians are reported;
absolute times on a shared machine are noisy, quote the ratio (docs/benchmarks.md).

    python bench/multiturn_encoding.py [--rows 1000] [--turns 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from tether.data.encoding import encode_sft
from tether.models.pretrained import load_tokenizer
from tether.models.tiny import save_tiny_llama

WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite").split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "." for _ in range(n)]


def chats(rows: int, turns: int) -> list[dict]:
    texts = sentences(2 * rows * turns, seed=1)
    out = []
    for i in range(rows):
        messages = []
        for t in range(turns):
            k = 2 * (i * turns + t)
            messages += [{"role": "user", "content": texts[k]},
                         {"role": "assistant", "content": texts[k + 1]}]
        out.append({"messages": messages})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(str(save_tiny_llama(tmp, sentences(400, seed=0), 300)))
    rows = chats(args.rows, args.turns)
    times: dict[str, list[float]] = {"last": [], "all": []}
    for _ in range(args.repeats):
        for loss_on in ("last", "all"):
            started = time.perf_counter()
            examples, _ = encode_sft(tokenizer, rows, 4096, loss_on=loss_on)
            times[loss_on].append(time.perf_counter() - started)
    tokens = sum(len(e.prompt) + len(e.responses[0]) for e in examples) / len(examples)
    last, every = statistics.median(times["last"]), statistics.median(times["all"])
    print(f"{args.rows} chats of {args.turns} turns, {tokens:.0f} tokens each")
    print(f"loss_on=last  {last:.3f} s")
    print(f"loss_on=all   {every:.3f} s")
    print(f"all / last    {every / last:.2f}x")


if __name__ == "__main__":
    main()
