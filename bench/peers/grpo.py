"""Critic-free throughput: tether's `rloo` and `grpo` against TRL 1.16's `RLOOTrainer` and
`GRPOTrainer`, side by side in one process.

One workload for all four runs, the PPO benchmark's (bench/peers/ppo.py builds the models and prompts):
a GPT-2-style policy (4 layers, width 256, ~512-token BPE vocabulary) and a reward model of the
same size, 32 responses per batch = 8 prompts x k = 4 samples, responses of up to 32 tokens
sampled at temperature 1 with top-k 0 / top-p 1, stop at EOS, one optimizer step per batch
(1 epoch / iteration, 1 minibatch, no gradient accumulation), 256 episodes (8 batches), AdamW at
lr 1e-5 with linear decay, gradient norm clipped at 1, dropout off, fp32 on the CPU, no gradient
checkpointing. Method settings, each library configured to match tether's where it has options:

- RLOO: KL in the reward, k1 summed over the response, beta 0.05 (both defaults); leave-one-out
  baseline; no advantage whitening (TRL's `normalize_advantages=False`, its default).
- GRPO: KL in the loss, beta 0.04 (tether's GRPO default; TRL's default is 0, no reference at
  all, so it is set), k3 times the ratio pi/pi_old (tether's default; TRL's
  `use_bias_correction_kl=True`), group std scaling, token-mean loss over the batch (tether's
  GRPO default; TRL's `loss_type="dapo"`, its default).

Differences that stay (they change the numbers, not the work): TRL's RLOO clips one ratio per
sequence and averages per-sequence losses, tether clips per token and averages over tokens; TRL's
reward model re-tokenises the decoded text (tether scores the policy's token ids); tether
writes its final model, TRL saves nothing. Both take the old policy's log-probs for GRPO from
the update's own forward (one step per batch); for RLOO TRL runs a separate old-policy forward,
tether does not (tether.rl.update.one_pass). Responses stop at EOS on both sides, so the bench prints
the mean response length and generated tokens/s beside episodes/s.

Each run is timed from construction to the end of training, in wall-clock time and in the
process's CPU time (time.process_time, all threads: the steadier of the two on a shared machine,
where a run may get a fraction of a core). Runs interleave (tether, TRL, TRL, tether, ... per
method) and the medians of `--repeats` runs are reported.

    .venv-trl/bin/python bench/peers/grpo.py [--repeats 3] [--two-pass] [--unshared]
        [--prompt-words 4-10] [--threads 1]

Needs TRL 1.16.0 (RLOOTrainer and GRPOTrainer), in a venv of its own: the `bench` extra pins
1.12.0 for the PPO, DPO and memory benchmarks (docs/benchmarks.md says how to make it).
`--no-trl` runs tether's side alone (the smoke test does, with tiny settings); `--two-pass` adds
a third side, tether with its two-pass path (a separate old-policy forward, as without
`tether.rl.update.one_pass`), to measure what the one-forward step saves; `--unshared` one more, tether with
every prompt run once per row (no `tether.models.forward` prompt sharing, in sampling and scoring), to
measure what running each distinct prompt once saves; `--profile` profiles one more tether run
per method and prints its matmul time beside this machine's matmul peak. `--prompt-words LO-HI`
sets the prompts' length (default 4-10 words, about as many tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo import build_workload, make_prompts  # noqa: E402  (the PPO benchmark's workload)

TRL_VERSION = "1.16.0"
METHODS = ("rloo", "grpo")
K = 4  # samples per prompt


@dataclass
class Timing:
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time of this process, all its threads (time.process_time)
    response_len: float  # mean generated tokens per episode, EOS included


def tether_config(method: str, policy_dir: Path, rm_dir: Path, prompts_file: Path, root: Path,
                  args):
    """tether's `rloo` / `grpo` config for the workload; every field not set keeps the method's
    default (RLOOConfig, GRPOConfig)."""
    from tether.train.ppo_config import GRPOConfig, RLOOConfig

    config_class = {"rloo": RLOOConfig, "grpo": GRPOConfig}[method]
    return config_class(
        run_name=f"{method}-{time.time_ns()}", output_dir=str(root / "runs"),
        policy=str(policy_dir), reward_model=str(rm_dir), prompts=str(prompts_file),
        samples_per_prompt=K, batch_size=args.batch_size, total_episodes=args.episodes,
        max_new_tokens=args.response_length, num_minibatches=1, lr=1e-5, lr_schedule="linear",
        temperature=1.0, kl_ctl="fixed", max_grad_norm=1.0, device=args.device, save_every=0,
        sample_every=0, log_every=1, report_to="none")  # metrics.jsonl only; TRL reports to none


def run_tether(method: str, policy_dir: Path, rm_dir: Path, prompts_file: Path, root: Path,
               args, two_pass: bool = False, unshared: bool = False
               ) -> tuple[Timing, list[dict]]:
    import tether.models.forward as shared_prompt
    import tether.rl.update as update
    import tether.train.ppo as loop

    cfg = tether_config(method, policy_dir, rm_dir, prompts_file, root, args)
    assert cfg.ppo_epochs == 1 and cfg.samples_per_prompt == K  # the workload, not a default drift
    one_pass = update.one_pass
    if two_pass:  # the update's other path: score pi_old in its own forward, then update
        update.one_pass = lambda spec, rows, d: False
    prompt_groups = shared_prompt.prompt_groups
    if unshared:  # no repeated prompt found: every forward and the sampler's prefill take all rows
        shared_prompt.prompt_groups = lambda *args: None
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        loop.run(cfg)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        update.one_pass = one_pass
        shared_prompt.prompt_groups = prompt_groups
    lines = (root / "runs" / cfg.run_name / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "rollout/response_len" in m]
    length = statistics.fmean(m["rollout/response_len"] for m in metrics)
    return Timing(seconds, cpu_seconds, length), metrics


MATMULS = ("aten::addmm", "aten::mm", "aten::bmm")


def matmul_peak() -> float:
    """GFLOP/s of an fp32 [1472, 256] x [256, 1024] addmm, best of 50: one fully connected
    layer of the workload's policy on a whole batch, the best case its matmuls can reach."""
    a, w, b = torch.randn(1472, 256), torch.randn(1024, 256), torch.randn(1024)
    best = float("inf")
    for _ in range(50):
        start = time.perf_counter()
        torch.addmm(b, a, w.t())
        best = min(best, time.perf_counter() - start)
    return 2 * 1472 * 256 * 1024 / best / 1e9


def profile_tether(method: str, policy_dir: Path, rm_dir: Path, prompts_file: Path, root: Path,
                   args) -> str:
    """One tether run under torch.profiler: the self CPU time of its matmul kernels against the
    run's whole profiled CPU time, and the matmul peak (`matmul_peak`) for scale."""
    from torch.profiler import profile

    with profile() as prof:
        run_tether(method, policy_dir, rm_dir, prompts_file, root, args)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
    return (f"profile tether {method}: matmuls {matmul:.2f} s of {total:.2f} s profiled "
            f"({matmul / total:.0%}); fp32 matmul peak here "
            f"{matmul_peak():.0f} GFLOP/s")


def trl_config(method: str, root: Path, args):
    """TRL's config for the same workload: its defaults that differ from tether's are set."""
    from trl import GRPOConfig, RLOOConfig

    common = dict(
        output_dir=str(root / f"trl-{time.time_ns()}"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_generations=K, num_iterations=1,
        max_steps=args.episodes // args.batch_size, max_completion_length=args.response_length,
        temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-5, lr_scheduler_type="linear",
        max_grad_norm=1.0, weight_decay=0.0, bf16=False, activation_checkpointing=False,
        disable_dropout=True, use_cpu=args.device == "cpu", report_to="none",
        save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    if method == "rloo":
        return RLOOConfig(**common, beta=0.05, normalize_advantages=False)
    return GRPOConfig(**common, beta=0.04, use_bias_correction_kl=True, loss_type="dapo",
                      scale_rewards="group")


def run_trl(method: str, policy_dir: Path, rm_dir: Path, prompts: list[str], root: Path,
            args) -> Timing:
    import datasets
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PrinterCallback,
    )
    from trl import GRPOTrainer, RLOOTrainer

    start, cpu_start = time.perf_counter(), time.process_time()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    # TRL reads a model reward through a sequence-classification head ("score").
    reward = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    trainer_class = {"rloo": RLOOTrainer, "grpo": GRPOTrainer}[method]
    trainer = trainer_class(model=policy, reward_funcs=reward, args=trl_config(method, root, args),
                            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                            processing_class=tokenizer, reward_processing_classes=tokenizer)
    trainer.remove_callback(PrinterCallback)  # its per-step log lines; tether prints none either
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history
               if "completions/mean_length" in log]
    return Timing(seconds, cpu_seconds, statistics.fmean(lengths))


def check_trl() -> None:
    import trl

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"bench/peers/grpo.py compares against TRL {TRL_VERSION}; this venv has "
                         f"{trl.__version__} (see docs/benchmarks.md for the venv)")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="responses per batch (k = 4)")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-words", default="4-10",
                        help="prompt length range in words (~tokens), LO-HI; the policy takes 128 "
                             "positions, so HI + --response-length <= 128")
    parser.add_argument("--methods", default="rloo,grpo")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's default; 1 is steadiest on a shared machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-trl", action="store_true", help="tether's side only")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one tether run per method: its matmul time against "
                             "this machine's measured matmul peak")
    parser.add_argument("--unshared", action="store_true",
                        help="also time tether with every prompt run once per row")
    parser.add_argument("--two-pass", action="store_true",
                        help="also time tether with a separate old-policy forward (its PPO loop)")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    args.prompt_words = tuple(int(w) for w in args.prompt_words.split("-"))
    if len(args.prompt_words) != 2 or args.prompt_words[1] + args.response_length > 128:
        parser.error("--prompt-words: LO-HI with HI + --response-length <= 128")
    if not set(args.methods) <= set(METHODS):
        parser.error(f"--methods: choose from {', '.join(METHODS)}")
    return args


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def report(method: str, runs: dict[str, list[Timing]], args) -> list[str]:
    """One line per side: median episodes/s (wall clock and per CPU-second), generated tokens
    per wall second, mean response length, and each ratio to TRL."""
    label = {"rloo": "RLOO", "grpo": "GRPO"}[method]
    lines = []
    wall = {side: statistics.median(t.seconds for t in timings) for side, timings in runs.items()}
    cpu = {side: statistics.median(t.cpu_seconds for t in timings)
           for side, timings in runs.items()}
    for side, timings in runs.items():
        length = statistics.fmean(t.response_len for t in timings)
        ratios = ([f"{wall['trl'] / wall[side]:.2f}x", f"{cpu['trl'] / cpu[side]:.2f}x"]
                  if "trl" in wall else ["-", "-"])
        name = {"tether": f"tether {method}", "two-pass": f"tether {method} 2-pass",
                "unshared": f"tether {method} unshared",
                "trl": f"TRL {label}Trainer"}[side]
        lines.append(f"{name:<22}{args.episodes / wall[side]:>10.2f}{ratios[0]:>8}"
                     f"{args.episodes / cpu[side]:>10.2f}{ratios[1]:>8}"
                     f"{args.episodes * length / wall[side]:>10.1f}{length:>8.1f}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    sides = (["tether"] + ([] if args.no_trl else ["trl"]) + (["two-pass"] if args.two_pass else [])
             + (["unshared"] if args.unshared else []))
    if not args.no_trl:
        check_trl()
        import datasets
        datasets.disable_progress_bars()
        # Imports stay outside the timings: TRL's trainer modules load lazily, and they import
        # peft, which tether otherwise imports on its first model-type check.
        from trl import GRPOTrainer, RLOOTrainer  # noqa: F401
    import tether.train.ppo  # noqa: F401

    prompts = make_prompts(512, words=args.prompt_words)
    runs: dict[str, dict[str, list[Timing]]] = {m: {s: [] for s in sides} for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, rm_dir, prompts_file = build_workload(root, prompts)
        for rep in range(args.repeats):
            for method in args.methods:
                # A B, then B A: neither side always runs first on a warm (or loaded) machine.
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    if side in ("tether", "two-pass", "unshared"):
                        timing, _ = run_tether(method, policy_dir, rm_dir, prompts_file, root,
                                               args, two_pass=side == "two-pass",
                                               unshared=side == "unshared")
                    else:
                        timing = run_trl(method, policy_dir, rm_dir, prompts, root, args)
                    runs[method][side].append(timing)
                    print(f"  {method} {side}: {timing.seconds:.1f} s ({timing.cpu_seconds:.1f} "
                          f"CPU-s), mean response {timing.response_len:.1f} tokens", flush=True)
        profiled = [profile_tether(m, policy_dir, rm_dir, prompts_file, root, args)
                    for m in args.methods] if args.profile else []
    threads = torch.get_num_threads()
    lines = [f"k = {K}, {args.episodes} episodes, batch {args.batch_size}, "
             f"prompts of {args.prompt_words[0]}-{args.prompt_words[1]} words, "
             f"{args.response_length}-token responses, 1 step per batch, device {args.device}, "
             f"{threads} thread(s), median of {args.repeats}",
             f"{'':<22}{'ep/s':>10}{'vs TRL':>8}{'ep/CPU-s':>10}{'vs TRL':>8}{'tok/s':>10}"
             f"{'length':>8}"]
    for method in args.methods:
        lines += report(method, runs[method], args)
    lines += profiled
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
