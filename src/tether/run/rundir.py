"""The run directory `runs/<name>/`: resolved config, metrics, TensorBoard events, checkpoints,
final model; plus the progress bar.

Layout::

    runs/<name>/config.yaml       the resolved config (YAML file + flags + defaults), after
                                  `stage:` (the command that made the run: sft, dpo, ...)
    runs/<name>/metrics.jsonl     one JSON object per logged step: {"step": N, "<metric>": value}
    runs/<name>/samples.jsonl     evaluation samples: {"step": N, "samples": [{prompt, response, ...}]}
    runs/<name>/tb/               TensorBoard events
    runs/<name>/checkpoints/      step_<N>/ (see tether.run.checkpoint)
    runs/<name>/final/            the trained model, Hugging Face format
    runs/<name>/merged/           with --merge-lora: the LoRA adapter merged into its base

A run is finished when everything it promised is there: `final/` and, with --merge-lora,
`merged/` (`run_finished`). Each is renamed into place only once complete, so a final save
cut off (a full disk, a kill) leaves the run unfinished, and --resume completes it.

Under torchrun only rank 0 writes here (config, metrics, trackers, samples, progress lines); the
other ranks run the same checks and calls, which do nothing on them.

One writer per directory (tether.run.lock): the writing process holds `runs/<name>/.lock` from
`save_config` (before anything in the directory is deleted or written) until `close` or its
exit; a directory that already exists is probed as soon as the `RunDir` is made, so a second
process stops before it loads a model. Under torchrun rank 0 takes it, once for the job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tether.errors import AlreadyFinished, TetherError
from tether.run import distributed, lock
from tether.run.atomic import atomic_write_bytes, json_lines, read_record, write_failure
from tether.run.checkpoint import recorded_config, remove_temp_dirs
from tether.run.config import config_to_dict
from tether.run.resume import check_resumed_config, check_stage, field_defaults, saved_config
from tether.run.trackers import TRACKERS, parse_report_to

RESULT_NAMES = ("metrics.jsonl", "checkpoints", "final", "merged")


@dataclass
class RunResult:
    """What a stage returns: where the final model is, and the final metrics."""

    output_path: Path
    metrics: dict[str, float] = field(default_factory=dict)


IN_USE_FIX = "wait for it to finish or choose another --run-name"


class RunDir:
    """One run directory: checked when made (nothing is created yet), created by `save_config`.

    Without `resume`, a directory that already holds results is refused. With `resume`, a
    finished run (`run_finished`) raises `AlreadyFinished`, and `save_config` checks the stage and
    config against the saved ones instead of rewriting them.
    """

    def __init__(self, output_dir: str | Path, run_name: str, resume: bool = False):
        self.path = Path(output_dir) / run_name
        self.resume = resume
        self.checkpoint_dir = self.path / "checkpoints"
        self.final_dir = self.path / "final"
        self.merged_dir = self.path / "merged"  # a LoRA run's adapter merged into its base
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.config_path = self.path / "config.yaml"
        self._lock: lock.DirLock | None = None
        # in use? say so before a model is loaded, on the process that will write the directory:
        # rank 0 by its environment, before torchrun's group is joined (`writes` says the same)
        writer = not distributed.launched() or os.environ.get("RANK", "0") == "0"
        if writer and self.path.is_dir():
            lock.probe(self.path, "run directory", IN_USE_FIX)
        self._check_state()
        self._trackers: list | None = None
        self._config: dict[str, Any] = {}
        self.checkpoint_config: dict[str, Any] = {}  # what checkpoints carry: `save_config`

    def _check_state(self) -> None:
        has_results = any((self.path / name).exists() for name in RESULT_NAMES)
        if has_results and not self.resume:
            raise TetherError(f"run directory {self.path} already has results; "
                              "pass --resume to continue it or choose another --run-name")
        if self.resume and run_finished(self.path):
            raise AlreadyFinished(f"{self.path} already finished (final model in "
                                  f"{self.final_dir}); nothing was run or rewritten")

    @property
    def writes(self) -> bool:
        """True on the process that writes the run directory: rank 0 (or the only process)."""
        return distributed.current().is_main

    def save_config(self, cfg: Any) -> Path:
        """Create the directory and write the resolved config as `config.yaml` (atomically).

        On resume the saved config stays as it is (it describes the run): a field that changes
        the result is an error listing the differences; a harmless one (logging, checkpoint
        cadence, device) needs `--resume-allow-changes` and is recorded in `resumes.jsonl`.
        """
        new = recorded(cfg)
        self._config = self.checkpoint_config = new
        # every rank refuses a resumed config that differs, before the lock is taken
        changes = self._check_resumed(cfg) if self.resume else None
        self._claim()
        if not self.writes:  # the other ranks write nothing
            return self.config_path
        for directory in (self.path, self.checkpoint_dir):
            for leftover in remove_temp_dirs(directory):
                print(f"removed {leftover}, left by an interrupted write", file=sys.stderr)
        if self.resume and changes is None:  # written by another run since the check above
            changes = self._check_resumed(cfg)
        if changes is not None:
            if changes:
                with open(self.path / "resumes.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps({"changes": changes}) + "\n")
            if self.config_path.exists():
                return self.config_path
            print(f"{self.config_path} was missing: written again from the config its last "
                  "checkpoint records", file=sys.stderr)
            new = self.checkpoint_config
        atomic_write_bytes(self.config_path, yaml.safe_dump(new, sort_keys=False).encode("utf-8"))
        return self.config_path

    def check_resume(self, cfg: Any) -> None:
        """With --resume, refuse a config that differs from the run's now, before anything
        loads or starts (`save_config` checks again once the directory is claimed)."""
        if self.resume:
            self._check_resumed(cfg)

    def _check_resumed(self, cfg: Any) -> dict[str, Any] | None:
        """The stage and config checks of a resume against what the run recorded (config.yaml;
        without it, its newest checkpoint's record; with both, the checkpoint's too, so an edited
        config.yaml cannot hide a change). None: nothing recorded yet, the resume starts fresh.
        Sets `checkpoint_config`, what the next checkpoints carry (the run's config, as saved)."""
        saved = saved_config(self.config_path, self.checkpoint_dir)
        if saved is None:
            return None
        old, source = saved
        new, defaults = recorded(cfg), field_defaults(cfg)
        check_stage(self.path, old, new, source)
        changes = check_resumed_config(new, defaults, bool(new.get("resume_allow_changes")), old,
                                       source, self.config_path)
        if self.config_path.exists() and (record := recorded_config(self.checkpoint_dir)):
            where = f"the config recorded in {self.checkpoint_dir}"
            check_stage(self.path, record, new, where)
            # results only
            check_resumed_config(new, defaults, True, record, where, self.config_path)
        self.checkpoint_config = {"stage": new["stage"]} | old if "stage" in new else old
        return changes

    def _claim(self) -> None:
        """Rank 0 creates the directory and takes its lock, then checks again what `__init__`
        checked (another process may have started or finished a run here since). Under torchrun
        its refusal is every rank's: each raises the same error, none is left in a collective."""
        refusal: tuple[str, str] | None = None
        if self.writes:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                refusal = ("error", f"cannot create run directory {self.path}: {exc.strerror}")
            try:
                if refusal is None:
                    self._lock = self._lock or lock.acquire(self.path, "run directory",
                                                            IN_USE_FIX)
                    self._check_state()
            except TetherError as exc:
                refusal = ("finished" if isinstance(exc, AlreadyFinished) else "error", str(exc))
                self.release()
        if distributed.current().active:
            refusal = distributed.broadcast_object(refusal)
        if refusal is not None:
            kind, message = refusal
            raise (AlreadyFinished if kind == "finished" else TetherError)(message)

    @contextlib.contextmanager
    def writing_final(self) -> Iterator[None]:
        """Around the final save (rank 0): a write that fails for want of space, quota or
        permission (an OSError, or safetensors' SafetensorError around one) becomes one line
        saying how to complete the run; any failure frees the directory, as an exit would.
        Nothing half-written is left: each output is renamed into place only once complete."""
        try:
            yield
        except BaseException as exc:
            self.release()
            reason = write_failure(exc)
            if reason is None:
                raise
            raise TetherError(f"cannot write the final model of {self.path}: {reason}; free "
                              "space (or make it writable), then run the same command with "
                              "--resume: it goes on from the last checkpoint and writes "
                              "final/" + (" and merged/" if self._config.get("merge_lora")
                                          else "")) from None

    def announce_resume(self, step: int | None) -> None:
        """One stderr line saying where a `--resume` run starts (`step` None: no checkpoint)."""
        if not self.resume or not self.writes:
            return
        if self.final_dir.is_dir():  # and no merged/: `run_finished` said the run is not
            print(f"{self.path} has final/ but not the merged/ it promised (the final save "
                  "failed): the steps after the last checkpoint run again and write both",
                  file=sys.stderr)
        if step is not None:
            print(f"resuming {self.path} from step {step}", file=sys.stderr)
        elif self.metrics_path.exists() or self.checkpoint_dir.exists():
            print(f"no checkpoint in {self.path} yet: restarting it from step 0", file=sys.stderr)
        else:
            print(f"nothing to resume in {self.path}: starting fresh", file=sys.stderr)

    def truncate_metrics(self, after_step: int) -> None:
        """Drop metric and sample lines logged after `after_step` (logged again on resume), and a
        line cut off by a kill mid-write."""
        if not self.writes:
            return
        for path in (self.metrics_path, self.samples_path):
            if path.exists():  # a partial line goes: the step it belonged to runs again
                keep = [line for line, record in json_lines(path)
                        if record.get("step", 0) <= after_step]
                atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode("utf-8"))

    def _sinks(self) -> list:
        """The trackers of `--report-to` (by default TensorBoard when installed), started at first
        use."""
        if self._trackers is None:
            self._trackers = [TRACKERS[name](self.path, self.path.name, self._config)
                              for name in parse_report_to(self._config.get("report_to", "auto"))]
        return self._trackers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl and send them to the trackers."""
        if not self.writes:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self._sinks():
            tracker.log(step, clean)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append `{"step": step, "samples": samples}` to samples.jsonl (generations to read later)."""
        if not self.writes:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": int(step), "samples": samples}) + "\n")

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Text for the trackers (e.g. a markdown table of samples)."""
        if not self.writes:
            return
        for tracker in self._sinks():
            tracker.text(step, tag, text)

    def close(self) -> None:
        """Close the trackers and free the directory for the next process (`release`)."""
        for tracker in self._trackers or []:
            tracker.close()
        self._trackers = None
        self.release()

    def release(self) -> None:
        """Free the lock (the process ending frees it too, however it ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def run_finished(path: str | Path) -> bool:
    """True when everything the run in `path` promised is on disk: `final/`, and `merged/` when
    its config.yaml (deleted: its newest checkpoint's record) asked for --merge-lora. With
    neither readable, `final/` alone finishes it, as it did before merged/ was checked."""
    path = Path(path)
    if not (path / "final").is_dir():
        return False
    if (path / "merged").is_dir():
        return True
    config = path / "config.yaml"
    saved = read_record(config) if config.exists() else recorded_config(path / "checkpoints")
    return not (isinstance(saved, dict) and saved.get("merge_lora"))


def recorded(cfg: Any) -> dict[str, Any]:
    """A config as a run directory records it: `stage` (the config class's STAGE, the command
    that runs it; none for a config without one) first, then every field."""
    stage = getattr(type(cfg), "STAGE", None)
    return ({"stage": stage} if stage else {}) | config_to_dict(cfg)


def announce(line: str) -> None:
    """A progress line before the first step (`sft x: encoding 4000 rows of data.jsonl`), so a
    long load is not silent; rank 0 only (RANK is the launcher's, known before the group)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def progress(total: int, desc: str, initial: int = 0):
    """A tqdm bar with ETA on a terminal; elsewhere (nohup, a cluster log, CI) a `PlainProgress`
    that prints a plain line now and then, so a log shows where the run is. Under torchrun only
    rank 0 shows one (the others get a silent one: tqdm's disabled bar)."""
    shows = distributed.current().is_main
    if shows and not sys.stderr.isatty():
        return PlainProgress(total, desc, initial)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True, unit="step",
                disable=not shows)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class PlainProgress:
    """The tqdm calls the stages use (`update`, `set_postfix`, `close`), printed as one line per
    twentieth of the run (and at the end): `desc: step 40/100 loss=1.23 elapsed 0:00:12 eta 0:00:18`."""

    def __init__(self, total: int, desc: str, initial: int = 0, lines: int = 20):
        self.total, self.desc, self.n, self.start_n = total, desc, initial, initial
        self.every = max(1, total // lines)
        self.postfix: dict[str, str] = {}
        self.started = time.monotonic()
        self.printed_at = initial

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self.printed_at >= self.every or self.n >= self.total:
            self._print()

    def _print(self) -> None:
        self.printed_at = self.n
        elapsed = time.monotonic() - self.started
        done = self.n - self.start_n
        eta = elapsed / done * (self.total - self.n) if done else 0.0
        fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total} {fields} elapsed {_clock(elapsed)} "
              f"eta {_clock(eta)}".replace("  ", " "), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def print_result(result: RunResult) -> None:
    """One stderr line for the CLI: where the final model is, then the final metrics (rank 0)."""
    if not distributed.current().is_main:
        return
    print(f"saved {result.output_path}  " + "  ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()),
          file=sys.stderr)
