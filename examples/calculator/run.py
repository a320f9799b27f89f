"""A tiny agent learns to use its calculator: SFT on mixed tool-calling transcripts, then GRPO
with the tool and a correctness reward, evaluated on held-out questions before and after.

    python examples/calculator/run.py [--quick] [--out DIR] [--seed N]

Each stage is a `tether` command, printed as it runs (run in this process with
`tether.cli.main`, the function behind the `tether` executable):

    data   "What is a plus b?" for a, b in 0..49; 200 questions are held out for evaluation.
           The SFT transcripts, in TRL's tool-calling shape, mix two behaviours at random: half
           call add(a, b) and answer with its result, half answer at once with a guess (a random
           number, right about 1 time in 100).
    base   a randomly initialised Qwen2-style model (~0.24M parameters) with a tool-calling
           ChatML template; its byte-level BPE is trained on rendered transcripts, so the
           schema's JSON and every number up to 98 are single tokens.
    sft    `tether sft`: the model imitates both behaviours, so it calls the tool on about half
           the questions and guesses on the rest.
    eval   `tether eval --tools`: one sampled episode per held-out question (SFT model).
    grpo   `tether grpo --tools --reward-fn`: reward 1 for a right final answer. A call is
           usually right and a guess almost never, so the group-relative advantage moves the
           first token of the reply, `<tool_call>` or `The`, towards the call.
    eval   the same evaluation of the GRPO model; `summary.json` has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether as _tether  # noqa: F401  (the name `tether` is the function below)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # tools.py: the transcripts are rendered with its schema

from tools import add  # noqa: E402

N = 50  # operands 0..49, sums 0..98
HELD_OUT = 200  # questions never trained on

# What differs between the full run and --quick (a smoke test whose figures mean nothing).
# window: each layer attends to the last 32 tokens. The ~115-token system turn (the schema) is
# the same in every episode, so it tells the model nothing; without the window this model
# learned to copy the numbers into the call only after 500-1500 steps, or not at all within
# 1440, depending on the seed; with it, after ~500 for seeds 0, 1 and 2. 32 covers the longest
# copy, question to the call's "b" (~25 tokens back).
FULL = dict(hidden_size=64, n_layer=3, n_head=2, window=32,
            sft=["--epochs", 8],
            grpo=["--total-episodes", 3840, "--batch-size", 64])
QUICK = dict(hidden_size=32, n_layer=1, n_head=2, window=32,
             sft=["--max-steps", 30],
             grpo=["--total-episodes", 64, "--batch-size", 32])
EPISODE = ["--max-turns", 3, "--max-new-tokens", 32]  # --max-new-tokens is per turn


def questions(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training pairs, held-out pairs): all 2,500 pairs (a, b), shuffled once and split."""
    pairs = [(a, b) for a in range(N) for b in range(N)]
    random.Random(seed).shuffle(pairs)
    return pairs[HELD_OUT:], pairs[:HELD_OUT]


def ask(a: int, b: int) -> str:
    return f"What is {a} plus {b}?"


def transcript(a: int, b: int, use_tool: bool, guess: int) -> list[dict]:
    """One conversation in TRL's tool-calling shape: call, result, answer; or a bare guess."""
    if not use_tool:
        return [{"role": "user", "content": ask(a, b)},
                {"role": "assistant", "content": f"The answer is {guess}."}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": ask(a, b)},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(add(a, b))},
            {"role": "assistant", "content": f"The answer is {add(a, b)}."}]


def write_data(out: Path, seed: int) -> dict[str, Path]:
    """The SFT transcripts (one per training question, call or guess at random), the GRPO
    prompts (the same questions) and the held-out prompts, as JSON lines."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(add)
    train, held_out = questions(seed)
    rng = random.Random(seed + 1)
    sft = [{"messages": transcript(a, b, rng.random() < 0.5, rng.randrange(2 * N - 1)),
            "tools": [schema]} for a, b in train]
    files = {"sft": out / "sft.jsonl", "prompts": out / "questions.jsonl",
             "held_out": out / "held_out.jsonl"}
    for name, rows in (("sft", sft), ("prompts", [{"prompt": ask(a, b)} for a, b in train]),
                       ("held_out", [{"prompt": ask(a, b)} for a, b in held_out])):
        files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


def build_base(out: Path, settings: dict, seed: int) -> int:
    """A random Qwen2-style model and its tool-calling tokenizer, saved to `out`; its size.

    tether.models.tiny's tool-calling Qwen2 with our own sizes: 384 positions (the schema's
    system turn is ~130 tokens, an episode up to 128 more), the attention window on every layer,
    and no GQA. The BPE sees every question rendered both ways, so " 23" (question, arguments,
    answer) and "23" (the tool's result) are one token each.
    """
    from safetensors.torch import load_file
    from transformers.utils import get_json_schema

    from tether.models.tiny import make_qwen2_tokenizer, save_tiny_qwen2

    schema = get_json_schema(add)
    renderer = make_qwen2_tokenizer(["x"], 300, tools=True)  # for its template only
    texts = [renderer.apply_chat_template(transcript(a, b, use_tool, (a * 7 + b) % (2 * N - 1)),
                                          tools=[schema], tokenize=False)
             for a in range(N) for b in range(N) for use_tool in (True, False)]
    hidden = settings["hidden_size"]
    save_tiny_qwen2(out, texts, vocab_size=600, tools=True, hidden_size=hidden,
                    intermediate_size=4 * hidden, n_layer=settings["n_layer"],
                    n_head=settings["n_head"], n_kv_head=settings["n_head"], max_positions=384,
                    use_sliding_window=True, sliding_window=settings["window"],
                    max_window_layers=0, seed=seed)  # max_window_layers 0: every layer
    # The stored tensors are the parameters (the tied head is stored once, as the embedding).
    return sum(t.numel() for t in load_file(out / "model.safetensors").values())


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


COMMANDS: list[str] = []


def tether(*args: str | int | float | Path) -> float:
    """Run one tether command in this process, printed as typed; its wall time in seconds."""
    from tether.cli import main

    argv = [shown(a) if isinstance(a, Path) else str(a) for a in args]
    COMMANDS.append(f"tether {shlex.join(argv)}")
    print(f"\n$ {COMMANDS[-1]}", flush=True)
    start = time.perf_counter()
    code = main(argv)
    if code != 0:
        sys.exit(f"tether {argv[0]} failed with exit code {code} (its error is above)")
    return time.perf_counter() - start


def tool_args() -> list[str]:
    return ["--tools", f"{shown(HERE / 'tools.py')}:add",
            "--reward-fn", f"{shown(HERE / 'rewards.py')}:correct"]


def evaluate(model: Path, prompts: Path, out: Path, common: list) -> tuple[dict, float]:
    """Held-out figures of `model`, one episode per question sampled at temperature 1:
    success (the reward's mean), tool_call_rate (episodes with a `<tool_call>` in any of the
    model's turns), tool_calls and tool_errors (per episode, as tether counts them)."""
    seconds = tether("eval", "--model", model, "--prompts", prompts, *tool_args(), *EPISODE,
                     "--batch-size", 100, *common, "--output", out)
    record = json.loads(out.read_text())
    metrics, samples = record["metrics"], record["samples"]
    return {"questions": len(samples), "success": metrics["eval/score"],
            "tool_call_rate": sum("<tool_call>" in s["response"] for s in samples) / len(samples),
            "tool_calls": metrics["eval/tool_calls"],
            "tool_errors": metrics["eval/tool_errors"],
            "turns": metrics["eval/turns"]}, seconds


def grpo_curve(metrics_path: Path) -> dict:
    """Training score and calls per episode: first batch, mean of the last five."""
    lines = [json.loads(x) for x in metrics_path.read_text().splitlines()]
    return {key: {"first": lines[0][key], "last5": sum(x[key] for x in lines[-5:]) / 5}
            for key in ("objective/score", "env/tool_calls", "objective/kl")}


def run_seed(args, seed: int, out: Path) -> dict:
    """Every stage for one seed in `out`; returns its summary (also written as summary.json)."""
    settings = QUICK if args.quick else FULL
    runs = out / "runs"
    if runs.exists():
        sys.exit(f"{shown(out)} already holds a run; choose another --out or delete it")
    out.mkdir(parents=True, exist_ok=True)
    common = ["--device", "cpu", "--threads", args.threads, "--seed", seed]
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    files = write_data(out, seed)
    parameters = build_base(out / "base", settings, seed)
    seconds["data_and_base"] = time.perf_counter() - start
    print(f"data and a {parameters / 1e6:.2f}M-parameter base model in "
          f"{seconds['data_and_base']:.1f} s, in {shown(out)}")

    seconds["sft"] = tether(
        "sft", "--model", out / "base", "--data", files["sft"], *settings["sft"],
        "--batch-size", 16, "--lr", 3e-3, "--warmup-steps", 20, "--max-length", 384, *common,
        "--run-name", "sft", "--output-dir", runs, "--save-every", 0, "--log-every", 50,
        "--report-to", "none")
    before, seconds["eval_sft"] = evaluate(runs / "sft" / "final", files["held_out"],
                                           out / "eval_sft.json", common[:4])
    seconds["grpo"] = tether(
        "grpo", "--policy", runs / "sft" / "final", "--prompts", files["prompts"], *tool_args(),
        *EPISODE, "--max-episode-tokens", 128, "--samples-per-prompt", 8, *settings["grpo"],
        "--lr", 1e-3, "--beta", 0.01, *common, "--run-name", "grpo",
        "--output-dir", runs, "--save-every", 0, "--sample-every", 0, "--report-to", "none")
    after, seconds["eval_grpo"] = evaluate(runs / "grpo" / "final", files["held_out"],
                                           out / "eval_grpo.json", common[:4])
    seconds["total"] = time.perf_counter() - start

    summary = {"quick": args.quick, "seed": seed, "parameters": parameters,
               "sft": before, "grpo": after,
               "grpo_training": grpo_curve(runs / "grpo" / "metrics.jsonl"),
               "seconds": seconds, "commands": list(COMMANDS)}
    COMMANDS.clear()
    figures = [*before.values(), *after.values(), *seconds.values()]
    if not all(math.isfinite(v) for v in figures):
        sys.exit(f"a figure is not finite: {summary}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), least and most."""
    mean = sum(values) / len(values)
    sd = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
          if len(values) > 1 else 0.0)
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of under a minute")
    parser.add_argument("--out", default="calculator-run", help="directory for everything")
    parser.add_argument("--seeds", default="0",
                        help="seeds, joined by commas: each runs every stage in <out>/seed<N>/ "
                             "(data split, base, sampling); summary.json has each figure's mean "
                             "and spread over them")
    parser.add_argument("--seed", type=int, default=None, help="one seed (as --seeds N)")
    # 2 threads: on 2 cores this model's SFT step took 0.07 s with 2 and 0.13 s with 1 (tether's
    # automatic choice for a model under 10M parameters)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every stage")
    args = parser.parse_args()
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",")]
    out = Path(args.out).resolve()
    summaries = [run_seed(args, seed, out / f"seed{seed}" if len(seeds) > 1 else out)
                 for seed in seeds]
    table = {policy: {key: spread([s[policy][key] for s in summaries])
                      for key in summaries[0][policy]} for policy in ("sft", "grpo")}
    total = spread([s["seconds"]["total"] for s in summaries])
    if len(seeds) > 1:
        (out / "summary.json").write_text(json.dumps(
            {"quick": args.quick, "seeds": seeds, "held_out": table, "seconds_total": total,
             "per_seed": [str(out / f"seed{seed}" / "summary.json") for seed in seeds]},
            indent=1) + "\n")
    print(f"\nheld out, over seeds {','.join(map(str, seeds))}: mean (sd; min-max)")
    print(f"{'':16}{'SFT':>28}{'GRPO':>28}")
    for key in table["sft"]:
        print(f"{key:16}" + "".join(f"{c['mean']:10.3f} ({c['sd']:.3f}; {c['min']:.3f}-{c['max']:.3f})"
                                    for c in (table["sft"][key], table["grpo"][key])))
    print(f"seconds per seed: {total['mean']:.0f} (min {total['min']:.0f}, max {total['max']:.0f})")
    print(f"written to {shown(out / 'summary.json')}")


if __name__ == "__main__":
    main()
