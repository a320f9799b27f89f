"""The tanh GELU on the CPU: tether's `TanhGELU` against torch's and transformers' own, in one run.

    python bench/gelu.py                       # 1 torch thread, best of 20
    python bench/gelu.py --repeats 40 --grpo 3      # and bench/grpo.py's tether side with each

Three implementations of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))):
  tether:   tether.activations.TanhGELU (x / (1 + 2^u), what `models.fuse_gelu` swaps in)
  torch:    nn.GELU(approximate="tanh"), torch's fused kernel (what fuse_gelu swapped in before)
  hf_new:   transformers' NewGELUActivation, GPT-2's own (five elementwise kernels in Python)
timed on tensors of the GRPO bench's MLP activation (4 x width 256: [32, 1024] at one decode step
of 32 responses while sampling, [32 * 42, 1024] in a forward over 42 tokens, in fp32 and in
bfloat16 as under `--dtype bfloat16` or `--mixed-precision bf16`) and a bigger fp32 one ([4096,
3072], GPT-2 small's MLP at 4096 tokens), forward alone (no graph, as in generation and scoring)
and forward + backward (upstream gradient g random); then the bench's GPT-2 (bench/ppo.py: 4
layers, width 256, vocabulary 512) on [32, 42] tokens, one forward under no_grad and one forward
+ backward of the LM loss, with each activation swapped in. With `--grpo N`, also bench/grpo.py's
tether side (rloo and grpo, --no-trl) N times with each GELU, in CPU seconds.

Correctness first: on a grid over [-20, 20] the three must agree with a float64 evaluation of the
formula (values to 1e-6, gradients to 5e-6 absolute), and the three models' logits and parameter
gradients with each other to 1e-5, or the script stops.

Time: best of --repeats, the variants interleaved with their order rotating every repeat so that
drifting load on a shared machine hits all alike. Ratios are the other's time over tether's
(above 1: tether faster).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo import HEADS, LAYERS, VOCAB, WIDTH  # noqa: E402  (the PPO and GRPO benchmarks' model)

from tether.models import activations as tether_activations  # noqa: E402
from tether.models.activations import TanhGELU  # noqa: E402


def activations() -> dict[str, nn.Module]:
    from transformers.activations import NewGELUActivation

    return {"tether": TanhGELU(), "torch": nn.GELU(approximate="tanh"),
            "hf_new": NewGELUActivation()}


def best_times(calls: dict[str, callable], repeats: int) -> dict[str, float]:
    """Best wall time in ms of each call, interleaved, the order rotating every repeat."""
    names = list(calls)
    best = {name: float("inf") for name in names}
    for name in names:
        calls[name]()  # warm-up
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            calls[name]()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def check_tensors() -> None:
    """Each activation against the float64 formula on [-20, 20] (its gradient by autograd)."""
    grid = torch.linspace(-20.0, 20.0, 200_001, dtype=torch.float64).requires_grad_(True)
    c = (2.0 / torch.pi) ** 0.5
    truth = 0.5 * grid * (1.0 + torch.tanh(c * (grid + 0.044715 * grid**3)))
    (truth_grad,) = torch.autograd.grad(truth.sum(), grid)
    for name, act in activations().items():
        x = grid.detach().float().requires_grad_(True)
        y = act(x)
        y.sum().backward()
        value_err = (y.double() - truth).abs().max().item()
        grad_err = (x.grad.double() - truth_grad).abs().max().item()
        if not (value_err < 1e-6 and grad_err < 5e-6):
            raise SystemExit(f"check failed: {name}: value error {value_err:.2e}, "
                             f"gradient {grad_err:.2e}")
    print("check: values (1e-6) and gradients (5e-6) of all three equal the float64 formula "
          "on [-20, 20]")


def time_tensors(rows: int, width: int, repeats: int, dtype=torch.float32) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    g = torch.randn(rows, width, generator=gen).to(dtype)
    x_grad = x.clone().requires_grad_(True)
    lines = []
    for mode in ("fwd", "fwd+bwd"):
        calls = {}
        for name, act in activations().items():
            if mode == "fwd":
                calls[name] = _no_grad(lambda act=act: act(x))
            else:
                calls[name] = lambda act=act: torch.autograd.grad(act(x_grad), x_grad, g)
        kind = "" if dtype == torch.float32 else " bf16"
        lines.append(_row(f"[{rows}, {width}]{kind} {mode}", best_times(calls, repeats)))
    return lines


def _no_grad(call):
    def run():
        with torch.no_grad():
            return call()
    return run


def _row(label: str, ms: dict[str, float]) -> str:
    ours = ms["tether"]
    return (f"{label:24s} {ours:9.3f} {ms['torch']:9.3f} {ms['hf_new']:9.3f}"
            f" {ms['torch'] / ours:9.2f}x {ms['hf_new'] / ours:9.2f}x")


def bench_models(batch: int, length: int) -> dict[str, nn.Module]:
    """The GPT-2 of bench/ppo.py (NewGELUActivation), once per activation, dropout off."""
    from tether.models.tiny import make_lm

    base = make_lm(VOCAB, n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=max(128, length))
    base.eval()  # dropout off, as tether trains
    models = {}
    for name, act in activations().items():
        model = copy.deepcopy(base)
        for block in model.transformer.h:
            block.mlp.act = copy.deepcopy(act)
        models[name] = model
    return models


def model_step(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(tokens, labels=tokens)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters()]


def check_models(models: dict[str, nn.Module], tokens: torch.Tensor) -> None:
    results = {name: model_step(model, tokens) for name, model in models.items()}
    ref_logits, ref_grads = results["hf_new"]
    for name, (logits, grads) in results.items():
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=name)
        for grad, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                       msg=name)
    print("check: the three GPT-2s give the same logits and gradients (1e-5)")


def time_models(batch: int, length: int, repeats: int) -> list[str]:
    models = bench_models(batch, length)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    check_models(models, tokens)
    forward = {name: _no_grad(lambda m=m: m(tokens).logits) for name, m in models.items()}
    step = {name: (lambda m=m: model_step(m, tokens)) for name, m in models.items()}
    return [_row(f"GPT-2 [{batch}, {length}] fwd", best_times(forward, repeats)),
            _row(f"GPT-2 [{batch}, {length}] fwd+bwd", best_times(step, repeats))]


def time_grpo(repeats: int, grpo_argv: tuple[str, ...] = ("--no-trl",)) -> list[str]:
    """bench/grpo.py's tether side (its defaults: 256 episodes, batch 32, 32-token responses) with
    tether's GELU and with torch's kernel (`activations.gelu_tanh`, which TanhGELU calls, swapped
    for F.gelu), the two interleaved in alternating order; medians of CPU seconds, the steadier
    clock when shared."""
    import statistics
    import tempfile

    import grpo
    from ppo import build_workload, make_prompts

    grpo.quiet()
    args = grpo.parse_args(list(grpo_argv))
    ours = tether_activations.gelu_tanh
    gelus = {"tether": ours, "torch": lambda x: F.gelu(x, approximate="tanh")}
    cpu = {(method, side): [] for method in grpo.METHODS for side in gelus}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        workload = build_workload(root, make_prompts(512))
        for repeat in range(repeats):
            for method in grpo.METHODS:
                for side in list(gelus)[:: 1 if repeat % 2 == 0 else -1]:
                    tether_activations.gelu_tanh = gelus[side]
                    try:
                        timing, _ = grpo.run_tether(method, *workload, root, args)
                    finally:
                        tether_activations.gelu_tanh = ours
                    cpu[method, side].append(timing.cpu_seconds)
    lines = []
    for method in grpo.METHODS:
        mine, theirs = (statistics.median(cpu[method, side]) for side in gelus)
        lines.append(f"bench/grpo.py {method}: {mine:.2f} CPU-s with tether's GELU, {theirs:.2f} "
                     f"with torch's ({theirs / mine:.3f}x), median of {repeats}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0 leaves them alone")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per variant; best is kept")
    p.add_argument("--batch", type=int, default=32, help="responses in the bench's forward")
    p.add_argument("--length", type=int, default=42, help="tokens per response (prompt + response)")
    p.add_argument("--big", type=int, nargs=2, default=[4096, 3072], metavar=("ROWS", "WIDTH"),
                   help="the bigger activation tensor")
    p.add_argument("--grpo", type=int, default=0, metavar="REPEATS",
                   help="also run bench/grpo.py's tether side this many times with each GELU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_tensors()
    lines = [f"tanh GELU, {torch.get_num_threads()} thread(s), best of {args.repeats}, ms",
             f"{'':24s} {'tether':>9s} {'torch':>9s} {'hf_new':>9s} {'torch/us':>10s}"
             f" {'hf/us':>10s}"]
    lines += time_tensors(args.batch, 4 * WIDTH, args.repeats)  # one decode step while sampling
    lines += time_tensors(args.batch * args.length, 4 * WIDTH, args.repeats)
    lines += time_tensors(args.batch * args.length, 4 * WIDTH, args.repeats, torch.bfloat16)
    lines += time_tensors(*args.big, args.repeats)
    lines += time_models(args.batch, args.length, args.repeats)
    if args.grpo:
        lines += time_grpo(args.grpo)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
