"""--resume cannot lose or misrecord a run: config changes are refused or recorded, finished runs
are left alone, damaged checkpoints fall back to intact ones, cut-off writes are cleaned up, and
no non-finite weights are ever saved."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import yaml
from offline_fixtures import sft_rows, write_jsonl
from torch import nn

from tether.cli import main
from tether.errors import AlreadyFinished, TetherError
from tether.run.atomic import json_lines
from tether.run.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from tether.run.config import RunConfig
from tether.run.rundir import RunDir


@dataclass(kw_only=True)
class Cfg(RunConfig):
    lr: float = 0.1
    data: str = "a.jsonl"


def _started(tmp_path, **kw):
    run = RunDir(tmp_path, "r")
    run.save_config(Cfg(run_name="r", **kw))
    run.log(1, {"x": 1.0})
    run.close()
    return run


def test_resume_with_a_changed_result_field_is_refused_and_config_kept(tmp_path):
    run = _started(tmp_path)
    saved = run.config_path.read_bytes()
    again = RunDir(tmp_path, "r", resume=True)
    with pytest.raises(TetherError, match=r"data: 'a.jsonl' -> 'b.jsonl'; lr: 0.1 -> 0.2"):
        again.save_config(Cfg(run_name="r", lr=0.2, data="b.jsonl", resume=True))
    assert run.config_path.read_bytes() == saved


def test_harmless_changes_need_the_flag_and_are_recorded(tmp_path):
    run = _started(tmp_path)
    saved = run.config_path.read_bytes()
    with pytest.raises(TetherError, match="log_every: 10 -> 5.*--resume-allow-changes"):
        RunDir(tmp_path, "r", resume=True).save_config(Cfg(run_name="r", log_every=5, resume=True))
    RunDir(tmp_path, "r", resume=True).save_config(
        Cfg(run_name="r", log_every=5, resume=True, resume_allow_changes=True))
    assert run.config_path.read_bytes() == saved  # config.yaml still describes the run
    record = json.loads((run.path / "resumes.jsonl").read_text())
    assert record == {"changes": {"log_every": {"saved": 10, "now": 5}}}
    # The same settings as saved: nothing to record, no flag needed.
    RunDir(tmp_path, "r", resume=True).save_config(Cfg(run_name="r", resume=True))
    assert len((run.path / "resumes.jsonl").read_text().splitlines()) == 1



def test_a_run_that_recorded_the_former_report_to_default_resumes_with_todays(tmp_path):
    # report_to's default was tensorboard until TensorBoard became an extra; today's is auto.
    # A run started before, resumed with the default, is the same run: no flag, nothing recorded.
    run = _started(tmp_path, report_to="tensorboard")
    RunDir(tmp_path, "r", resume=True).save_config(Cfg(run_name="r", resume=True))
    assert not (run.path / "resumes.jsonl").exists()
    # any other change of it is still a change, and so is going back from auto to tensorboard
    with pytest.raises(TetherError, match="report_to: 'tensorboard' -> 'none'"):
        RunDir(tmp_path, "r", resume=True).save_config(
            Cfg(run_name="r", report_to="none", resume=True))
    (tmp_path / "r").rename(tmp_path / "old")
    _started(tmp_path)  # recorded auto
    with pytest.raises(TetherError, match="report_to: 'auto' -> 'tensorboard'"):
        RunDir(tmp_path, "r", resume=True).save_config(
            Cfg(run_name="r", report_to="tensorboard", resume=True))

def test_resume_messages(tmp_path, capsys):
    fresh = RunDir(tmp_path, "new", resume=True)
    fresh.save_config(Cfg(run_name="new", resume=True))
    fresh.announce_resume(None)
    assert capsys.readouterr().err.strip() == f"nothing to resume in {fresh.path}: starting fresh"
    run = _started(tmp_path)
    again = RunDir(tmp_path, "r", resume=True)
    again.announce_resume(None)
    assert "restarting it from step 0" in capsys.readouterr().err
    again.announce_resume(6)
    assert capsys.readouterr().err.strip() == f"resuming {run.path} from step 6"


def test_partial_metrics_line_and_temp_dirs_are_cleaned(tmp_path, capsys):
    run = _started(tmp_path)
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 2, "x": 2.')  # killed mid-write
    (run.path / ".final.tmp-abc").mkdir()
    (run.checkpoint_dir / ".tmp-step_4-xyz").mkdir(parents=True)
    again = RunDir(tmp_path, "r", resume=True)
    assert [m["step"] for _, m in json_lines(again.metrics_path)] == [1]
    again.save_config(Cfg(run_name="r", resume=True))
    again.truncate_metrics(after_step=1)
    assert run.metrics_path.read_text() == '{"step": 1, "x": 1.0}\n'
    assert not (run.path / ".final.tmp-abc").exists()
    assert not (run.checkpoint_dir / ".tmp-step_4-xyz").exists()
    assert capsys.readouterr().err.count("left by an interrupted write") == 2


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("damage", ["truncate_weights", "garbage_optimizer", "cut_state"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, damage, capsys):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, {"model": model}, opt, None, {"step": 1})
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    path = save_checkpoint(tmp_path, 2, {"model": model}, opt, None, {"step": 2})
    target = {"truncate_weights": "model.safetensors", "garbage_optimizer": "optimizer.pt",
              "cut_state": "state.json"}[damage]
    data = (path / target).read_bytes()
    (path / target).write_bytes(b"\x00garbage" if damage == "garbage_optimizer" else data[:len(data) // 2])
    fresh = _model(1)
    state = load_latest_checkpoint(tmp_path, {"model": fresh}, torch.optim.AdamW(fresh.parameters()),
                                   None)
    assert state["step"] == 1
    assert all(torch.equal(fresh.state_dict()[k], first[k]) for k in first)
    err = capsys.readouterr().err
    assert f"checkpoint {path} is damaged" in err and "falling back" in err


def test_all_checkpoints_damaged_is_one_error(tmp_path):
    model = _model(0)
    path = save_checkpoint(tmp_path, 1, {"model": model}, None, None, {"step": 1})
    (path / "state.json").write_text("{")
    with pytest.raises(TetherError, match="no checkpoint .* can be read"):
        load_latest_checkpoint(tmp_path, {"model": _model(1)}, None, None)


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    model = _model(0)
    save_checkpoint(tmp_path, 1, {"model": model}, None, None, {"step": 1})
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(TetherError, match="non-finite weights .*0.weight.*nothing was saved"):
        save_checkpoint(tmp_path, 2, {"model": model}, None, None, {"step": 2})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_finished_run_is_left_alone_on_resume(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", sft_rows(8))
    argv = ["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "done",
            "--output-dir", str(tmp_path / "runs"), "--max-steps", "2", "--batch-size", "4",
            "--device", "cpu"]
    assert main(argv) == 0
    run = tmp_path / "runs" / "done"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already finished" in err[0]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    with pytest.raises(AlreadyFinished):
        RunDir(tmp_path / "runs", "done", resume=True)
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 2


def test_a_field_added_since_the_run_started_is_no_change_at_its_default(tmp_path):
    run = _started(tmp_path)
    saved = yaml.safe_load(run.config_path.read_text())
    del saved["report_to"]  # as written by a tether without that field
    run.config_path.write_text(yaml.safe_dump(saved, sort_keys=False))
    RunDir(tmp_path, "r", resume=True).save_config(Cfg(run_name="r", resume=True))
    with pytest.raises(TetherError, match="report_to: None -> 'none'"):
        RunDir(tmp_path, "r", resume=True).save_config(Cfg(run_name="r", resume=True,
                                                           report_to="none"))
