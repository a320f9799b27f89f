"""Per-token KL penalty: the textbook full log-softmax against tether's chunked log-probs.

    python bench/kernels/logprobs.py                      # B=8, T=512, V=32000, fp32, CPU
    python bench/kernels/logprobs.py --B 2 --T 64 --repeats 3   # a quick run

Both variants compute beta * (log pi(y) - log ref(y)) for sampled tokens y:
  naive:  log_softmax(logits / T_s).gather(y) for policy and reference (the division is skipped
          at T_s = 1, the most favourable form of the baseline), then beta * log_ratio.
  tether: tether.logprobs.token_logprobs for both, tether.kl.estimate(..., "k1"), then beta *.
Two modes: "forward" (no grad, how rollouts score tokens) and "backward" (forward + backward with
respect to the policy logits, how the PPO update uses them; the reference stays under no_grad).

Memory: each (variant, mode) runs in a fresh subprocess, which warms the code up on tiny inputs,
allocates the full-size inputs, resets the kernel's peak-RSS counter (writing 5 to
/proc/self/clear_refs resets VmHWM), runs the variant once and reads VmHWM from /proc/self/status.
Extra peak memory = VmHWM after the call - VmRSS before it, i.e. everything above the inputs
(including, in backward mode, the [B, T, V] gradient both variants must return). On kernels
without clear_refs it falls back to ru_maxrss, which is then only an upper bound on the baseline.
The child runs with MALLOC_MMAP_THRESHOLD_=65536, so every tensor above 64 KiB is its own mmap and
leaves RSS the moment it is freed; without it glibc raises its mmap threshold after the first
free (up to 32 MiB), 16 MiB chunks land in the heap, and the peak varied 48-112 MiB run to run.

Time: median wall time of --repeats runs in this process, variants interleaved (order alternates
each repeat) so drifting load on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from tether import kl
from tether import logprobs as logprobs_mod
from tether.logprobs import token_logprobs

MIB = 1024 * 1024


def naive_penalty(logits, ref_logits, tokens, beta, temperature):
    def logprobs(x):
        x = x if temperature == 1.0 else x / temperature
        return torch.log_softmax(x, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)

    policy = logprobs(logits)
    with torch.no_grad():
        ref = logprobs(ref_logits)
    return beta * (policy - ref)


def tether_penalty(logits, ref_logits, tokens, beta, temperature):
    policy = token_logprobs(logits, tokens, temperature)
    with torch.no_grad():
        ref = token_logprobs(ref_logits, tokens, temperature)
    return beta * kl.estimate(policy, ref, "k1")


VARIANTS = {"naive": naive_penalty, "tether": tether_penalty}


def make_inputs(batch, length, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen)  # [B, T, V]
    ref_logits = logits + 0.1 * torch.randn(batch, length, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)  # [B, T]
    return logits, ref_logits, tokens


def run_once(variant, mode, logits, ref_logits, tokens, args):
    if mode == "forward":
        with torch.no_grad():
            VARIANTS[variant](logits, ref_logits, tokens, args.beta, args.temperature)
        return
    logits.requires_grad_(True)
    penalty = VARIANTS[variant](logits, ref_logits, tokens, args.beta, args.temperature)
    penalty.sum().backward()
    logits.grad = None  # free it, so each repeat starts from the inputs alone


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_memory(args):
    """Runs in a fresh process: extra peak RSS of one (variant, mode) above its inputs, in MiB."""
    small = make_inputs(1, 4, 64)
    run_once(args.variant, args.mode, *small, args)  # warm-up: kernels, thread pools, autograd
    inputs = make_inputs(args.B, args.T, args.V)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    before_kib = _status_kib("VmRSS")
    run_once(args.variant, args.mode, *inputs, args)
    if method == "VmHWM":
        peak_kib = _status_kib("VmHWM")
    else:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": (peak_kib - before_kib) / 1024, "method": method}))


def measure_memory(variant, mode, args):
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--mode", mode,
           "--B", str(args.B), "--T", str(args.T), "--V", str(args.V),
           "--beta", str(args.beta), "--temperature", str(args.temperature),
           "--chunk-elements", str(logprobs_mod.CHUNK_ELEMENTS)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # see the module docstring
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure_time(mode, args):
    inputs = make_inputs(args.B, args.T, args.V)
    names = list(VARIANTS)
    for name in names:
        run_once(name, mode, *inputs, args)  # warm-up
    times = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            run_once(name, mode, *inputs, args)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def report(mode, args):
    memory = {name: measure_memory(name, mode, args) for name in VARIANTS}
    seconds = measure_time(mode, args)
    title = "forward, no grad" if mode == "forward" else "forward + backward wrt policy logits"
    print(f"\n### {title}\n")
    print("| variant | median time (ms) | extra peak memory (MiB) |")
    print("|---|---:|---:|")
    for name in VARIANTS:
        print(f"| {name} | {seconds[name] * 1e3:.1f} | {memory[name]['extra_mib']:.1f} |")
    mem_ratio = memory["naive"]["extra_mib"] / max(memory["tether"]["extra_mib"], 1e-3)
    speed_ratio = seconds["naive"] / seconds["tether"]
    print(f"\nmemory ratio naive/tether: {mem_ratio:.1f}x less extra memory (goal >= 8x)")
    print(f"speed ratio naive/tether: {speed_ratio:.2f}x "
          f"({'tether faster' if speed_ratio >= 1 else 'tether slower'}; goal >= 1)")
    print(f"(memory method: {memory['tether']['method']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=8, help="batch size")
    parser.add_argument("--T", type=int, default=512, help="response length")
    parser.add_argument("--V", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per variant")
    parser.add_argument("--beta", type=float, default=0.05, help="KL coefficient")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--modes", default="forward,backward", help="comma list of modes")
    parser.add_argument("--chunk-elements", type=int, default=logprobs_mod.CHUNK_ELEMENTS,
                        help="override tether.logprobs.CHUNK_ELEMENTS (for profiling)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["forward", "backward"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    logprobs_mod.CHUNK_ELEMENTS = args.chunk_elements
    if args.child:
        child_memory(args)
        return
    print(f"B={args.B} T={args.T} V={args.V} fp32 CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CHUNK_ELEMENTS={args.chunk_elements}, "
          f"temperature {args.temperature}, {args.repeats} repeats")
    print(f"inputs: 2 x {args.B * args.T * args.V * 4 / MIB:.0f} MiB of logits")
    for mode in args.modes.split(","):
        report(mode, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
