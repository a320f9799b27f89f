"""One-GPU throughput of tether at 0.5B: PPO with LoRA in bf16, and DPO. Run through bench/scale/gpu.sh.

    bash bench/scale/gpu.sh             # ~0.5B Qwen2-style model, CUDA required, under 8 minutes
    bash bench/scale/gpu.sh --tiny      # the same code path on a 2-layer model, CPU, seconds

The model is built from its config (Qwen2Config: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151936, tied embeddings, as Qwen2-0.5B) with random weights and a
local byte-level BPE tokenizer (pad included; it fits the vocabulary, so nothing is resized),
saved to a temp dir: nothing is downloaded.

PPO: `tether.train.ppo.run` with lora_r / lora_alpha, dtype bfloat16 weights,
mixed_precision="bf16", chunked_lm_head and gradient_checkpointing as flagged, a reward model
written by `tether rm` with the same LoRA settings (one step), a separate critic (with LoRA: an
adapter + value head on the shared base). Throughput is taken from the run's own metrics.jsonl
over the batches after the first (the first pays for kernel selection and allocator warm-up):
episodes/s = batch / batch wall time; generated tokens/s = real response tokens / batch wall
time (the whole PPO batch, not just sampling). Peak memory: torch.cuda.max_memory_allocated.

DPO: `tether.train.dpo.run`, same model and LoRA/bf16 settings. pairs/s = batch / the median time
between two consecutive optimizer steps (torch's optimizer post-step hook marks each one, after a
CUDA synchronize), over the steps after the first, so model loading, the first step's warm-up and
saving fall outside every measured interval. (A difference of two runs' wall times, used before,
could come out negative on the tiny model, where a step is smaller than the noise of loading.)

Each part prints one summary line starting with `PPO:` / `DPO:`; any failure raises (the shell
script exits non-zero). Whether LoRA, the chunked head and checkpointing were really active is
observed by bench/scale/memory_probe.py and printed on the PPO line: a number for a feature the
installed tether ignores is marked NOT ACTIVE rather than passed off as that feature's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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

from memory_probe import Probe  # noqa: E402  (installs nothing until .install())

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=4096)
WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite slow fast sharp warm cold "
         "river mountain window garden kitchen teacher student doctor engine rocket planet").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_model(root: Path, sizes: dict) -> tuple[Path, int]:
    """Qwen2-style causal LM from its config + local tokenizer; returns (dir, parameters)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tether.models.pretrained import PAD_TOKEN
    from tether.models.tiny import make_tokenizer

    rng = random.Random(0)
    tokenizer = make_tokenizer([words(rng, 12) for _ in range(2000)], vocab_size=2048)
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    assert len(tokenizer) <= sizes["vocab_size"]
    config = Qwen2Config(**sizes, tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    out = root / "model"
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def write_data(root: Path, n: int, prompt_words: int, response_words: int) -> tuple[Path, Path]:
    rng = random.Random(1)
    prompts, pairs = root / "prompts.jsonl", root / "pairs.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": words(rng, prompt_words)}) + "\n"
                               for _ in range(n)))
    pairs.write_text("".join(json.dumps({"prompt": words(rng, prompt_words),
                                         "chosen": " " + words(rng, response_words),
                                         "rejected": " " + words(rng, response_words)}) + "\n"
                             for _ in range(n)))
    return prompts, pairs


def common_fields(args) -> dict:
    return dict(device=args.device, dtype=args.dtype, mixed_precision=args.mixed_precision,
                lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                gradient_checkpointing=args.gradient_checkpointing, save_every=0)


def reward_model(root: Path, model_dir: Path, pairs: Path, args) -> Path:
    from tether.train.reward import RMConfig, run

    cfg = RMConfig(run_name="rm", output_dir=str(root / "runs"), model=str(model_dir),
                   data=str(pairs), max_steps=1, batch_size=4, eval_fraction=0.0,
                   max_length=args.prompt_len + args.response_len, **common_fields(args))
    return Path(run(cfg).output_path)


def verdicts(report: dict, base_params: int, args, rows_per_minibatch: int) -> list[str]:
    out = []
    if args.lora_r:
        share = report["trainable_params"] / base_params
        out.append(f"LoRA {'active' if share < 0.5 else 'NOT ACTIVE'} "
                   f"({report['trainable_params'] / 1e6:.1f}M trainable, "
                   f"{report['base_copies']:.2f} base copies resident)")
    if args.chunked_lm_head:
        full = report["max_logit_rows"] >= rows_per_minibatch * args.response_len
        out.append(f"chunked head {'NOT ACTIVE' if full else 'active'} "
                   f"(largest LM-head output {report['max_logit_rows']} rows)")
    if args.gradient_checkpointing:
        calls = report["layer_checkpoint_calls"]
        out.append(f"checkpointing {'active' if calls else 'NOT ACTIVE'} ({calls} layer calls)")
    return out


def bench_ppo(root: Path, model_dir: Path, base_params: int, prompts: Path, pairs: Path,
              probe: Probe, args) -> str:
    import torch

    from tether.train.ppo import PPOConfig, run

    rm_dir = reward_model(root, model_dir, pairs, args)
    probe.reset(probe.vocab_size, probe.base_bytes)  # observe the PPO run only, not `tether rm`
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    cfg = PPOConfig(run_name="ppo", output_dir=str(root / "runs"), policy=str(model_dir),
                    reward_model=str(rm_dir), prompts=str(prompts), critic="separate",
                    batch_size=args.batch_size, num_minibatches=args.num_minibatches,
                    ppo_epochs=args.ppo_epochs, total_episodes=args.batch_size * args.ppo_batches,
                    max_new_tokens=args.response_len, max_prompt_len=args.prompt_len,
                    sample_every=0, lr=1e-5, chunked_lm_head=args.chunked_lm_head,
                    **common_fields(args))
    run(cfg)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda")
            else float("nan"))
    lines = [json.loads(x) for x in (root / "runs" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steady = [m for m in lines if "perf/episodes_per_s" in m][1:] or lines[-1:]
    eps = statistics.median(m["perf/episodes_per_s"] for m in steady)
    tps = statistics.median(m["perf/tokens_per_s"] for m in steady)
    resp = statistics.mean(m["rollout/response_len"] for m in steady)
    notes = verdicts(probe.report(), base_params, args, args.batch_size // args.num_minibatches)
    return (f"PPO: {eps:.2f} episodes/s, {tps:.0f} generated tokens/s, peak "
            f"{peak:.2f} GiB (max_memory_allocated), batch {args.batch_size}, mean response "
            f"{resp:.0f} tokens, median of {len(steady)} batch(es) after the first; "
            + "; ".join(notes))


def bench_dpo(root: Path, model_dir: Path, pairs: Path, args) -> str:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from tether.train.dpo import DPOConfig, run

    # One mark per optimizer step (torch's hook common to all optimizers): the gap between two
    # marks is one whole steady-state step (metrics, logging, collation, forward, backward,
    # update), with loading, the first step's warm-up and saving outside every gap.
    marks: list[float] = []

    def mark(*_):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()  # the update is queued, not done, when step() returns
        marks.append(time.perf_counter())

    cfg = DPOConfig(run_name="dpo", output_dir=str(root / "runs"), model=str(model_dir),
                    data=str(pairs), batch_size=args.batch_size, max_steps=args.dpo_steps,
                    max_length=args.prompt_len + args.response_len, lr=5e-7, log_every=1000,
                    **common_fields(args))
    handle = register_optimizer_step_post_hook(mark)
    try:
        run(cfg)
    finally:
        handle.remove()
    if len(marks) != args.dpo_steps:
        raise RuntimeError(f"DPO: {len(marks)} optimizer steps seen for {args.dpo_steps} steps")
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    seconds = statistics.median(gaps)
    return (f"DPO: {args.batch_size / seconds:.2f} pairs/s (median of {len(gaps)} steps after "
            f"the first, {seconds * 1000:.0f} ms each, batch {args.batch_size}), lora_r "
            f"{args.lora_r}, {args.dtype} weights, mixed_precision {args.mixed_precision}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="2-layer model, small batch, CPU allowed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--mixed-precision", default="bf16", choices=["bf16", "no"])
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--chunked-lm-head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   default=False)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--ppo-batches", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--dpo-steps", type=int, default=13,
                   help="DPO steps to run; pairs/s is the median over all but the first")
    p.add_argument("--parts", default="ppo,dpo", help="comma list of: ppo, dpo")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch_size, args.num_minibatches, args.ppo_epochs, args.ppo_batches = 4, 2, 1, 2
        args.prompt_len, args.response_len, args.dpo_steps = 8, 8, 4
    if args.dpo_steps < 2:
        p.error(f"--dpo-steps {args.dpo_steps}: the first step is not timed, so at least 2 "
                "are needed; pass --dpo-steps 13 or more for a steady median")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    """Run the parts; returns (and prints) one summary line per part."""
    args = parse(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/scale/gpu.py: CUDA is not available; run on a GPU machine, or pass "
                         "--tiny --device cpu to check the code path")
    sizes = TINY if args.tiny else QWEN2_05B
    parts = [x.strip() for x in args.parts.split(",")]
    lines = []
    # Before transformers is imported, so its layer checkpointing binds the counting wrapper.
    probe = Probe(0, 1).install()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            model_dir, base_params = build_model(root, sizes)
            prompts, pairs = write_data(root, 4 * args.batch_size, args.prompt_len,
                                        args.response_len // 2)
            probe.reset(sizes["vocab_size"], base_params * (2 if args.dtype == "bfloat16" else 4))
            print(f"model: Qwen2-style, {base_params / 1e6:.2f}M parameters ({sizes}), device "
                  f"{args.device}, torch {torch.__version__}", flush=True)
            if "ppo" in parts:
                lines.append(bench_ppo(root, model_dir, base_params, prompts, pairs, probe, args))
                print(lines[-1], flush=True)
            probe.remove()
            if "dpo" in parts:
                lines.append(bench_dpo(root, model_dir, pairs, args))
                print(lines[-1], flush=True)
    finally:
        probe.remove()
    return lines


if __name__ == "__main__":
    main()
