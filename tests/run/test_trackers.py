"""--report-to: TensorBoard, wandb (offline) and MLflow (a local file store) receive the metrics
that metrics.jsonl has, and bad tracker names fail before anything runs."""

from __future__ import annotations

import json

import pytest
from offline_fixtures import sft_rows, write_jsonl

from tether.cli import main


def test_every_tracker_gets_the_metrics(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(8))
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "t",
                 "--output-dir", str(tmp_path / "runs"), "--max-steps", "3", "--batch-size", "4",
                 "--log-every", "1", "--device", "cpu",
                 "--report-to", "tensorboard,wandb,mlflow"]) == 0
    run_dir = tmp_path / "runs" / "t"
    losses = [json.loads(x)["train/loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    # wandb offline: the run's record file holds every logged value (as JSON text), for
    # `wandb sync` to upload later
    (record,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    content = record.read_bytes()
    assert b"train/loss" in content
    assert all(json.dumps(loss).encode() in content for loss in losses)
    # MLflow: the whole loss history, read back through its client
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tether").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train.loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(losses)
    assert run.data.params["max_steps"] == "3" and run.info.run_name == "t"


@pytest.mark.parametrize("value, message", [
    ("comet", "'comet' is not a tracker"),
    ("tensorboard,neptune", "'neptune' is not a tracker"),
])
def test_bad_tracker_is_one_line(value, message, tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(4))
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "t",
                 "--output-dir", str(tmp_path / "runs"), "--report-to", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "runs").exists()


def test_none_writes_only_metrics_jsonl(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(4))
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "t",
                 "--output-dir", str(tmp_path / "runs"), "--max-steps", "1", "--batch-size", "4",
                 "--device", "cpu", "--report-to", "none"]) == 0
    run_dir = tmp_path / "runs" / "t"
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / "tb").exists()
