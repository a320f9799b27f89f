"""DDP versus FSDP2 on several GPUs at 0.5B: full fine-tuning SFT and DPO under torchrun.

    bash bench/scale/gpu.sh                                   # runs this when >= 2 GPUs are visible
    torchrun --nproc-per-node 2 bench/scale/gpu_fsdp.py --tiny --device cpu   # the code path on CPU

Every rank runs the same runs in one process group: `tether.train.sft.run` and
`tether.train.dpo.run` (frozen reference copy, sharded under FSDP2), each once with DDP and once
with `fsdp=True`, on the Qwen2-style ~0.5B model of bench/scale/gpu.py (random weights, local
tokenizer, nothing downloaded), full fine-tuning in float32 weights with bf16 autocast. Printed
by rank 0, one `FSDP2:` line per stage: the peak GPU memory per rank
(torch.cuda.max_memory_allocated, the largest over ranks) of each mode and their ratio (FSDP2
shards the weights, gradients and Adam moments of the trained model and of DPO's reference, so
it should be well under DDP's), the seconds per optimizer step of each (wall time of a long run
minus a short one, over the step difference, so loading and saving cancel), and the largest
difference between the two modes' final weights (both compute the same update; bf16 autocast and
NCCL's reduction order make it differ by rounding, amplified by Adam on small gradients).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from gpu import QWEN2_05B, TINY, build_model, write_data  # noqa: E402


def _peak_gib(device: str) -> float:
    """The largest peak memory over the ranks, GiB (0 on the CPU)."""
    import torch

    from tether.run import distributed

    if not device.startswith("cuda"):
        return 0.0
    local = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    return float(distributed.all_gather_rows(local).max())


def timed_run(stage: str, cfg_fields: dict, steps: int, name: str) -> tuple[float, float, Path]:
    """(seconds, peak GiB, output dir) of one run of `stage` for `steps` optimizer steps."""
    import torch

    from tether.run import distributed
    from tether.train import dpo, sft

    module, config = {"sft": (sft, sft.SFTConfig), "dpo": (dpo, dpo.DPOConfig)}[stage]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    distributed.barrier()
    start = time.perf_counter()
    result = module.run(config(**cfg_fields, run_name=name, max_steps=steps))
    distributed.barrier()
    return time.perf_counter() - start, _peak_gib(cfg_fields["device"]), result.output_path


def max_weight_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max((ta[k].float() - tb[k].float()).abs().max().item() for k in ta)


def bench_stage(stage: str, root: Path, model_dir: Path, data: Path, args) -> str:
    from tether.run import distributed

    fields = dict(model=str(model_dir), data=str(data), output_dir=str(root / "runs"),
                  device=args.device, dtype="float32", report_to="none", save_every=0,
                  mixed_precision="bf16" if args.device.startswith("cuda") else "no",
                  batch_size=args.batch_size, lr=1e-5, max_length=args.max_length,
                  gradient_checkpointing=True, log_every=1)
    if stage == "dpo":
        fields |= dict(beta=0.1)
    result = {}
    short, long = args.steps
    for mode in ("ddp", "fsdp"):
        cfg = fields | {"fsdp": mode == "fsdp"}
        t_short, _, _ = timed_run(stage, cfg, short, f"{stage}-{mode}-short")
        t_long, peak, out = timed_run(stage, cfg, long, f"{stage}-{mode}-long")
        result[mode] = ((t_long - t_short) / (long - short), peak, out)
    # only rank 0 wrote the final models (each rank works in its own temp dir)
    diff = max_weight_difference(result["ddp"][2], result["fsdp"][2]) \
        if distributed.current().is_main else float("nan")
    (ddp_s, ddp_peak, _), (fsdp_s, fsdp_peak, _) = result["ddp"], result["fsdp"]
    ratio = f"{fsdp_peak / ddp_peak:.2f}x" if ddp_peak else "n/a on CPU"
    return (f"FSDP2: {stage} full fine-tuning, {distributed.current().world_size} ranks, global "
            f"batch {args.batch_size}: peak memory per rank DDP {ddp_peak:.2f} GiB, FSDP2 "
            f"{fsdp_peak:.2f} GiB ({ratio}); s/step DDP {ddp_s:.3f}, FSDP2 {fsdp_s:.3f} "
            f"({fsdp_s / ddp_s:.2f}x); max |w_DDP - w_FSDP2| after {long} steps {diff:.2e}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="2-layer model, small batch, CPU allowed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (rows or pairs)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--steps", type=int, nargs=2, default=[2, 6], metavar=("SHORT", "LONG"))
    args = p.parse_args(argv)
    if args.tiny:
        args.batch_size, args.max_length, args.steps = 4, 64, [1, 2]
    from tether.run import distributed

    if not distributed.launched():
        raise SystemExit("bench/scale/gpu_fsdp.py runs under torchrun --nproc-per-node N (N >= 2)")
    # every rank builds the same model and data (seeded) in its own temp dir: no shared disk needed
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, params = build_model(root, TINY if args.tiny else QWEN2_05B)
        _, pairs = write_data(root, 8 * args.batch_size, 48, 48)
        sft_rows = root / "sft.jsonl"
        sft_rows.write_text(pairs.read_text().replace('"chosen"', '"response"'))
        lines = [bench_stage(stage, root, model_dir, data, args)
                 for stage, data in (("sft", sft_rows), ("dpo", pairs))]
    if distributed.current().is_main:
        print(f"model: Qwen2-style, {params / 1e6:.2f}M parameters", flush=True)
        print("\n".join(lines), flush=True)
    distributed.teardown()


if __name__ == "__main__":
    main()
