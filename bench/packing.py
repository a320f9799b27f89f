"""Packed vs padded update (--pack): the forward and backward of the policy loss on one
micro-batch of responses of uneven length, side by side, reporting tokens/s and peak memory.

The batch: B rows, a prompt of 16 tokens each, response lengths drawn uniformly from 8 to 256
(seeded), in the rollout layout (left-padded prompts, right-padded responses). The step is the
update's own code: `tether.rl.scoring.update_forward` (the chunked LM head, log-probs of the
sampled tokens) then `tether.rl.update.update_loss` (the clipped surrogate over the batch's
tokens) and its backward, padded or packed; a GPT-2-shaped model built from its config.

Each variant runs in a fresh process (`python bench/packing.py --child ...`), so its peak memory
is its own: the child's `ru_maxrss` after the steps minus before them (the model and the batch
already built). ru_maxrss is the resident high-water mark the kernel keeps, torch's C++
allocations included; tracemalloc would see only Python objects, not tensor storage. On a GPU
the counterpart is torch.cuda.max_memory_allocated. Time: the median of `--repeats` steps after
one warm-up step, each child on one thread, wall clock and the process's CPU time (the steadier
figure on a shared machine); tokens/s counts real tokens (prompt + response) only, the same in
both.

    python bench/packing.py [--rows 16] [--layers 4] [--width 256] [--repeats 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401


def batch(rows: int, vocab: int, seed: int):
    import torch

    from tether.rl.rollout import Rollout

    generator = torch.Generator().manual_seed(seed)
    prompt, longest = 16, 256
    lengths = torch.randint(8, longest + 1, (rows,), generator=generator)
    ids = torch.randint(1, vocab, (rows, prompt + longest), generator=generator)
    response_mask = torch.arange(longest)[None] < lengths[:, None]  # [B, R]
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), response_mask.long()], 1)
    ids = torch.where(attention.bool(), ids, 0)
    return Rollout(ids, attention, response_mask, torch.ones(rows, dtype=torch.bool), prompt)


def child(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from tether.data.packing import pack_rows
    from tether.rl.scoring import update_forward
    from tether.rl.update import LossBatch, UpdateSpec, counts_of, update_loss

    torch.set_num_threads(1)  # one core each: CPU time is then a fair measure on a shared machine
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_layer=args.layers, n_embd=args.width,
                        n_head=max(1, args.width // 64), n_positions=512)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()  # dropout off, as in the update
    rollout = batch(args.rows, 512, seed=1)
    shape = rollout.action_mask.shape
    generator = torch.Generator().manual_seed(2)
    old = torch.where(rollout.action_mask, -5 + torch.rand(shape, generator=generator), 0.0)
    losses = LossBatch(old, old, torch.zeros(shape), torch.randn(shape, generator=generator),
                       torch.zeros(shape), rollout.action_mask, rollout.action_mask)
    spec, counts = UpdateSpec(), counts_of(losses, False)
    packed = args.child == "packed"

    def step():
        model.zero_grad(set_to_none=True)
        forward = update_forward(model, None, model, rollout, True, False, False, packed)
        loss, _ = update_loss(forward, losses, spec, 0.0, counts, False)
        loss.backward()
        return float(loss)

    measured = timed_steps(step, args.repeats)
    packing = pack_rows(rollout.attention_mask)
    slots = (packing.packed_rows * packing.packed_width if packed
             else int(rollout.attention_mask.numel()))
    return measured | {"tokens": int(rollout.attention_mask.sum()), "slots": slots}


def timed_steps(step, repeats: int) -> dict:
    """A warm-up `step()` (whose value is the loss reported; it also probes how the model packs),
    then `repeats` timed ones: their median wall and CPU seconds, and the peak resident memory
    all of them added (ru_maxrss, KiB on Linux), in MiB. bench/pair_packing.py uses it too."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu, value = [], [], step()
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu),
            "peak_mib": (peak - before) / 1024, "loss": value}


def alternated(script: str, variants: list[str], rounds: int, argv: list[str]) -> dict:
    """Each variant measured by `script --child VARIANT argv` in a fresh process, the variants
    alternated over `rounds` (a load change on the machine hits every one); per variant, its
    first result with the medians of the timings and memory. bench/pair_packing.py uses it too."""
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in runs:
            result = subprocess.run([sys.executable, script, "--child", variant, *argv],
                                    capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(result.stdout.strip().splitlines()[-1]))
    return {variant: {**results[0], **{key: statistics.median(r[key] for r in results)
                                       for key in ("seconds", "cpu_seconds", "peak_mib")}}
            for variant, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["padded", "packed"], default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    out = alternated(__file__, ["padded", "packed"], args.rounds,
                     ["--rows", str(args.rows), "--layers", str(args.layers), "--width",
                      str(args.width), "--repeats", str(args.repeats)])
    padded, packed = out["padded"], out["packed"]
    print(f"batch: {args.rows} rows, responses U(8, 256) + 16 prompt tokens; "
          f"{padded['tokens']} real tokens in {padded['slots']} padded slots "
          f"({padded['tokens'] / padded['slots']:.0%} real), {packed['slots']} packed slots "
          f"({packed['tokens'] / packed['slots']:.0%} real); GPT-2 {args.layers} layers x "
          f"{args.width}; medians of {args.rounds} alternated processes x {args.repeats} steps")
    print(f"{'':8} {'s/step':>8} {'cpu s':>8} {'tokens/s':>10} {'tok/cpu s':>10} "
          f"{'peak MiB':>9} {'loss':>10}")
    for name, r in out.items():
        print(f"{name:8} {r['seconds']:8.3f} {r['cpu_seconds']:8.3f} "
              f"{r['tokens'] / r['seconds']:10.0f} {r['tokens'] / r['cpu_seconds']:10.0f} "
              f"{r['peak_mib']:9.1f} {r['loss']:10.6f}")
    print(f"packed / padded: tokens/s x{padded['seconds'] / packed['seconds']:.2f} (wall), "
          f"x{padded['cpu_seconds'] / packed['cpu_seconds']:.2f} (CPU time), peak memory "
          f"x{packed['peak_mib'] / max(padded['peak_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
