"""Sampling cost, side by side in one process.

Three measurements, each the best (and median) of `--repeats`, alternating the order:
- `op`: per-row inverse-CDF sampling (world-size invariant) against torch.multinomial with one
  generator for the whole batch (the sampler before issue 9), the op alone on [B, V]
  probabilities (B=64 rows; V = 50257, GPT-2, and 128256, Llama 3);
- `model`: the same two rules inside `tether.rollout.sample_responses` on the tiny GPT-2-style
  test model (B=32 prompts, 32 new tokens, EOS never ends a row early), where the model's forward
  is cheap and the sampler's share is largest;
- `decode`: `sample_responses` with its lean decoder (`tether.decode.LeanDecoder`, each distinct
  prompt prefilled once) against the model's forward at every step (`lean=False`, the path
  before), per rollout batch, on the GRPO benchmark's policy shape (GPT-2 style, 4 layers x 256
  wide x 4 heads, vocabulary 513, fused GELU, eval mode) and a Llama-style model of the same size
  (rotary, 2 key/value heads): 32 rows, left-padded prompts of 7-10 tokens, 32 new tokens (EOS
  never ends a row early, so both paths do the same work), as 8 prompts x 4 samples (GRPO/RLOO)
  and as 32 distinct prompts. The samples are checked equal before timing.
- `step`: where one lean decode step's time goes (GPT-2 shape, B = 32, column 10 to 26, the
  step repeated in place): the whole step, the step without attention, the weight matmuls and LM
  head alone, the GELUs alone;
- `loop` (not in the default parts: ~10 s per run): whole `tether rloo` and `tether grpo` runs on
  bench/grpo.py's workload (tether's side, 256 episodes), with the lean sampler and with
  `lean=False`, interleaved; CPU seconds per run, medians of `--repeats`.

    python bench/sampling.py [--repeats 5] [--threads 1] [--parts op,model,decode,step,loop]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from statistics import median
from unittest import mock

import torch

from tether.rl import rollout as rollout_lib
from tether.rl.engines.lean import LeanDecoder
from tether.rl.engines.native import prefill


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
            rollout_lib.inverse_cdf_sample(probs, uniforms[:, t])

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
        rollout_lib.sample_responses(policy, ids, mask, generator=torch.Generator().manual_seed(0),
                                     **kwargs)

    def run_old():
        with mock.patch.object(rollout_lib, "inverse_cdf_sample",
                               multinomial_sample(torch.Generator().manual_seed(0))):
            rollout_lib.sample_responses(policy, ids, mask, **kwargs)
    run_new(), run_old()  # warm-up
    new_s = old_s = float("inf")
    for _ in range(repeats):
        new_s = min(new_s, best_of(run_new, 1))
        old_s = min(old_s, best_of(run_old, 1))
    return new_s, old_s


def decode_models() -> dict:
    """The GRPO benchmark's policy shape, GPT-2 and Llama style (random weights)."""
    from tether.models.prepare import fuse_gelu
    from tether.models.tiny import make_llama_lm, make_lm

    gpt2 = fuse_gelu(make_lm(513, n_layer=4, n_embd=256, n_head=4, n_positions=128))
    llama = make_llama_lm(513, bos_token_id=1, eos_token_id=2, n_layer=4, hidden_size=256,
                          n_head=4, n_kv_head=2)
    return {"gpt2": gpt2.eval(), "llama": llama.eval()}


def decode_prompts(distinct: int, samples: int, pad: int = 512):
    """`distinct` prompts of 7-10 random tokens, each `samples` times in a row, left-padded."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, pad, (7 + i % 4,), generator=gen).tolist() for i in range(distinct)]
    rows = [row for row in rows for _ in range(samples)]
    return rollout_lib.left_pad(rows, pad, "cpu")


def decode_bench(model, distinct: int, samples: int, repeats: int) -> tuple[list, list]:
    """CPU seconds per rollout batch: (lean, model forward), `repeats` each, interleaved."""
    ids, mask = decode_prompts(distinct, samples)
    kwargs = dict(max_new_tokens=32, temperature=1.0, eos_token_ids=[-1], pad_token_id=512,
                  uniforms=rollout_lib.sampling_uniforms(0, len(ids), 32))
    lean = rollout_lib.sample_responses(model, ids, mask, **kwargs)
    forward = rollout_lib.sample_responses(model, ids, mask, lean=False, **kwargs)
    assert lean.input_ids.equal(forward.input_ids), "the lean decoder sampled other tokens"
    times: tuple[list, list] = ([], [])
    for _ in range(repeats):
        for flag, out in zip((True, False), times, strict=True):
            start = time.process_time()
            rollout_lib.sample_responses(model, ids, mask, lean=flag, **kwargs)
            out.append(time.process_time() - start)
    return times


class NoAttention(LeanDecoder):
    """A lean step with the attention (cache write and SDPA) left out: its cost by difference."""

    def _attend(self, index, query, key, value, scaling):
        return query.reshape(query.shape[0], 1, -1)


def step_bench(repeats: int, steps: int = 16) -> dict[str, list[float]]:
    """CPU ms per decode step of each part, interleaved `repeats` times."""
    model = decode_models()["gpt2"]
    ids, mask = decode_prompts(32, 1)
    positions = rollout_lib.position_ids_from_mask(mask)
    with torch.no_grad():
        _, cache = prefill(model, ids, mask, positions, dedupe=False)
    lean = LeanDecoder.build(model, cache, mask, positions[:, -1:] + 1, 32)
    bare = NoAttention(model, "gpt2", lean.keys, lean.values, lean.mask, lean.length,
                       lean.next_position)
    token, alive = torch.full((32,), 5), torch.ones(32, dtype=torch.bool)
    hidden, inner = torch.randn(32, 1, 256), torch.randn(32, 1, 1024)
    blocks, width = model.transformer.h, ids.shape[1]

    def decode(decoder):
        decoder.length, decoder.next_position = width, positions[:, -1:] + 1
        for _ in range(steps):
            decoder.step(token, alive)

    def matmuls():
        for _ in range(steps):
            for block in blocks:
                block.attn.c_attn(hidden), block.attn.c_proj(hidden)
                block.mlp.c_proj(block.mlp.c_fc(hidden))
            model.lm_head(hidden)

    def gelus():
        for _ in range(steps):
            for block in blocks:
                block.mlp.act(inner)
    parts = {"lean step": lambda: decode(lean), "step without attention": lambda: decode(bare),
             "weight matmuls + LM head": matmuls, "GELU": gelus}
    times: dict[str, list[float]] = {name: [] for name in parts}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in parts.items():
                start = time.process_time()
                fn()
                times[name].append((time.process_time() - start) / steps * 1e3)
    return times


def timed_sampler(sample, lean: bool, calls: list[float]):
    """`sample` with `lean` set, appending each call's CPU seconds to `calls`."""
    def sample_responses(*args, **kwargs):
        start = time.process_time()
        out = sample(*args, lean=lean, **kwargs)
        calls.append(time.process_time() - start)
        return out
    return sample_responses


def loop_bench(repeats: int) -> tuple[dict, dict]:
    """CPU seconds of whole rloo and grpo runs (bench/grpo.py, tether's side) and of each of
    their `sample_responses` calls, keyed by (method, lean)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import grpo
    from ppo import build_workload, make_prompts

    import tether.train.ppo as loop

    args = grpo.parse_args(["--no-trl"])
    grpo.quiet()
    sample = loop.sample_responses
    runs: dict[tuple[str, bool], list[float]] = {}
    calls: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, rm_dir, prompts_file = build_workload(root, make_prompts(512))
        try:
            for rep in range(repeats):
                for method in grpo.METHODS:
                    for lean in (True, False) if rep % 2 == 0 else (False, True):
                        loop.sample_responses = timed_sampler(
                            sample, lean, calls.setdefault((method, lean), []))
                        timing, _ = grpo.run_tether(method, policy_dir, rm_dir, prompts_file,
                                                    root, args)
                        runs.setdefault((method, lean), []).append(timing.cpu_seconds)
        finally:
            loop.sample_responses = sample
    return runs, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="op,model,decode,step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    if "decode" in parts:
        print("sample_responses per rollout batch (B=32, 32 new tokens), CPU ms, best / median of "
              f"{args.repeats}: lean decoder vs model forward each step")
        for name, model in decode_models().items():
            for distinct, samples in ((8, 4), (32, 1)):
                lean, forward = decode_bench(model, distinct, samples, args.repeats)
                best, mid = min(lean) / min(forward), median(lean) / median(forward)
                print(f"  {name:5s} {distinct:2d} prompts x {samples}: lean {min(lean) * 1e3:6.1f} / "
                      f"{median(lean) * 1e3:6.1f} ms, forward {min(forward) * 1e3:6.1f} / "
                      f"{median(forward) * 1e3:6.1f} ms, ratio {best:.2f}x / {mid:.2f}x")
    for vocab in (50257, 128256) if "op" in parts else ():
        new_s, old_s = op_bench(vocab, args.repeats)
        print(f"sampling op, B=64 V={vocab}: inverse-CDF {new_s * 1e3:.2f} ms/step, multinomial "
              f"{old_s * 1e3:.2f} ms/step, ratio {new_s / old_s:.2f}x")
    if "model" in parts:
        new_s, old_s = model_bench(args.repeats)
        print(f"sample_responses, tiny GPT-2, B=32 x 32 tokens: inverse-CDF {new_s * 1e3:.1f} ms, "
              f"multinomial {old_s * 1e3:.1f} ms, ratio {new_s / old_s:.2f}x")
    if "step" in parts:
        print(f"one lean decode step (GPT-2 shape, B=32), CPU ms, best / median of {args.repeats}:")
        for name, times in step_bench(args.repeats).items():
            print(f"  {name:26s} {min(times):.2f} / {median(times):.2f}")
    if "loop" in parts:
        runs, calls = loop_bench(args.repeats)
        for method in ("rloo", "grpo"):
            lean, forward = calls[(method, True)], calls[(method, False)]
            print(f"tether {method}: sample_responses in the loop, CPU ms per batch, median of "
                  f"{len(lean)}: lean {median(lean) * 1e3:.1f}, forward "
                  f"{median(forward) * 1e3:.1f}, ratio {median(lean) / median(forward):.2f}x")
            lean, forward = runs[(method, True)], runs[(method, False)]
            each = {name: " ".join(f"{t:.2f}" for t in sorted(times))
                    for name, times in (("lean", lean), ("forward", forward))}
            print(f"tether {method}, bench/grpo.py workload, CPU-s per run, median of "
                  f"{args.repeats}: lean {median(lean):.2f} ({each['lean']}), forward "
                  f"{median(forward):.2f} ({each['forward']}), ratio "
                  f"{median(lean) / median(forward):.3f}x")


if __name__ == "__main__":
    main()
