"""Memory knobs: peak memory and step time of one SFT optimizer step with gradient accumulation
and gradient checkpointing, side by side in one run.

Each configuration runs tether's own step code (`micro_batches`, `sft_loss`, `backward`,
`optimizer_step`, `enable_gradient_checkpointing`) in a fresh process on a GPT-2-style model
(--layers layers, width --width, 512-token vocabulary) with a batch of --B rows of --T tokens,
the second half of each row a response. After a warm-up step (which also allocates AdamW's
state), the process's peak RSS is reset (/proc/self/clear_refs) and --steps more steps run: the
reported memory is that peak above the RSS before them (activations, gradients, scratch), the
time the best step. Ratios are against the plain step from the same run. CPU only (the peak
comes from /proc); on a GPU the activation share of memory, hence the saving, is larger.

    python bench/scale/memory_knobs.py [--B 16] [--T 512] [--layers 4] [--width 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

CONFIGS = {"plain": (1, False), "accum4": (4, False), "ckpt": (1, True), "ckpt+accum4": (4, True)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args) -> None:
    from tether.models.prepare import enable_gradient_checkpointing
    from tether.models.tiny import make_lm
    from tether.run.optim import backward, make_lr_schedule, make_optimizer, optimizer_step
    from tether.run.slicing import micro_batches
    from tether.train.sft import response_tokens, sft_loss

    torch.set_num_threads(args.threads)
    accum, checkpointing = CONFIGS[args.config]
    model = make_lm(512, n_layer=args.layers, n_embd=args.width, n_head=4, n_positions=args.T)
    model.config.use_cache = False
    model.train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    optimizer = make_optimizer(model, 1e-5)
    scheduler = make_lr_schedule(optimizer, 100, 0, "constant")
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 512, (args.B, args.T), generator=gen)
    response_mask = torch.zeros(args.B, args.T, dtype=torch.long)
    response_mask[:, args.T // 2:] = 1

    def step():
        micro = [{"input_ids": input_ids[rows], "attention_mask": torch.ones_like(input_ids[rows]),
                  "response_mask": response_mask[rows]}
                 for rows in micro_batches(list(range(args.B)), accum)]
        n_tokens = sum(response_tokens(b) for b in micro)
        for batch in micro:
            backward(sft_loss(model, batch, n_tokens)[0])
        optimizer_step(model, optimizer, scheduler, 1.0)

    step()  # warm-up: kernels, autograd, AdamW state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    print(json.dumps({"extra_mib": (_status_kib("VmHWM") - before) / 1024,
                      "step_s": min(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=16)
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--config", choices=list(CONFIGS), default="plain")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results = {}
    for name in CONFIGS:
        cmd = [sys.executable, __file__, "--child", "--config", name, "--B", str(args.B),
               "--T", str(args.T), "--layers", str(args.layers), "--width", str(args.width),
               "--steps", str(args.steps), "--threads", str(args.threads)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed blocks go back to the OS
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    base = results["plain"]
    print(f"SFT step, B={args.B} T={args.T} layers={args.layers} width={args.width}, "
          f"{args.threads} thread(s), CPU")
    print(f"{'config':<14}{'peak MiB':>10}{'x plain':>9}{'step s':>9}{'x plain':>9}")
    for name, r in results.items():
        print(f"{name:<14}{r['extra_mib']:>10.0f}{r['extra_mib'] / base['extra_mib']:>9.2f}"
              f"{r['step_s']:>9.3f}{r['step_s'] / base['step_s']:>9.2f}")


if __name__ == "__main__":
    main()
