"""A LoRA run's checkpoints hold only its adapters, so `--resume` loads the base again by path:
if that path (or a hub name's revision) now holds another model, the resume is refused with one
line, before anything is written (the checkpoints carry the base's record; issue 23)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from refusals import snapshot

from tether.cli import main


def _nudged_copy(src, dst):
    """`src` saved again at `dst` with every weight moved by 1e-3: the same shapes, another model."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    model.save_pretrained(dst)


def _stage_argv(stage, base, root):
    common = ["--run-name", "r", "--output-dir", str(root / "runs"), "--device", "cpu",
              "--lora-r", "4", "--save-every", "1", "--report-to", "none"]
    if stage == "sft":
        return ["sft", "--model", str(base), "--data", str(root / "sft.jsonl"), "--max-steps", "2",
                "--batch-size", "4", *common]
    return ["grpo", "--policy", str(base), "--reward-fn", f"{root / 'reward.py'}:score",
            "--prompts", str(root / "prompts.jsonl"), "--total-episodes", "8", "--batch-size",
            "4", "--samples-per-prompt", "2", "--max-new-tokens", "4", *common]


@pytest.mark.parametrize("stage", ["sft", "grpo"])
@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_resume_on_another_base_is_refused(stage, family, request, tmp_path, capsys):
    model_dir = request.getfixturevalue(family)
    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                    for p in ("the movie", "it was")))
    (tmp_path / "reward.py").write_text("def score(p, r):\n    return [len(x) / 10 for x in r]\n")
    argv = _stage_argv(stage, base, tmp_path)
    assert main(argv) == 0
    run = tmp_path / "runs" / "r"
    shutil.rmtree(run / "final")  # cut short after its checkpoints
    saved = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert saved["state"]["lora_base"]["base"] == str(base)
    _nudged_copy(model_dir, base)  # another model saved over the base's path
    # The check needs the base loaded, so it comes once the run's lock is taken: .lock's holder
    # record is rewritten, nothing else (the results, the checkpoints) may change.
    before = {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(".lock")}
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert re.match(r"error: the base model .*/base is not the one the LoRA checkpoints in "
                    r".*/checkpoints were trained on \(.*/base\): the same shapes but other "
                    r"weights", err), err
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(".lock")} == before
    shutil.copytree(model_dir, base, dirs_exist_ok=True)  # the base put back: resumes
    assert main(argv + ["--resume"]) == 0 and (run / "final").is_dir()
