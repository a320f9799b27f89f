"""The README's block of stage commands runs as printed, on a machine with no hub: its first line
builds the tiny model every later line starts from (issue 47, the new user's path). Each command
runs as a user types it (a `tether` subprocess in a directory holding the data files it names),
with only sizes appended so that the block takes a minute: steps, batches and new tokens."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TETHER = [sys.executable, "-c", "import sys; from tether.cli import main; sys.exit(main())"]

# Sizes only: what each command computes is the README's.
SMALL = {"sft": "--max-steps 2 --batch-size 2", "rm": "--max-steps 2 --batch-size 2",
         "dpo": "--max-steps 2 --batch-size 2",
         "ppo": "--total-episodes 4 --batch-size 2 --max-new-tokens 4",
         "grpo": "--total-episodes 8 --batch-size 4 --samples-per-prompt 2 --max-new-tokens 4",
         "distill": "--total-episodes 4 --batch-size 2 --max-new-tokens 4",
         "eval": "--max-new-tokens 4", "generate": "--max-new-tokens 4",
         "bon": "--n 2 --max-new-tokens 4", "interpolate": "--max-new-tokens 4"}
# Not run here, each tested where it lives: a sweep trains its grid (tests/tools/test_sweep.py),
# serve-rm serves until stopped (tests/rl/test_reward_server.py), and set-base's path is a
# placeholder for the user's own base.
ELSEWHERE = {"sweep", "serve-rm", "set-base"}
TRAINING = {"sft", "rm", "dpo", "ppo", "grpo", "distill"}


def readme_stage_commands() -> list[list[str]]:
    """The commands of the README's block that starts with `tether tiny-model`, continuation
    lines joined and comments dropped."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S)
                 if b.startswith("tether tiny-model"))
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            assert words[0] == "tether", line
            commands.append(words[1:])
    return commands


def write_data(root: Path) -> None:
    """The files the block names, in the formats its comments give."""
    words = "the film was good bad dull fine and the plot long short".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(4)) for i in range(16)]
    rows = {"sft.jsonl": [{"prompt": t, "response": " good."} for t in texts],
            "prefs.jsonl": [{"prompt": t, "chosen": " good.", "rejected": " bad."}
                            for t in texts],
            "prompts.jsonl": [{"prompt": t} for t in texts],
            "eval.jsonl": [{"prompt": t} for t in texts[:4]]}
    for name, table in rows.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in table))
    (root / "rewards.py").write_text(
        "def score(prompts, responses):\n    return [float('good' in r) for r in responses]\n")
    (root / "task.py").write_text(
        "def gold(prompts, responses):\n    return [-float(len(r)) for r in responses]\n")


@pytest.mark.slow
def test_the_readme_stage_commands_run_offline(tmp_path):
    commands = readme_stage_commands()
    assert commands[0][:1] == ["tiny-model"]  # the block starts from a model built here
    write_data(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    ran = []
    for words in commands:
        if words[0] in ELSEWHERE:
            continue
        extra = shlex.split(SMALL.get(words[0], ""))
        if words[0] in TRAINING:
            extra += ["--report-to", "none"]  # metrics.jsonl only, whatever trackers are installed
        done = subprocess.run(TETHER + words + extra, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"tether {shlex.join(words)}:\n{done.stderr[-3000:]}"
        ran.append(words[0])
    assert ran == ["tiny-model", "sft", "rm", "rm", "ppo", "dpo", "grpo", "distill", "ppo",
                   "eval", "generate", "bon", "interpolate", "report"]
    # what each stage wrote, where the next line looks for it
    for run in ("sft", "rm", "ppo", "ipo", "grpo", "distill"):
        assert (tmp_path / "runs" / run / "final").is_dir(), run
    assert (tmp_path / "runs" / "rm-ens" / "final" / "tether_ensemble.json").is_file()
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / "compare.html").stat().st_size > 0
    assert [p["n"] for p in json.loads((tmp_path / "bon.json").read_text())] == [1, 2]
    assert (tmp_path / "line" / "interpolate.json").is_file()
