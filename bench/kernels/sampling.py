"""Sampling cost, side by side in one process.

Two measurements, each the best of `--repeats`, alternating the order:
- `op`: per-row inverse-CDF sampling (world-size invariant) against torch.multinomial with one
  generator for the whole batch (the sampler before issue 9), the op alone on [B, V]
  probabilities (B=64 rows; V = 50257, GPT-2, and 128256, Llama 3);
- `model`: the same two rules inside `tether.rl.engines.native.sample_responses` on the tiny
  GPT-2-style test model (B=32 prompts, 32 new tokens, EOS never ends a row early), where the
  model's forward is cheap and the sampler's share is largest.

    python bench/kernels/sampling.py [--repeats 5] [--threads 1] [--parts op,model] [--op-steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from unittest import mock

import torch

from tether.rl.engines import native


def multinomial_sample(generator: torch.Generator):
    """The old rule: torch.multinomial over the batch from one generator (uniforms unused)."""
    def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return sample


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def op_bench(vocab: int, repeats: int, rows: int = 64, steps: int = 20) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1)
    uniforms = torch.rand(rows, steps, generator=gen)
    old = multinomial_sample(torch.Generator().manual_seed(1))

    def run_new():
        for t in range(steps):
            native.inverse_cdf_sample(probs, uniforms[:, t])

    def run_old():
        for t in range(steps):
            old(probs, uniforms[:, t])
    new_s, old_s = best_of(run_new, repeats), best_of(run_old, repeats)
    return new_s / steps, old_s / steps


def model_bench(repeats: int) -> tuple[float, float]:
    from tether.models.pretrained import load_causal_lm, load_tokenizer
    from tether.models.tiny import save_tiny

    texts = [f"the film was {w} and the plot was {v}" for w in ("good", "bad", "fine", "dull")
             for v in ("long", "short", "fun", "slow")]
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny(tmp, texts * 8)
        tokenizer = load_tokenizer(tmp)
        policy = load_causal_lm(tmp, tokenizer).eval()
    ids = torch.tensor([tokenizer("the film was")["input_ids"]] * 32)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=32, temperature=1.0, eos_token_ids=[-1],
                  pad_token_id=tokenizer.pad_token_id)

    def run_new():
        native.sample_responses(policy, ids, mask, generator=torch.Generator().manual_seed(0),
                                     **kwargs)

    def run_old():
        with mock.patch.object(native, "inverse_cdf_sample",
                               multinomial_sample(torch.Generator().manual_seed(0))):
            native.sample_responses(policy, ids, mask, **kwargs)
    run_new(), run_old()  # warm-up
    new_s = old_s = float("inf")
    for _ in range(repeats):
        new_s = min(new_s, best_of(run_new, 1))
        old_s = min(old_s, best_of(run_old, 1))
    return new_s, old_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="op,model")
    parser.add_argument("--op-steps", type=int, default=20,
                        help="sampling steps per timing of the op (fewer: a quick check)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    for vocab in (50257, 128256) if "op" in parts else ():
        new_s, old_s = op_bench(vocab, args.repeats, steps=args.op_steps)
        print(f"sampling op, B=64 V={vocab}: inverse-CDF {new_s * 1e3:.2f} ms/step, multinomial "
              f"{old_s * 1e3:.2f} ms/step, ratio {new_s / old_s:.2f}x")
    if "model" in parts:
        new_s, old_s = model_bench(args.repeats)
        print(f"sample_responses, tiny GPT-2, B=32 x 32 tokens: inverse-CDF {new_s * 1e3:.1f} ms, "
              f"multinomial {old_s * 1e3:.1f} ms, ratio {new_s / old_s:.2f}x")


if __name__ == "__main__":
    main()
