"""DPO throughput: tether's `dpo` stage against TRL's `DPOTrainer`, side by side in one process.

Both train the same tiny GPT-2-style model (4 layers, width 256, ~512-token BPE vocabulary) on the
same 512 preference pairs (prompts of ~14 tokens, responses of ~24) for one epoch at batch 32,
sigmoid loss, beta 0.1, AdamW, dropout off, on the CPU, in fp32 and in bf16 autocast (TRL's
default). Each side is timed from construction to
the end of training, so tokenisation, the reference pass (when precomputed) and start-up count;
tether's time also includes writing its final model, TRL's does not (save_strategy="no").
The order of runs alternates and each configuration's best of `--repeats` is reported.

    python bench/peers/dpo.py [--repeats 2] [--threads 1] [--device cpu]

Needs the `bench` extra (trl==1.12.0).
"""

from __future__ import annotations

import argparse
import json
import logging
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

WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite slow fast sharp warm cold "
         "bright dark funny sad brave quiet loud river mountain window garden kitchen teacher "
         "student doctor engine rocket planet ocean forest summer winter autumn spring morning "
         "evening yellow purple orange silver golden wooden plastic careful honest gentle clever "
         "strange simple famous hungry sleepy angry happy lonely busy lazy tiny giant ancient modern "
         "whisper thunder lantern harbor meadow canyon valley island desert castle village market "
         "bridge tunnel station ticket letter pencil notebook picture mirror blanket pillow candle").split()


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))
    return [{"prompt": words(rng.randint(5, 10)), "chosen": " " + words(14), "rejected": " " + words(14)}
            for _ in range(n)]


def build_model(root: Path, pairs: list[dict]) -> Path:
    from tether.models.tiny import make_lm, make_tokenizer

    texts = [p["prompt"] + p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    tokenizer = make_tokenizer(texts, vocab_size=512)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})  # both sides then use the same vocabulary
    model = make_lm(len(tokenizer), n_layer=4, n_embd=256, n_head=4, n_positions=128)
    out = root / "model"
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def run_tether(model_dir: Path, data: Path, root: Path, precompute: bool, bf16: bool, args,
               share_prompt: bool = True) -> float:
    from tether.train.dpo import DPOConfig, run

    cfg = DPOConfig(run_name=f"tether-{time.time_ns()}", output_dir=str(root / "runs"), model=str(model_dir),
                    data=str(data), batch_size=args.batch_size, epochs=1, lr=1e-5, beta=0.1,
                    max_length=128, precompute_ref_logprobs=precompute, log_every=1000, save_every=0,
                    device=args.device, lr_schedule="constant", max_grad_norm=1.0,
                    mixed_precision="bf16" if bf16 else "no", share_prompt=share_prompt)
    start = time.perf_counter()
    run(cfg)
    return time.perf_counter() - start


def run_trl(model_dir: Path, pairs: list[dict], root: Path, precompute: bool, bf16: bool, args) -> float:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = DPOConfig(output_dir=str(root / f"trl-{time.time_ns()}"), per_device_train_batch_size=args.batch_size,
                    num_train_epochs=1, learning_rate=1e-5, lr_scheduler_type="constant", beta=0.1,
                    max_length=128, precompute_ref_log_probs=precompute, report_to="none",
                    save_strategy="no", logging_steps=1000, use_cpu=args.device == "cpu",
                    dataloader_num_workers=0, disable_dropout=True, max_grad_norm=1.0, seed=0,
                    bf16=bf16, disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_list(pairs),
                         processing_class=tokenizer)
    trainer.train()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    import datasets
    import trl  # noqa: F401

    import tether.train.dpo  # noqa: F401  (import cost stays outside the timings)

    datasets.disable_progress_bars()
    pairs = make_pairs(args.pairs)
    configs = [(bf16, precompute) for bf16 in (False, True) for precompute in (False, True)]
    times: dict[tuple[str, bool, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_model(root, pairs)
        data = root / "pairs.jsonl"
        data.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
        run_trl(model_dir, pairs[: args.batch_size], root, False, False, args)  # warm-up
        run_tether(model_dir, data, root, False, False, args)
        for rep in range(args.repeats):
            for bf16, precompute in configs:
                order = ("tether", "trl") if rep % 2 == 0 else ("trl", "tether")
                for name in order:
                    if name == "tether":
                        seconds = run_tether(model_dir, data, root, precompute, bf16, args)
                    else:
                        seconds = run_trl(model_dir, pairs, root, precompute, bf16, args)
                    times.setdefault((name, bf16, precompute), []).append(seconds)
                if not precompute:  # ablation: tether without prefix sharing ([2B, P+R] batches)
                    seconds = run_tether(model_dir, data, root, precompute, bf16, args, share_prompt=False)
                    times.setdefault(("tether-concat", bf16, precompute), []).append(seconds)
    print(f"DPO, {args.pairs} pairs, batch {args.batch_size}, 1 epoch, device {args.device}, "
          f"{args.threads} thread(s), best of {args.repeats}")
    print(f"{'precision':<11}{'reference':<20}{'tether pairs/s':>16}{'TRL pairs/s':>14}{'ratio':>8}")
    for bf16, precompute in configs:
        ours, theirs = times[("tether", bf16, precompute)], times[("trl", bf16, precompute)]
        label = "precomputed" if precompute else "live (frozen copy)"
        precision = "bf16 amp" if bf16 else "fp32"
        print(f"{precision:<11}{label:<20}{args.pairs / min(ours):>16.1f}{args.pairs / min(theirs):>14.1f}"
              f"{min(theirs) / min(ours):>7.2f}x   (s: tether {', '.join(f'{t:.1f}' for t in ours)};"
              f" TRL {', '.join(f'{t:.1f}' for t in theirs)})")
    for bf16 in (False, True):
        concat, theirs = times[("tether-concat", bf16, False)], times[("trl", bf16, False)]
        precision = "bf16 amp" if bf16 else "fp32"
        print(f"{precision:<11}{'live, no sharing':<20}{args.pairs / min(concat):>16.1f}"
              f"{args.pairs / min(theirs):>14.1f}{min(theirs) / min(concat):>7.2f}x"
              "   (tether with --no-share-prompt: the concatenated [2B, P+R] batch)")


if __name__ == "__main__":
    main()
