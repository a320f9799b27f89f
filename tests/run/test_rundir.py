import json
from dataclasses import dataclass

import pytest
import yaml

from tether.errors import TetherError
from tether.run.atomic import json_lines
from tether.run.config import RunConfig
from tether.run.rundir import RunDir, progress


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
    assert [m["step"] for _, m in json_lines(again.metrics_path)] == [1, 2]
    again.close()


def test_progress_off_terminal_prints_plain_lines(capsys):
    bar = progress(total=40, desc="sft r")  # pytest captures stderr, so it is not a TTY
    for step in range(40):
        bar.set_postfix(loss=f"{4.0 - step / 10:.2f}")
        bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 20  # one per twentieth of the run
    assert lines[0].startswith("sft r: step 2/40 loss=3.90 elapsed 0:00:0")
    assert lines[-1].startswith("sft r: step 40/40 loss=0.10") and "eta 0:00:00" in lines[-1]
