"""Do two trees train the same weights? Runs each stage on tiny GPT-2- and Llama-style models with
fixed seeds, on the CPU in fp32 with one thread, and prints a digest of every run's final weights
(and of its metric lines, timings left out). A reshaping that must not change behaviour gives the
same digests in both trees.

    python tests/audit/same_weights.py --out after.json
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src python tests/audit/same_weights.py --src /tmp/before/src \
        --models after.json.models --out before.json
    python tests/audit/same_weights.py --compare before.json after.json

The models, prompts and preference files are built once (under `<out>.models`) and reused by the
other tree (`--models`), so both train from the same bytes. Digests compare trees on one machine:
bit-identity holds for the same computation (tests/processes.py), and another CPU, or another
thread count, may round the same run otherwise, so record both sides where they are compared. `--only NAME,...` runs some cases.
Each case is a real `python -m tether` process, so the CLI, the config and the run directory are
in the comparison too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene "
         "film story music ending long short loved hated it and but very quite").split()

REWARD = '''
import asyncio


def score(prompts, responses):
    return [sum(w in r for w in ("good", "great", "fun")) - 0.1 * len(r.split())
            for r in responses]


async def score_async(prompts, responses):  # the reward pool's async def path
    await asyncio.sleep(0)
    return score(prompts, responses)


class TwoTurns:
    """An environment of two turns: an observation after the first, the reward on the second."""

    def reset(self, row, seed):
        self.turns = 0
        return row["prompt"]

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return " and then", 0.1 * len(action.split()), False
        return None, float(sum(w in action for w in ("good", "great", "fun"))), True


def make_env():
    return TwoTurns()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
'''

# Each case: (stage, model, flags). The first four are the issue's; the rest cover the paths the
# reshaping touches (engines aside): micro-batches, several epochs and minibatches, the exact KL,
# the GRPO-family losses, truncation masking and penalties, dynamic sampling, a shared critic,
# LoRA with a LoRA critic, reinforce++, evaluation during training.
ONLINE = ["--total-episodes", "16", "--batch-size", "8", "--max-new-tokens", "6",
          "--save-every", "0", "--sample-every", "0", "--lr", "1e-3"]
CASES = {
    "ppo-gae": ("ppo", ["--ppo-epochs", "2", "--num-minibatches", "2", "--critic", "separate"]),
    "grpo": ("grpo", []),
    "rloo-kl-loss": ("rloo", ["--kl-in", "loss"]),
    "dpo": ("dpo", []),
    "ppo-micro-shared": ("ppo", ["--ppo-epochs", "2", "--micro-batch-size", "2",
                                 "--critic", "shared", "--kl-estimator", "k3"]),
    "grpo-exact-micro": ("grpo", ["--kl-estimator", "exact", "--micro-batch-size", "4",
                                  "--ppo-epochs", "2"]),
    "grpo-cispo-gspo": ("grpo", ["--policy-loss", "cispo", "--clip-high", "4",
                                 "--importance-level", "sequence", "--ppo-epochs", "2",
                                 "--loss-aggregation", "sequence"]),
    # some responses end at a stop string, the rest run out: without them every response was
    # truncated and the case trained nothing (issue 33: it now fails, as such a run must)
    "grpo-truncated": ("grpo", ["--mask-truncated", "--overlong-penalty", "2",
                                "--stop-strings", "e", "a",
                                "--missing-eos-penalty", "0.5", "--ppo-epochs", "2",
                                "--num-minibatches", "2", "--scale-rewards", "batch"]),
    "grpo-dynamic": ("grpo", ["--dynamic-sampling", "2", "--stop-strings", "."]),
    "ppo-lora": ("ppo", ["--lora-r", "4", "--ppo-epochs", "2", "--target-kl", "0.05",
                         "--kl-ctl", "adaptive", "--kl-target", "1"]),
    "reinforce-eval": ("ppo", ["--advantage", "reinforce++", "--eval-prompts", "{prompts}",
                               "--eval-every", "1", "--gold-fn", "{reward}",
                               "--score-norm", "running"]),
    "grpo-lora-onepass": ("grpo", ["--lora-r", "4", "--kl-estimator", "k2",
                                   "--temperature", "0.7"]),
    # what the last round added (issue 43): episodes of two turns (an environment's reward, no
    # --reward-fn), tools on a tool-calling template, batches sampled two ahead, packed
    # forwards cut by tokens, the reward pool calling an async def function
    "grpo-env-two-turns": ("grpo", ["--env", "{env}", "--max-turns", "2",
                                    "--stop-strings", "e", "a", "--ppo-epochs", "2"]),
    "grpo-tools": ("grpo", ["--tools", "{tools}", "--max-turns", "3", "--max-prompt-len", "2048",
                            "--max-new-tokens", "12", "--stop-strings", "<tool_call>", "e"],
                   ("qwen2-tools",)),
    "grpo-ahead-2": ("grpo", ["--max-staleness", "2", "--generator-threads", "1",
                              "--total-episodes", "32"]),
    "ppo-pack-tokens": ("ppo", ["--pack", "--micro-batch-tokens", "40", "--ppo-epochs", "2"]),
    "grpo-pool-async": ("grpo", ["--reward-fn", "{async_reward}", "--reward-workers", "4"]),
}
MODELS = ("gpt2", "llama")


def texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "."
            for _ in range(n)]


def build_inputs(root: Path) -> None:
    """Models and data, once: both trees read these bytes."""
    from tether.models.tiny import save_tiny, save_tiny_llama, save_tiny_qwen2

    root.mkdir(parents=True, exist_ok=True)
    save_tiny(root / "gpt2", texts(), vocab_size=300)
    save_tiny_llama(root / "llama", texts(), vocab_size=300)
    save_tiny_qwen2(root / "qwen2-tools", texts(), vocab_size=300, tools=True)
    rng = random.Random(1)
    prompts = ["the movie was", "a film", "it", "the plot", "the actor", "music and",
               "the ending", "very"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in prompts))
    prefs = [{"prompt": rng.choice(prompts), "chosen": " good fun great.",
              "rejected": " " + " ".join(rng.choice(WORDS) for _ in range(4)) + "."}
             for _ in range(16)]
    (root / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prefs))
    (root / "reward.py").write_text(REWARD)


def command(stage: str, model: str, flags: list[str], root: Path, out: Path,
            name: str) -> list[str]:
    code = root / "reward.py"
    flags = [f.format(prompts=root / "prompts.jsonl", reward=f"{code}:score",
                      async_reward=f"{code}:score_async", env=f"{code}:make_env",
                      tools=f"{code}:add") for f in flags]
    common = ["--run-name", name, "--output-dir", str(out), "--device", "cpu", "--threads", "1",
              "--seed", "3"]
    if stage == "dpo":
        return [stage, "--model", str(root / model), "--data", str(root / "prefs.jsonl"),
                "--epochs", "2", "--batch-size", "4", *common, *flags]
    reward = [] if "--env" in flags or "--reward-fn" in flags else ["--reward-fn", f"{code}:score"]
    return [stage, "--policy", str(root / model), "--prompts", str(root / "prompts.jsonl"),
            *reward, *ONLINE, *common, *flags]


def digest_run(run: Path) -> dict[str, str]:
    final = run / "final"
    weights = hashlib.sha256()
    for path in sorted(final.glob("*.safetensors")):
        weights.update(path.name.encode())
        weights.update(path.read_bytes())
    metrics = hashlib.sha256()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    for line in lines:
        row = json.loads(line)
        row = {k: v for k, v in row.items() if not k.startswith("perf/") and k != "time"}
        metrics.update(json.dumps(row, sort_keys=True).encode())
    return {"weights": weights.hexdigest()[:16], "metrics": metrics.hexdigest()[:16],
            "metric_lines": str(len(lines))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "src"))
    parser.add_argument("--models", default="", help="inputs built by an earlier run")
    parser.add_argument("--out", default="same_weights.json")
    parser.add_argument("--only", default="")
    parser.add_argument("--compare", nargs=2, default=None)
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        same = 0
        for case in sorted(set(before) | set(after)):
            verdict = "same" if before.get(case) == after.get(case) else "DIFFERENT"
            same += verdict == "same"
            print(f"{case:32s} {verdict}  {before.get(case)}  {after.get(case)}")
        print(f"{same} of {len(set(before) | set(after))} identical")
        sys.exit(0 if same == len(set(before) | set(after)) else 1)
    src = Path(args.src).resolve()
    sys.path.insert(0, str(src))
    root = Path(args.models or args.out + ".models").resolve()
    if not (root / "reward.py").exists():
        build_inputs(root)
    out = Path(args.out + ".runs").resolve()
    shutil.rmtree(out, ignore_errors=True)  # every case starts a fresh run
    env = os.environ | {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    wanted = set(args.only.split(",")) if args.only else None
    results = {}
    for case, (stage, flags, *models) in CASES.items():
        for model in (models[0] if models else MODELS):
            name = f"{case}-{model}"
            if wanted and case not in wanted and name not in wanted:
                continue
            argv = [sys.executable, "-m", "tether",
                    *command(stage, model, flags, root, out, name)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                results[name] = {"failed": done.stderr.strip().splitlines()[-1][:200]}
                continue
            results[name] = digest_run(out / name)
            print(name, results[name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
