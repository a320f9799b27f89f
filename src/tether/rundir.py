"""The run directory `runs/<name>/`: resolved config, metrics, TensorBoard events, checkpoints,
final model; plus the progress bar.

Layout::

    runs/<name>/config.yaml       the resolved config (YAML file + flags + defaults)
    runs/<name>/metrics.jsonl     one JSON object per logged step: {"step": N, "<metric>": value}
    runs/<name>/samples.jsonl     evaluation samples: {"step": N, "samples": [{prompt, response, ...}]}
    runs/<name>/tb/               TensorBoard events
    runs/<name>/checkpoints/      step_<N>/ (see tether.checkpoint)
    runs/<name>/final/            the trained model, Hugging Face format
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tether.checkpoint import atomic_write_bytes
from tether.config import config_to_dict
from tether.errors import TetherError

RESULT_NAMES = ("metrics.jsonl", "checkpoints", "final", "merged")


@dataclass
class RunResult:
    """What a stage returns: where the final model is, and the final metrics."""

    output_path: Path
    metrics: dict[str, float] = field(default_factory=dict)


class RunDir:
    """Creates and writes one run directory; refuses to overwrite results unless resuming."""

    def __init__(self, output_dir: str | Path, run_name: str, resume: bool = False):
        self.path = Path(output_dir) / run_name
        self.checkpoint_dir = self.path / "checkpoints"
        self.final_dir = self.path / "final"
        self.merged_dir = self.path / "merged"  # a LoRA run's adapter merged into its base
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        has_results = any((self.path / name).exists() for name in RESULT_NAMES)
        if has_results and not resume:
            raise TetherError(f"run directory {self.path} already has results; "
                              "pass --resume to continue it or choose another --run-name")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TetherError(f"cannot create run directory {self.path}: {exc.strerror}") from None
        self._writer = None

    def save_config(self, cfg: Any) -> Path:
        """Write the resolved config as `config.yaml` (atomically)."""
        path = self.path / "config.yaml"
        text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        atomic_write_bytes(path, text.encode("utf-8"))
        return path

    def truncate_metrics(self, after_step: int) -> None:
        """Drop metric and sample lines logged after `after_step` (logged again on resume)."""
        for path in (self.metrics_path, self.samples_path):
            if not path.exists():
                continue
            keep = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= after_step]
            atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode("utf-8"))

    def _tb(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when logging
            self._writer = SummaryWriter(log_dir=str(self.path / "tb"))
        return self._writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl and write TensorBoard scalars."""
        clean = {k: float(v) for k, v in metrics.items()}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        writer = self._tb()
        for key, value in clean.items():
            writer.add_scalar(key, value, step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append `{"step": step, "samples": samples}` to samples.jsonl (generations to read later)."""
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": int(step), "samples": samples}) + "\n")

    def log_text(self, step: int, tag: str, text: str) -> None:
        """TensorBoard text (e.g. a markdown table of samples)."""
        self._tb().add_text(tag, text, step)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text(encoding="utf-8").splitlines()
                if line.strip()]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def progress(total: int, desc: str, initial: int = 0):
    """A tqdm bar with ETA; silent when stderr is not a terminal (logs and CI stay clean)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, initial=initial, disable=not sys.stderr.isatty(),
                dynamic_ncols=True, unit="step")
