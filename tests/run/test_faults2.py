"""Faults at the end of a run and resumes that must not mix two runs (issue 23).

- A full disk while `final/` or `merged/` is written (safetensors raises its own SafetensorError,
  not an OSError) is one `error:` line that says how to complete the run, and nothing
  half-written is left; `--resume` then completes the run, bit-identical to one that never
  failed. A run is finished only when everything it promised is on disk.
- The checkpoints carry the run's config and stage, so a resume is checked even when config.yaml
  was deleted or edited, and a run of one stage is never continued by another.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
import yaml
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from safetensors.torch import load_file

from tether.cli import main

# safetensors' message for a full disk, as `tether sft --merge-lora` printed it on a 700 kB tmpfs
DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(capsys, code, pattern):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def _weights(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out |= {f"{path.name}:{k}": v for k, v in load_file(str(path)).items()}
    return out


def _same_weights(a, b):
    ta, tb = _weights(a), _weights(b)
    assert ta and ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_data")
    write_jsonl(root / "sft.jsonl", sft_rows(12))
    write_jsonl(root / "prefs.jsonl", preference_rows(12))
    # rows both SFT and DPO can read: one data path for a DPO run and an SFT resume of it
    write_jsonl(root / "both.jsonl", [r | {"response": r["chosen"]} for r in preference_rows(12)])
    return root


def _fill_disk_under(monkeypatch, marker):
    """safetensors' writer fails like a full disk for files under a directory whose name
    contains `marker` (e.g. `.merged.tmp-`): half the bytes land, then SafetensorError."""
    import safetensors.torch as st
    from safetensors import SafetensorError

    real = st.serialize_file

    def serialize_file(tensors, filename, metadata=None):
        if marker in str(filename):
            with open(filename, "wb") as f:
                f.write(b"\0" * 64)  # what got written before the space ran out
            raise SafetensorError(DISK_FULL)
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(st, "serialize_file", serialize_file)


def _argv(stage, model, data, out, name, *extra):
    data_file = {"sft": "sft.jsonl", "rm": "prefs.jsonl", "dpo": "prefs.jsonl"}[stage]
    return [stage, "--model", str(model), "--data", str(data / data_file), "--run-name", name,
            "--output-dir", str(out), "--max-steps", "3", "--batch-size", "4", "--device", "cpu",
            "--save-every", "1", "--seed", "1", *extra]


LORA = ("--lora-r", "4", "--merge-lora")
DISK_CASES = [  # (stage, model fixture, where the disk fills, extra flags)
    ("sft", "tiny_model_dir", ".merged.tmp-", LORA),
    ("sft", "tiny_llama_dir", ".merged.tmp-", LORA),
    ("sft", "tiny_model_dir", ".final.tmp-", ()),
    ("dpo", "tiny_llama_dir", ".final.tmp-", LORA),
    ("rm", "tiny_model_dir", ".merged.tmp-", LORA),
]


@pytest.mark.parametrize("stage, model, where, extra", DISK_CASES,
                         ids=[f"{c[0]}-{c[1][5:-4]}-{c[2][1:-5]}" for c in DISK_CASES])
def test_a_full_disk_in_the_final_save_is_one_line_and_resume_completes_the_run(
        stage, model, where, extra, data, tmp_path, monkeypatch, capsys, request):
    model_dir = request.getfixturevalue(model)
    out = tmp_path / "runs"
    argv = _argv(stage, model_dir, data, out, "full", *extra)
    with monkeypatch.context() as patch:
        _fill_disk_under(patch, where)
        line = _one_error(capsys, main(argv), r"cannot write the final model of .*full: No space "
                          r"left on device; free space .* --resume")
    assert ("and merged/" in line) == ("--merge-lora" in extra)
    run = out / "full"
    # nothing half-written: no temp directory, no merged/ (and no final/ when that one failed)
    assert not list(run.glob(".*tmp-*")) and not (run / "merged").exists()
    assert (run / "final").exists() == (where == ".merged.tmp-")
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step_1", "step_2"]  # the last complete checkpoints are intact
    # the run is not finished: --resume goes on from step 2 and writes what was promised
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "already finished" not in err and f"resuming {run} from step 2" in err
    assert ("has final/ but not the merged/ it promised" in err) == (where == ".merged.tmp-")
    # ... the same as a run whose disk never filled
    assert main(_argv(stage, model_dir, data, out, "whole", *extra)) == 0
    for part in ("final", "merged") if extra else ("final",):
        _same_weights(run / part, out / "whole" / part)
    steps = [[json.loads(x)["step"] for x in (r / "metrics.jsonl").read_text().splitlines()]
             for r in (run, out / "whole")]
    assert steps[0] == steps[1]  # the re-run step logged once
    # and now it is finished
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "already finished" in capsys.readouterr().err


def test_ppo_with_a_full_disk_in_merged_is_completed_by_resume(tiny_llama_dir, tmp_path,
                                                              monkeypatch, capsys):
    """The online loop's final save (`save_policy`) goes through the same guard."""
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in sft_rows(8)])
    (tmp_path / "rewards.py").write_text(
        "def length(prompts, responses):\n    return [len(r) / 10 for r in responses]\n")
    out = tmp_path / "runs"

    def argv(name):
        return ["ppo", "--policy", str(tiny_llama_dir), "--prompts", str(tmp_path / "prompts.jsonl"),
                "--reward-fn", f"{tmp_path / 'rewards.py'}:length", "--batch-size", "4",
                "--total-episodes", "12", "--max-new-tokens", "3", "--lr", "1e-3", "--run-name",
                name, "--output-dir", str(out), "--device", "cpu", "--save-every", "1", *LORA]
    with monkeypatch.context() as patch:
        _fill_disk_under(patch, ".merged.tmp-")
        _one_error(capsys, main(argv("p")), r"cannot write the final model .*No space left on "
                   r"device.* writes final/ and merged/")
    assert (out / "p" / "final").exists() and not (out / "p" / "merged").exists()
    assert main([*argv("p"), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().err
    assert main(argv("whole")) == 0
    for part in ("final", "merged"):
        _same_weights(out / "p" / part, out / "whole" / part)


def test_an_os_error_in_the_final_save_is_the_same_line(data, tiny_model_dir, tmp_path,
                                                        monkeypatch, capsys):
    """A quota hit while the tokenizer files are written: an OSError, same line."""
    import errno
    import os

    from transformers import AutoTokenizer

    def no_quota(self, *args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "tokenizer.json")
    tokenizer_class = type(AutoTokenizer.from_pretrained(tiny_model_dir))
    monkeypatch.setattr(tokenizer_class, "save_pretrained", no_quota)
    argv = _argv("sft", tiny_model_dir, data, tmp_path / "runs", "quota")
    _one_error(capsys, main(argv), "cannot write the final model .*: Disk quota exceeded; .*--resume")
    assert not (tmp_path / "runs" / "quota" / "final").exists()


def test_finished_means_every_promised_output(data, tiny_model_dir, tmp_path, capsys):
    """final/ alone finishes a run without --merge-lora, also an old one whose config.yaml has
    no stage; with --merge-lora it needs merged/ too; config.yaml gone, the checkpoint says."""
    out = tmp_path / "runs"
    plain = _argv("sft", tiny_model_dir, data, out, "plain")
    merged = _argv("sft", tiny_model_dir, data, out, "merged", *LORA)
    assert main(plain) == 0 and main(merged) == 0
    config = out / "plain" / "config.yaml"
    old = yaml.safe_load(config.read_text())
    assert old.pop("stage") == "sft"
    config.write_text(yaml.safe_dump(old, sort_keys=False))  # as tether wrote it before stages
    for argv in (plain, merged):
        before = _snapshot(out)
        capsys.readouterr()
        assert main([*argv, "--resume"]) == 0
        assert "already finished" in capsys.readouterr().err
        assert _snapshot(out) == before
    import shutil

    from tether.run.rundir import run_finished

    run = out / "merged"
    kept = _weights(run / "merged")
    (run / "config.yaml").unlink()
    shutil.rmtree(run / "merged")
    assert not run_finished(run)  # the checkpoint says --merge-lora
    assert main([*merged, "--resume"]) == 0
    again = _weights(run / "merged")
    assert again.keys() == kept.keys() and all(torch.equal(again[k], kept[k]) for k in kept)


# ----------------------------------------------------------------------------- config and stage

def _partial(argv, out, name):
    """Run `argv` (a checkpoint after each step but the last), then take its final model and
    every checkpoint after step 2 away: a run stopped after step 2, resumable from there."""
    import shutil

    assert main(argv) == 0
    final = {k: v.clone() for k, v in _weights(out / name / "final").items()}
    shutil.rmtree(out / name / "final")
    for step in (out / name / "checkpoints").glob("step_*"):
        if int(step.name[5:]) > 2:
            shutil.rmtree(step)
    return final


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_deleted_config_yaml_is_checked_against_the_checkpoint(model, data, tmp_path, capsys,
                                                                 request):
    model_dir = request.getfixturevalue(model)
    out = tmp_path / "runs"
    argv = _argv("sft", model_dir, data, out, "c", "--lr", "1e-3")
    final = _partial(argv, out, "c")
    config = out / "c" / "config.yaml"
    saved = config.read_bytes()
    config.unlink()
    before = _snapshot(out)
    capsys.readouterr()
    line = _one_error(capsys, main([*argv, "--resume", "--lr", "5e-2"]),
                      r"--resume with a different config would mix two runs \(lr: 0.001 -> 0.05\)")
    assert "config.yaml is missing" in line
    assert _snapshot(out) == before  # nothing written, config.yaml not recreated
    # the same settings resume it; config.yaml comes back as it was, the result is the same
    assert main([*argv, "--resume"]) == 0
    assert config.read_bytes() == saved
    assert "was missing: written again" in capsys.readouterr().err
    trained = _weights(out / "c" / "final")
    assert trained.keys() == final.keys() and all(torch.equal(trained[k], final[k]) for k in final)


def test_an_edited_config_yaml_cannot_hide_a_change(data, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = _argv("sft", tiny_model_dir, data, out, "e", "--lr", "1e-3")
    _partial(argv, out, "e")
    config = out / "e" / "config.yaml"
    config.write_text(config.read_text().replace("lr: 0.001", "lr: 0.05"))
    before = _snapshot(out)
    line = _one_error(capsys, main([*argv, "--resume", "--lr", "5e-2"]),
                      r"would mix two runs \(lr: 0.001 -> 0.05\)")
    assert "config recorded in" in line
    assert _snapshot(out) == before


def test_a_deleted_config_yaml_and_checkpoints_without_a_record_is_refused(data, tiny_model_dir,
                                                                           tmp_path, capsys):
    """Checkpoints from before they carried the config: nothing to check a resume against."""
    out = tmp_path / "runs"
    argv = _argv("sft", tiny_model_dir, data, out, "old")
    _partial(argv, out, "old")
    (out / "old" / "config.yaml").unlink()
    for state in (out / "old" / "checkpoints").glob("step_*/state.json"):
        payload = json.loads(state.read_text())
        del payload["config"]
        state.write_text(json.dumps(payload))
    before = _snapshot(out)
    _one_error(capsys, main([*argv, "--resume"]), "config.yaml is missing and the checkpoints .* "
               "record no config .* put config.yaml back")
    assert _snapshot(out) == before


def test_a_dpo_run_is_not_resumed_as_sft(data, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    common = ["--model", str(tiny_model_dir), "--data", str(data / "both.jsonl"), "--run-name",
              "x", "--output-dir", str(out), "--max-steps", "3", "--batch-size", "4", "--device",
              "cpu", "--save-every", "1", "--lr", "1e-4"]
    _partial(["dpo", *common], out, "x")
    assert yaml.safe_load((out / "x" / "config.yaml").read_text())["stage"] == "dpo"
    state = json.loads((out / "x" / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["config"]["stage"] == "dpo"
    before = _snapshot(out)
    _one_error(capsys, main(["sft", *common, "--resume"]),
               r"x is a tether dpo run .*resume it with tether dpo")
    assert _snapshot(out) == before
    # config.yaml deleted: the checkpoint's record says the same
    (out / "x" / "config.yaml").unlink()
    before = _snapshot(out)
    _one_error(capsys, main(["sft", *common, "--resume"]), r"is a tether dpo run \(the config "
               r"recorded in .*checkpoints")
    assert _snapshot(out) == before


def test_an_old_run_without_a_stage_is_told_by_its_fields(data, tiny_model_dir, tmp_path,
                                                          capsys):
    """Before stages were recorded: a DPO config has fields (beta, loss, ...) SFT has not, so
    `tether sft --resume` is refused; `tether dpo --resume` goes on as before."""
    out = tmp_path / "runs"
    common = ["--model", str(tiny_model_dir), "--data", str(data / "both.jsonl"), "--run-name",
              "old", "--output-dir", str(out), "--max-steps", "4", "--batch-size", "4",
              "--device", "cpu", "--save-every", "1", "--lr", "1e-4"]
    final = _partial(["dpo", *common], out, "old")
    config = out / "old" / "config.yaml"
    old = yaml.safe_load(config.read_text())
    del old["stage"]
    config.write_text(yaml.safe_dump(old, sort_keys=False))
    for state in (out / "old" / "checkpoints").glob("step_*/state.json"):
        payload = json.loads(state.read_text())
        del payload["config"]  # checkpoints from before they carried it
        state.write_text(json.dumps(payload))
    before = _snapshot(out)
    _one_error(capsys, main(["sft", *common, "--resume"]),
               r"was made by another stage than tether sft \(its config has beta, label_smoothing")
    assert _snapshot(out) == before
    assert main(["dpo", *common, "--resume"]) == 0
    resumed = _weights(out / "old" / "final")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    # the checkpoint written since (step 3) carries the config with the stage; config.yaml
    # stays as the run wrote it
    state = json.loads((out / "old" / "checkpoints" / "step_3" / "state.json").read_text())
    assert state["config"] == {"stage": "dpo"} | old
    assert "stage" not in yaml.safe_load(config.read_text())


def test_a_run_config_yaml_is_a_valid_config_file_for_its_own_stage(data, tiny_model_dir,
                                                                    tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(_argv("sft", tiny_model_dir, data, out, "src")) == 0
    saved = out / "src" / "config.yaml"
    assert main(["sft", "--config", str(saved), "--run-name", "again"]) == 0
    _same_weights(out / "src" / "final", out / "again" / "final")
    before = _snapshot(out)
    _one_error(capsys, main(["dpo", "--config", str(saved), "--run-name", "d"]),
               r"is the config of a tether sft run \(stage: sft\), not dpo; pass it to tether sft")
    assert _snapshot(out) == before
