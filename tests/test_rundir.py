import json
from dataclasses import dataclass

import pytest
import yaml

from tether.config import RunConfig
from tether.errors import TetherError
from tether.rundir import RunDir, progress


@dataclass(kw_only=True)
class Cfg(RunConfig):
    lr: float = 0.1


def test_layout_metrics_and_tensorboard(tmp_path):
    run = RunDir(tmp_path, "r1")
    run.save_config(Cfg(run_name="r1"))
    run.log(1, {"train/loss": 2.0})
    run.log(2, {"train/loss": 1.5})
    run.log_text(2, "samples", "| a | b |")
    run.close()
    assert yaml.safe_load((run.path / "config.yaml").read_text())["lr"] == 0.1
    lines = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}]
    assert list((run.path / "tb").glob("events.out.tfevents.*"))


def test_refuses_to_overwrite_results(tmp_path):
    run = RunDir(tmp_path, "r1")
    assert not run.path.exists()  # checked, not created: a start-up error leaves nothing
    run.save_config(Cfg(run_name="r1"))
    run.log(1, {"x": 1.0})
    run.close()
    with pytest.raises(TetherError, match="already has results.*--resume"):
        RunDir(tmp_path, "r1")
    again = RunDir(tmp_path, "r1", resume=True)
    again.log(2, {"x": 2.0})
    again.log(3, {"x": 3.0})
    again.truncate_metrics(after_step=2)
    assert [m["step"] for m in again.read_metrics()] == [1, 2]
    again.close()


def test_progress_bar_silent_off_terminal(capsys):
    bar = progress(total=3, desc="t")  # pytest captures stderr, so it is not a TTY
    bar.update(2)
    bar.close()
    assert bar.total == 3 and bar.disable
    assert capsys.readouterr().err == ""
