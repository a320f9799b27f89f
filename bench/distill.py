"""What the full-vocabulary divergences cost: a `tether distill` batch with the exact reverse KL
(and the forward KL, the JSD) in the loss against one with the sampled k1 in the reward
(docs/ppo.md, "On-policy distillation"; the goal is at most 1.5x).

    python bench/distill.py [--vocab 32000] [--layers 2] [--teacher-layers 4] [--width 128]
                            [--batches 6] [--batch-size 16] [--max-new-tokens 32] [--threads 2]

A GPT-2-style student and a deeper teacher share one tokenizer; both output layers are padded to
--vocab rows (a real vocabulary's cost: every row is a logit the softmax sums over). Each form
runs --batches batches of `tether distill` (the whole loop: sampling, the teacher's and the
student's scoring, the update, the engine's sync) and prints the mean seconds per batch after the
first, with the ratio to k1 in the reward, measured side by side in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import tether  # noqa: F401 - first: its guard hides a mismatched torchvision before transformers

WORDS = "the movie was good bad great fine dull fun plot actor scene film story music".split()
FORMS = {"k1 in the reward": {"kl_in": "reward", "kl_estimator": "k1"},
         "exact (reverse KL)": {"kl_estimator": "exact"},
         "forward KL": {"kl_estimator": "forward"},
         "jsd (beta 0.5)": {"kl_estimator": "jsd"}}


def models(root: Path, args) -> tuple[str, str]:
    """The student and the teacher, saved with one tokenizer and padded to --vocab rows."""
    from tether.models.tiny import make_lm, make_tokenizer

    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 6)) + "."
             for i in range(300)]
    tokenizer = make_tokenizer(texts, 300)
    out = []
    for name, layers, seed in (("student", args.layers, 0), ("teacher", args.teacher_layers, 1)):
        model = make_lm(len(tokenizer), n_layer=layers, n_embd=args.width, n_head=2, seed=seed)
        model.resize_token_embeddings(args.vocab, mean_resizing=False)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(str(root / name))
    return out[0], out[1]


def batch_seconds(root: Path, name: str, student: str, teacher: str, args, form: dict) -> float:
    from tether.train import ppo
    from tether.train.ppo_config import DistillConfig

    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i:i + 3])}) + "\n"
                               for i in range(len(WORDS) - 3)))
    run_name = name.replace(" ", "_").replace("(", "").replace(")", "")
    ppo.run(DistillConfig(run_name=run_name, output_dir=str(root / "runs"), policy=student,
                          teacher=teacher, prompts=str(prompts), batch_size=args.batch_size,
                          total_episodes=args.batch_size * args.batches,
                          max_new_tokens=args.max_new_tokens, threads=args.threads,
                          device="cpu", save_every=0, sample_every=0, report_to="none", **form))
    lines = [json.loads(x) for x in (root / "runs" / run_name / "metrics.jsonl").read_text()
             .splitlines()]
    return statistics.fmean(x["perf/rollout_s"] + x["perf/update_s"] for x in lines[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--teacher-layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="distill_bench_"))
    student, teacher = models(root, args)
    started = time.perf_counter()
    seconds = {name: batch_seconds(root, name, student, teacher, args, form)
               for name, form in FORMS.items()}
    base = seconds["k1 in the reward"]
    print(f"student {args.layers} layers, teacher {args.teacher_layers}, width {args.width}, "
          f"vocabulary {args.vocab}, {args.batch_size} x {args.max_new_tokens} tokens a batch, "
          f"{args.threads} threads; seconds per batch (mean of batches 2-{args.batches})")
    for name, value in seconds.items():
        print(f"{name:<20}{value:8.3f} s{value / base:8.2f}x")
    print(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
