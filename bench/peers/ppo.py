"""PPO throughput: tether's `ppo` stage against TRL's `PPOTrainer`, side by side in one process.

One workload for both: a GPT-2-style policy (4 layers, width 256, ~512-token BPE vocabulary),
a reward model and a value model of the same size (separate networks), batch 32, 32-token
responses sampled at temperature 1 with top-k 0 / top-p 1, stop at EOS, 4 PPO epochs, 1
minibatch, 256 episodes (8 rollout batches), KL coefficient 0.05 (k1 in the reward), AdamW at
lr 1e-5, dropout off, fp32 on the CPU. tether also runs with `--critic shared` (a value head on the
policy's trunk; TRL's PPOTrainer has no such option, so that row compares against TRL's separate
critic). Each side is timed from construction to the end of training (model loading and, for
tether, writing the final model count; TRL saves nothing). The order of runs alternates and each
configuration's best of `--repeats` is reported.

Also printed: the model-FLOP rate of tether's update phase (the PPO epochs: forward and backward
of policy and critic) against this machine's measured fp32 matmul peak. FLOPs are counted as
6 * parameters * tokens for each trunk (forward 2, backward 4; Kaplan et al. 2020) plus the LM
head on the response positions, and 12 * layers * T^2 * d per sequence for attention scores.

    python bench/peers/ppo.py [--repeats 1] [--threads 2] [--device cpu]

Needs the `bench` extra (trl==1.12.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
import warnings
from pathlib import Path

import torch

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite slow fast sharp warm cold "
         "bright dark funny sad brave quiet loud river mountain window garden kitchen teacher "
         "student doctor engine rocket planet ocean forest summer winter autumn spring").split()
LAYERS, WIDTH, HEADS, VOCAB = 4, 256, 4, 512


def make_prompts(n: int, seed: int = 0, words: tuple[int, int] = (4, 10)) -> list[str]:
    """`n` prompts of `words[0]` to `words[1]` words (about as many tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def build_models(root: Path, prompts: list[str]) -> tuple[Path, Path]:
    """Policy (causal LM) and reward model dirs; both sides load the same weights."""
    from tether.models.reward_model import RewardModel
    from tether.models.tiny import make_lm, make_tokenizer

    tokenizer = make_tokenizer(prompts * 4, vocab_size=VOCAB)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})  # one vocabulary for every model
    policy = make_lm(len(tokenizer), n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=128)
    policy_dir = root / "policy"
    tokenizer.save_pretrained(policy_dir)
    policy.save_pretrained(policy_dir)
    rm = RewardModel.from_causal_lm(str(policy_dir), tokenizer)
    torch.manual_seed(1)
    torch.nn.init.normal_(rm.head.weight, std=0.5)  # a reward that varies between responses
    rm.save_pretrained(root / "rm", tokenizer)
    return policy_dir, root / "rm"


def build_workload(root: Path, prompts: list[str]) -> tuple[Path, Path, Path]:
    """The benchmark's policy and reward model (`build_models`) and its prompts as JSONL."""
    policy_dir, rm_dir = build_models(root, prompts)
    prompts_file = root / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return policy_dir, rm_dir, prompts_file


def run_tether(policy_dir: Path, rm_dir: Path, prompts_file: Path, root: Path, critic: str,
               args) -> tuple[float, list[dict]]:
    from tether.train.ppo import PPOConfig, run

    name = f"tether-{time.time_ns()}"
    cfg = PPOConfig(run_name=name, output_dir=str(root / "runs"), policy=str(policy_dir),
                    reward_model=str(rm_dir), prompts=str(prompts_file), critic=critic,
                    batch_size=args.batch_size, total_episodes=args.episodes,
                    max_new_tokens=args.response_length, ppo_epochs=4, num_minibatches=1,
                    lr=1e-5, lr_schedule="linear", beta=0.05, kl_ctl="fixed", temperature=1.0,
                    device=args.device, save_every=0, sample_every=0, log_every=1, vf_coef=0.1,
                    max_grad_norm=0.0)
    start = time.perf_counter()
    run(cfg)
    seconds = time.perf_counter() - start
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return seconds, [json.loads(x) for x in lines]


def run_trl(policy_dir: Path, rm_dir: Path, prompts: list[str], root: Path, args) -> float:
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    ref = AutoModelForCausalLM.from_pretrained(policy_dir)
    # TRL reads rewards and values through a sequence-classification head ("score").
    reward = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    for model in (reward, value):
        model.config.pad_token_id = tokenizer.pad_token_id
    dataset = datasets.Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    cfg = PPOConfig(output_dir=str(root / f"trl-{time.time_ns()}"),
                    per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
                    num_mini_batches=1, num_ppo_epochs=4, total_episodes=args.episodes,
                    response_length=args.response_length, temperature=1.0, stop_token="eos",
                    learning_rate=1e-5, lr_scheduler_type="linear", kl_coef=0.05,
                    kl_estimator="k1", vf_coef=0.1, num_sample_generations=0, report_to="none",
                    save_strategy="no", logging_steps=1000, use_cpu=args.device == "cpu",
                    dataloader_num_workers=0, seed=0, disable_tqdm=True,
                    local_rollout_forward_batch_size=args.batch_size)
    trainer = PPOTrainer(args=cfg, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value, train_dataset=dataset)
    trainer.train()
    return time.perf_counter() - start


def matmul_peak(device: str, n: int = 2048, repeats: int = 10) -> float:
    """Best measured fp32 FLOP/s of an n x n matmul on this machine."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def update_flops(metrics: list[dict], prompt_len: float, critic: str, batch: int,
                 epochs: int = 4) -> float:
    """Model FLOPs of one batch's update phase (the PPO epochs), from the batch's shapes."""
    trunk = LAYERS * 12 * WIDTH ** 2  # attention (4 d^2) + MLP (8 d^2) weights per layer
    total = 0.0
    for m in metrics:
        response = m["rollout/response_len"]
        tokens = prompt_len + response
        per_seq = 6 * trunk * tokens + 6 * WIDTH * VOCAB * response  # policy trunk + LM head
        per_seq += 12 * LAYERS * tokens ** 2 * WIDTH  # attention scores and mixing, fwd + bwd
        if critic == "separate":  # a second trunk of the same size, plus its scalar head
            per_seq += 6 * trunk * tokens + 12 * LAYERS * tokens ** 2 * WIDTH
        total += per_seq * epochs * batch
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    import datasets
    import trl.experimental.ppo  # noqa: F401  (import cost stays outside the timings)

    import tether.train.ppo  # noqa: F401

    datasets.disable_progress_bars()
    prompts = make_prompts(512)
    times: dict[str, list[float]] = {}
    metrics: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, rm_dir, prompts_file = build_workload(root, prompts)
        for rep in range(args.repeats):
            order = ["tether", "shared", "trl"] if rep % 2 == 0 else ["trl", "shared", "tether"]
            for name in order:
                if name == "trl":
                    seconds = run_trl(policy_dir, rm_dir, prompts, root, args)
                else:
                    critic = "shared" if name == "shared" else "separate"
                    seconds, run_metrics = run_tether(policy_dir, rm_dir, prompts_file, root,
                                                      critic, args)
                    if seconds <= min(times.get(name, [float("inf")])):
                        metrics[name] = run_metrics  # FLOP rate from the best run
                times.setdefault(name, []).append(seconds)
                print(f"  {name}: {seconds:.1f} s", flush=True)
        from tether.models.pretrained import load_tokenizer
        tokenizer = load_tokenizer(str(policy_dir))
        prompt_len = sum(len(tokenizer(p)["input_ids"]) for p in prompts) / len(prompts)
    peak = matmul_peak(args.device)
    threads = torch.get_num_threads()
    print(f"PPO, {args.episodes} episodes, batch {args.batch_size}, {args.response_length}-token "
          f"responses, 4 epochs, 1 minibatch, device {args.device}, {threads} thread(s), "
          f"best of {args.repeats}")
    trl_best = min(times["trl"])
    print(f"{'':<28}{'episodes/s':>12}{'vs TRL':>9}")
    print(f"{'TRL PPOTrainer':<28}{args.episodes / trl_best:>12.2f}{'1.00x':>9}")
    for name, label in (("tether", "tether (separate critic)"), ("shared", "tether --critic shared")):
        best = min(times[name])
        print(f"{label:<28}{args.episodes / best:>12.2f}{trl_best / best:>8.2f}x")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    for name, critic in (("tether", "separate"), ("shared", "shared")):
        flops = update_flops(metrics[name], prompt_len, critic, args.batch_size)
        seconds = sum(m["perf/update_s"] for m in metrics[name])
        print(f"{name} update phase: {flops / 1e9:.1f} GFLOP in {seconds:.1f} s = "
              f"{flops / seconds / 1e9:.1f} GFLOP/s, {100 * flops / seconds / peak:.0f}% of peak "
              f"(rollout and scoring: {sum(m['perf/rollout_s'] for m in metrics[name]):.1f} s)")


if __name__ == "__main__":
    main()
