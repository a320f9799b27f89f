"""Experiment trackers a run reports to (`--report-to tensorboard,wandb,mlflow`).

`metrics.jsonl` is always written (it is what resume and the reports read); trackers are extra
sinks. Each one is a small class with `log(step, metrics)`, `text(step, tag, text)` and `close()`,
created lazily at the first log line, so a run that fails its input checks starts none.

- auto (the default): tensorboard when the tensorboard package is installed, else none (the core
  install has no TensorBoard: `pip install -e '.[tensorboard]'`; `tether <stage>` says so at start).
- tensorboard: event files in `<run>/tb/`.
- wandb: `wandb.init(project="tether", name=<run name>, dir=<run>, config=<the run's config>)`.
  Offline with `WANDB_MODE=offline` (files in `<run>/wandb/`, `wandb sync` uploads them later).
- mlflow: a run named after tether's, its config as params, under `MLFLOW_TRACKING_URI` (default
  `<run>/mlruns`, a local file store; metric names use `.` for `/`, e.g. `train.loss`).
tensorboard, wandb and mlflow are extras of the same names (`tether.run.extras`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.run.extras import install_line, installed, require_tracker


def parse_report_to(value: str) -> list[str]:
    """`tensorboard,wandb` -> ["tensorboard", "wandb"]; `none` -> []; `auto` -> ["tensorboard"]
    when it is installed, else []. Checks names and that a tracker named outright is installed,
    so the error comes before the run starts."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    for name in names:
        if name not in (*TRACKERS, "auto"):
            raise TetherError(f"--report-to {name!r} is not a tracker; use a comma-separated list "
                              f"of {', '.join(TRACKERS)}, or auto, or none")
        require_tracker(name)
    resolved = [n for n in names if n != "auto"]
    if "auto" in names and "tensorboard" not in resolved and installed("tensorboard"):
        resolved.insert(0, "tensorboard")
    return resolved


def auto_note(value: str) -> str:
    """The note for a run whose `auto` finds no TensorBoard ("" otherwise): say where the metrics
    go instead, and how to get TensorBoard or silence the note."""
    names = [n.strip() for n in value.split(",")]
    if "auto" not in names or installed("tensorboard"):
        return ""
    return ("note: TensorBoard is not installed, so this run logs to metrics.jsonl only "
            f"({install_line('tensorboard')} adds TensorBoard events; --report-to none says no "
            "tracker outright)")


class TensorBoard:
    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # slow import: only when logging

        self.writer = SummaryWriter(log_dir=str(run_path / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandB:
    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]):
        import wandb

        # One wandb run per tether run: the id is stable (the run name and a digest of its
        # path), so a resumed run continues it.
        digest = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:8]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tether"), name=run_name,
                              id=f"{run_name}-{digest}",
                              dir=str(run_path), config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.run.log({tag: text}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_path / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 wants an opt-in for its (offline) file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("tether")
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment("tether"))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in config.items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.client.log_metric(self.run_id, key.replace("/", "."), value, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step_{step}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}  # --report-to's names
