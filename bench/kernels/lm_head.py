"""Per-token log-probs from hidden states: the chunked LM head against the plain lm_head path.

    python bench/kernels/lm_head.py                                  # B=8, R=1024, d=2048, V=128256, fp32, CPU
    python bench/kernels/lm_head.py --B 2 --R 64 --d 256 --V 8192    # a quick run

Both variants compute log pi(y) of given tokens from final hidden states h [B, R, d] and take
the gradient of sum(g * log pi(y)) for a random g, as the PPO update does:
  plain:   logits = lm_head(h) ([B, R, V]), then tether.logprobs.token_logprobs(logits, y).
  chunked: tether.lm_head.head_token_logprobs(h, lm_head, y), no [B, R, V] tensor.
Two cases: "frozen" (head weight without gradient, the LoRA case: gradient to h only) and
"trainable" (gradient to h and to the head weight, full fine-tuning or tied embeddings).
lm_head is an nn.Linear(d, V, bias=False), as in Llama-style models.

Correctness first: on the first 64 positions at full d and V, values and gradients of the two
variants must agree to 1e-5 relative, or the script stops.

Memory: each (variant, case) runs in a fresh subprocess, which warms up on tiny inputs, allocates
the full-size inputs (h, y, g and the head weight), resets the kernel's peak-RSS counter (writing
5 to /proc/self/clear_refs resets VmHWM), runs forward + backward once and reads VmHWM from
/proc/self/status. Extra peak = VmHWM - VmRSS before the call: everything above the inputs and
weights, including the gradients both variants must return (dh [B, R, d]; in the trainable case
dW [V, d], 1 GiB at full size, which bounds the ratio there). On kernels without clear_refs it
falls back to ru_maxrss, an upper bound. The child runs with MALLOC_MMAP_THRESHOLD_=65536 so every
tensor above 64 KiB is its own mmap and leaves RSS when freed (see bench/kernels/logprobs.py).

Time: best of --repeats forward + backward runs in this process (no malloc setting, so the
allocator recycles chunks as in a real run), variants interleaved with alternating order so
drifting load on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn

from tether import lm_head as lm_head_mod
from tether.lm_head import head_token_logprobs
from tether.logprobs import token_logprobs

MIB = 1024 * 1024
CASES = ("frozen", "trainable")


def plain(hidden, head, tokens):
    return token_logprobs(head(hidden), tokens)


def chunked(hidden, head, tokens):
    return head_token_logprobs(hidden, head, tokens)


VARIANTS = {"plain": plain, "chunked": chunked}


def make_inputs(batch, length, d, vocab, case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, d ** -0.5, generator=gen)  # logits of O(1), as in a trained model
    head.requires_grad_(case == "trainable")
    hidden = torch.randn(batch, length, d, generator=gen).requires_grad_(True)  # [B, R, d]
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)  # [B, R]
    weights = torch.randn(batch, length, generator=gen)  # g, the upstream gradient
    return hidden, head, tokens, weights


def run_once(variant, hidden, head, tokens, weights):
    """Forward + backward; returns the values (detached). Gradients are left in .grad."""
    hidden.grad = head.weight.grad = None
    out = VARIANTS[variant](hidden, head, tokens)
    (out * weights).sum().backward()
    return out.detach()


def check_equal(args):
    """Values and gradients of both variants on the first 64 positions, full d and V."""
    for case in CASES:
        hidden, head, tokens, weights = make_inputs(1, 64, args.d, args.V, case, seed=1)
        results = {}
        for variant in VARIANTS:
            out = run_once(variant, hidden, head, tokens, weights)
            grads = [hidden.grad.clone()] + ([head.weight.grad.clone()] if case == "trainable" else [])
            results[variant] = [out, *grads]
        for a, b in zip(results["chunked"], results["plain"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    print("check: values and gradients equal (1e-5 relative) on 64 positions, both cases")


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_memory(args):
    """Runs in a fresh process: extra peak RSS of one (variant, case) above its inputs, in MiB."""
    run_once(args.variant, *make_inputs(1, 4, 8, 64, args.case))  # warm-up: kernels, autograd
    inputs = make_inputs(args.B, args.R, args.d, args.V, args.case)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    before_kib = _status_kib("VmRSS")
    run_once(args.variant, *inputs)
    peak_kib = (_status_kib("VmHWM") if method == "VmHWM"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    print(json.dumps({"extra_mib": (peak_kib - before_kib) / 1024, "method": method}))


def measure_memory(variant, case, args):
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--case", case,
           "--B", str(args.B), "--R", str(args.R), "--d", str(args.d), "--V", str(args.V),
           "--chunk-elements", str(lm_head_mod.CHUNK_ELEMENTS)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # see the module docstring
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure_time(case, args):
    inputs = make_inputs(args.B, args.R, args.d, args.V, case)
    names = list(VARIANTS)
    times = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            run_once(name, *inputs)
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def report(case, args):
    memory = {name: measure_memory(name, case, args) for name in VARIANTS}
    seconds = measure_time(case, args)
    what = "gradient to h only" if case == "frozen" else "gradients to h and W"
    print(f"\n### {case} head ({what})\n")
    print("| variant | best time (s) | extra peak memory (MiB) |")
    print("|---|---:|---:|")
    for name in VARIANTS:
        print(f"| {name} | {seconds[name]:.2f} | {memory[name]['extra_mib']:.0f} |")
    mem_ratio = memory["plain"]["extra_mib"] / max(memory["chunked"]["extra_mib"], 1e-3)
    time_ratio = seconds["chunked"] / seconds["plain"]
    print(f"\nmemory: {mem_ratio:.1f}x less extra peak memory with the chunked head (goal >= 4x)")
    print(f"time: chunked / plain = {time_ratio:.2f}x (goal <= 1.2x)")
    print(f"(memory method: {memory['chunked']['method']})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=8, help="batch size")
    parser.add_argument("--R", type=int, default=1024, help="response length")
    parser.add_argument("--d", type=int, default=2048, help="hidden size")
    parser.add_argument("--V", type=int, default=128256, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per variant (best taken)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of cases")
    parser.add_argument("--chunk-elements", type=int, default=lm_head_mod.CHUNK_ELEMENTS,
                        help="override tether.lm_head.CHUNK_ELEMENTS (logits per chunk)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lm_head_mod.CHUNK_ELEMENTS = args.chunk_elements
    torch.set_num_threads(os.cpu_count() or 1)
    if args.child:
        child_memory(args)
        return
    print(f"B={args.B} R={args.R} d={args.d} V={args.V} fp32 CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CHUNK_ELEMENTS={args.chunk_elements}, "
          f"best of {args.repeats}")
    print(f"inputs: h {args.B * args.R * args.d * 4 / MIB:.0f} MiB, W {args.V * args.d * 4 / MIB:.0f}"
          f" MiB; a full logits tensor would be {args.B * args.R * args.V * 4 / MIB:.0f} MiB")
    check_equal(args)
    for case in args.cases.split(","):
        report(case, args)


if __name__ == "__main__":
    main()
