"""If the reference moves, how far does the policy go from the SFT model? (docs/ppo.md, "Moving
references"). open-instruct #546 asks whether a reference updated very frequently is the same as
no reference at all; this measures it on the demo's task, where the gold reward (well-formed text
scored by VADER) shows reward hacking that the proxy reward model does not.

    python bench/moving_refs.py [--batches 60] [--seeds 3] [--every 5,20] [--alpha 0.5] [--out DIR]

The demo's data, SFT model and reward model are built once (tether.demo: the same settings), then
PPO runs with the demo's fixed beta under each anchor: none (beta 0: no penalty), fixed (the SFT
model), reset:N and mix:ALPHA,N at two frequencies N, each with --seeds seeds. It prints, per
setting, the KL of the policy to the SFT model (`objective/kl_sft`; the KL to the anchor where the
anchor is the SFT model), the held-out proxy and gold at the end, and at a few batches between,
each as the mean over seeds with its standard error; and writes moving_refs.png (the three against
batches) and moving_refs.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import tether  # noqa: F401 - first: its guard hides a mismatched torchvision before transformers


def settings(every: list[int], alpha: float) -> dict[str, dict]:
    out = {"no penalty": {"beta": 0.0}, "fixed": {}}
    for n in every:
        out[f"reset:{n}"] = {"ref_update": f"reset:{n}"}
    for n in every:
        out[f"mix:{alpha:g},{n}"] = {"ref_update": f"mix:{alpha:g},{n}"}
    return out


def kl_to_sft(line: dict) -> float | None:
    """The batch's KL of pi_old to the SFT model: logged as such when the anchor moves, else the
    exact KL to the anchor, which is then the SFT model."""
    return line.get("objective/kl_sft_exact", line.get("objective/kl_exact"))


def one_run(root: Path, name: str, seed: int, fields: dict, extra: dict) -> dict[str, list]:
    from tether.train import ppo

    run_name = f"{name}-seed{seed}".replace(":", "_").replace(",", "_")
    ppo.run(ppo.PPOConfig(run_name=run_name, output_dir=str(root / "runs"), seed=seed,
                          **(fields | extra)))
    lines = [json.loads(x) for x in (root / "runs" / run_name / "metrics.jsonl").read_text()
             .splitlines()]
    curve = {"batch": [], "kl_sft": [], "eval_batch": [], "proxy": [], "gold": []}
    for line in lines:
        if kl_to_sft(line) is not None and line["step"] > 0:
            curve["batch"].append(line["step"])
            curve["kl_sft"].append(kl_to_sft(line))
        if "eval/score" in line:
            curve["eval_batch"].append(line["step"])
            curve["proxy"].append(line["eval/score"])
            curve["gold"].append(line["eval/gold_score"])
    return curve


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


def table(results: dict[str, list[dict]], at: list[int]) -> list[str]:
    rows = [f"{'setting':<14}" + "".join(f"{'KL@' + str(b):>16}" for b in at)
            + f"{'proxy (end)':>16}{'gold (end)':>16}"]
    for name, curves in results.items():
        cells = []
        for b in at:
            m, se = mean_se([c["kl_sft"][c["batch"].index(b)] for c in curves])
            cells.append(f"{m:>9.2f} +- {se:<4.2f}")
        for key in ("proxy", "gold"):
            m, se = mean_se([c[key][-1] for c in curves])
            cells.append(f"{m:>9.3f} +- {se:<4.3f}")
        rows.append(f"{name:<14}" + "".join(f"{c:>16}" for c in cells))
    return rows


def figure(results: dict[str, list[dict]], path: Path) -> None:
    from tether.tools.report import plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, curves in results.items():
        for ax, (x, y, label) in zip(axes, (("batch", "kl_sft", "KL to the SFT model (nats)"),
                                           ("eval_batch", "proxy", "held-out proxy reward"),
                                           ("eval_batch", "gold", "held-out gold reward"))):
            xs = curves[0][x]
            ys = [statistics.fmean(c[y][i] for c in curves) for i in range(len(xs))]
            ax.plot(xs, ys, label=name)
            ax.set_xlabel("batch")
            ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--every", default="5,20", help="the two frequencies N, in batches")
    parser.add_argument("--alpha", type=float, default=0.5, help="mix's ALPHA")
    parser.add_argument("--out", default="", help="where runs and results go (default: a temp dir)")
    args = parser.parse_args()
    from tether.demo.config import DemoConfig
    from tether.demo.data import prepare_data
    from tether.demo.pipeline import ppo_fields, train_sft_and_rm

    root = Path(args.out or tempfile.mkdtemp(prefix="moving_refs_"))
    root.mkdir(parents=True, exist_ok=True)
    demo = DemoConfig(output_dir=str(root), seed=0)
    started = time.perf_counter()
    paths = prepare_data(root, demo)
    policy, reward_model = train_sft_and_rm(root / "runs", demo, paths)
    fields = ppo_fields(demo, paths, policy, reward_model, args.batches) | {
        "kl_ctl": "fixed", "beta": demo.fixed_beta, "eval_every": max(1, args.batches // 6),
        "save_every": 0}
    every = [int(n) for n in args.every.split(",")]
    results = {name: [one_run(root, name, demo.seed + s, fields, extra)
                      for s in range(args.seeds)]
               for name, extra in settings(every, args.alpha).items()}
    at = sorted({max(1, args.batches // 4), args.batches // 2, args.batches})
    print(f"demo task, {args.batches} batches of 32, beta {demo.fixed_beta} (none: 0), "
          f"{args.seeds} seeds (mean +- standard error); KL to the SFT model in nats per response")
    print("\n".join(table(results, at)))
    (root / "moving_refs.json").write_text(json.dumps(results))
    figure(results, root / "moving_refs.png")
    print(f"{time.perf_counter() - started:.0f} s; {root / 'moving_refs.png'}")


if __name__ == "__main__":
    main()
