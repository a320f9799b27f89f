"""On-policy distillation on a laptop CPU: a teacher trained with SFT on the demo's review task,
a smaller student with the same tokenizer distilled on prompts alone, evaluated on held-out
prompts against the student with SFT alone.

    python examples/distill/run.py [--quick] [--out DIR] [--seed N] [--threads N]

Each stage is a `tether` command, printed as it runs (in this process, `tether.cli.main`):

    data      the demo's corpus, prompts and held-out prompts (tether.demo: 4,000 reviews)
    teacher   a 4-layer, 128-wide GPT-2 on the demo's tokenizer, `tether sft` for 400 steps
    student   the demo's 2-layer, 64-wide base, `tether sft` for 60 steps (a weak start), and
              for 400 steps as the teacher was (the student with SFT alone)
    distill   `tether distill` for 300 batches of 32 from the 60-step student, on the training
              prompts only (no responses, no reward), in three forms: k1 in the reward (the
              sampled, sequence-level form), the exact reverse KL in the loss (tether distill's
              default) and the JSD (beta 0.5)
    eval      `tether eval --reference TEACHER` of each student: held-out gold (the demo's
              well-formed-sentiment reward), the KL to the teacher (exact, over the vocabulary)
              and the time each took; `summary.json` has the figures

docs/ppo.md ("A worked example") quotes the full run's figures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

# tether first, before transformers (tests/bench/test_bench_import_order.py holds the rule)
import tether as _tether  # noqa: F401  (the name `tether` is the function below)

GOLD = "tether.demo.task:gold_reward"
FULL = dict(teacher_steps=400, student_steps=60, batches=300)
QUICK = dict(teacher_steps=20, student_steps=10, batches=2)
FORMS = {"k1 in the reward": ["--kl-in", "reward", "--kl-estimator", "k1"],
         "exact reverse KL": ["--kl-estimator", "exact"],
         "jsd (beta 0.5)": ["--kl-estimator", "jsd", "--jsd-beta", 0.5]}


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def tether(*args: str | int | float | Path) -> float:
    """Run one tether command in this process, printed as typed; its wall time in seconds."""
    from tether.cli import main

    argv = [shown(a) if isinstance(a, Path) else str(a) for a in args]
    print(f"\n$ tether {shlex.join(argv)}", flush=True)
    start = time.perf_counter()
    if main(argv) != 0:
        sys.exit(f"tether {argv[0]} failed (its error is above)")
    return time.perf_counter() - start


def teacher_base(out: Path, student_base: str, seed: int) -> Path:
    """A larger GPT-2 on the student's tokenizer (the same token ids), randomly initialised."""
    from transformers import AutoTokenizer

    from tether.models.tiny import make_lm

    tokenizer = AutoTokenizer.from_pretrained(student_base)
    make_lm(len(tokenizer), n_layer=4, n_embd=128, n_head=4, n_positions=64,
            seed=seed + 1).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def evaluate(model: Path, teacher: Path, prompts: str, out: Path, common: list) -> dict:
    tether("eval", "--model", model, "--reference", teacher, "--prompts", prompts,
           "--gold-fn", GOLD, "--max-new-tokens", 20, "--batch-size", 64, *common,
           "--output", out)
    metrics = json.loads(out.read_text())["metrics"]
    return {"gold": metrics["eval/gold_score"], "kl_to_teacher": metrics["eval/kl_exact"],
            "response_len": metrics["eval/response_len"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    parser.add_argument("--out", default="distill_example", help="where everything is written")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    args = parser.parse_args()
    from tether.demo.config import DemoConfig
    from tether.demo.data import prepare_data

    settings = QUICK if args.quick else FULL
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare_data(out, DemoConfig(output_dir=str(out), seed=args.seed))
    runs = out / "runs"
    common = ["--device", "cpu", "--seed", args.seed] + (
        ["--threads", args.threads] if args.threads else [])
    offline = ["--data", paths["sft"], "--batch-size", 32, "--max-length", 48, "--lr", 3e-3,
               "--output-dir", runs, *common]
    seconds = {"teacher sft": tether(
        "sft", "--model", teacher_base(out / "teacher_base", paths["base"], args.seed),
        "--run-name", "teacher", "--max-steps", settings["teacher_steps"], *offline)}
    seconds["student sft"] = tether("sft", "--model", paths["base"], "--run-name", "student",
                                    "--max-steps", settings["student_steps"], *offline)
    seconds["student sft, longer"] = tether(
        "sft", "--model", paths["base"], "--run-name", "student-sft",
        "--max-steps", settings["teacher_steps"], *offline)
    teacher, student = runs / "teacher" / "final", runs / "student" / "final"
    summary = {"teacher": evaluate(teacher, teacher, paths["eval_prompts"], out / "eval_teacher.json",
                                   common),
               "student, start (SFT)": evaluate(student, teacher, paths["eval_prompts"],
                                                out / "eval_student.json", common),
               "student, SFT alone": evaluate(runs / "student-sft" / "final", teacher,
                                              paths["eval_prompts"], out / "eval_student_sft.json",
                                              common)}
    for name, form in FORMS.items():
        run_name = "distill-" + name.split()[0]
        seconds[name] = tether(
            "distill", "--policy", student, "--teacher", teacher, "--prompts", paths["prompts"],
            "--run-name", run_name, "--batch-size", 32, "--total-episodes",
            32 * settings["batches"], "--max-new-tokens", 20, "--lr", 1e-3,
            "--lr-schedule", "constant", "--save-every", 0, "--sample-every", 0,
            "--output-dir", runs, *form, *common)
        summary[f"student, {name}"] = evaluate(runs / run_name / "final", teacher,
                                               paths["eval_prompts"], out / f"eval_{run_name}.json",
                                               common)
    summary["seconds"] = seconds
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    took = {"teacher": seconds["teacher sft"], "student, start (SFT)": seconds["student sft"],
            "student, SFT alone": seconds["student sft, longer"]}
    took |= {f"student, {name}": seconds[name] for name in FORMS}  # the distillation's own
    print(f"\n{'model':<30}{'held-out gold':>15}{'KL to teacher':>15}{'seconds':>10}")
    for name, seconds_taken in took.items():
        figures = summary[name]
        print(f"{name:<30}{figures['gold']:>15.3f}{figures['kl_to_teacher']:>15.3f}"
              f"{seconds_taken:>10.0f}")
    print(f"written to {shown(out / 'summary.json')}")


if __name__ == "__main__":
    main()
