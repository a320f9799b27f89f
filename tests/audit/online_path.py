"""Which of tether's source files one online batch passes through, from the rollout to the
optimizer step: what a reader opens to follow rollout -> reward -> KL shaping -> advantages ->
loss -> step.

    python tests/audit/online_path.py                 # this tree's src/
    PYTHONPATH=/other/tree/src python tests/audit/online_path.py --src /other/tree/src

Runs two tiny online runs (a GPT-2-style model built here, a Python reward): `ppo` (GAE with a
critic, 2 epochs: the two-pass path) and `grpo` (one step per batch: the one-pass path). A
profile hook records every tether file with a function entered between the first call of the
loop's `rollout_batch` (a rollout source's `collect`, since the loop draws from sources) and
the first call of the KL controller's `update` (step 5, after the
step); model loading and setup before it are not counted. Prints the files of each run and of
both together, with their lines. The trees it compares need only share `tether.train.ppo.run` and
`rollout_batch` or `collect`, which every layout since the online loop was written has.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def tiny_model(root: Path) -> Path:
    try:
        from tether.models.tiny import save_tiny
    except ImportError:  # a tree from before the layers
        from tether.tiny import save_tiny
    words = "the movie was good bad great fine dull fun plot actor scene film story".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 6)) + "."
             for i in range(300)]
    return Path(save_tiny(root / "model", texts, vocab_size=300))


def files_of_one_batch(src: Path, root: Path, stage: str, model: Path) -> set[str]:
    from tether.train import ppo, ppo_config

    root.mkdir(parents=True, exist_ok=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ("the movie was", "a film", "it", "the plot")))
    config = {"ppo": ppo_config.PPOConfig, "grpo": ppo_config.GRPOConfig}[stage]
    extra = {"ppo_epochs": 2} if stage == "ppo" else {}
    cfg = config(run_name=stage, output_dir=str(root / "runs"), policy=str(model),
                 prompts=str(prompts), batch_size=8, total_episodes=8, max_new_tokens=4,
                 device="cpu", save_every=0, sample_every=0, report_to="none", **extra)
    seen: set[str] = set()
    state = {"on": False, "done": False}

    def hook(frame, event, _arg):
        if event != "call" or state["done"]:
            return
        code = frame.f_code
        if (code.co_name == "rollout_batch" and code.co_filename.endswith("ppo.py")
                or code.co_name == "collect" and code.co_filename.endswith("sources.py")):
            state["on"] = True
        elif code.co_name == "update" and state["on"] and "kl" in Path(code.co_filename).stem:
            state["done"] = True
        elif state["on"] and code.co_filename.startswith(str(src)):
            seen.add(str(Path(code.co_filename).relative_to(src)))
    sys.setprofile(hook)
    try:
        ppo.run(cfg, reward_fn=lambda prompts, responses: [len(r) / 10 for r in responses])
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "src"))
    args = parser.parse_args()
    src = Path(args.src).resolve()
    sys.path.insert(0, str(src))
    import tether

    assert Path(tether.__file__).resolve().is_relative_to(src), tether.__file__
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_model(root)
        runs = {stage: files_of_one_batch(src / "tether", root / stage, stage, model)
                for stage in ("ppo", "grpo")}
    package = src / "tether"

    def lines(files: set[str]) -> int:
        return sum(len((package / f).read_text(encoding="utf-8").splitlines()) for f in files)
    for stage, files in runs.items():
        print(f"{stage}: {len(files)} files, {lines(files)} lines: {', '.join(sorted(files))}")
    both = set().union(*runs.values())
    print(f"both: {len(both)} files, {lines(both)} lines")


if __name__ == "__main__":
    main()
