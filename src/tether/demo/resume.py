"""`tether demo --resume`: what a demo root already holds, and what an interrupted demo needs to
go on where it stopped.

    demo.yaml                 the settings the demo was started with (`record_settings`); a
                              --resume with other settings is refused (`check_root`)
    sft/, rm/, PPO runs, ...  each a tether run: finished (`final/`) and kept, or resumed from its
                              own last checkpoint by the stage's own --resume
    <run>/eval.json           the evaluation of DPO, IPO and the SFT model (`tether eval`'s
                              record), so a finished one is read back, not run again
    report.html               written last, atomically: the demo is finished

Like pipeline.py, this module imports no torch at its top (`tether demo` prints its first line
and starts its workers before torch is imported).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import signal
from pathlib import Path
from typing import Any

import yaml

from tether.demo.config import DemoConfig
from tether.demo.curves import Curve
from tether.errors import AlreadyFinished, TetherError
from tether.run.atomic import atomic_write_bytes, read_record

SETTINGS = "demo.yaml"
# Where a demo is, not what it computes: they may differ on --resume. (`jobs` changes no number:
# tests/demo/test_demo.py holds a stage run in a worker to one run in-process.)
NOT_COMPARED = ("output_dir", "run_name", "resume", "jobs")


def check_root(root: Path, cfg: DemoConfig) -> bool:
    """Whether `root` holds a demo to resume (False: start one), or a one-line refusal.

    Without --resume a root that holds a demo is refused, as it always was; with it, one started
    with other settings is refused (finished or not), a finished demo is `AlreadyFinished`
    (nothing to do), and a root with no demo starts fresh, as a stage's --resume does in an empty
    run directory.
    """
    if not any((root / name).exists() for name in (SETTINGS, "report.html", "sft")):
        if cfg.resume:
            print(f"nothing to resume in {root}: starting a new demo", flush=True)
        return False
    if not cfg.resume:
        raise TetherError(f"{root} already holds a demo; pass --resume to continue it (same "
                          "settings), --run-name NEW to keep it, or delete it to run again")
    finished = (root / "report.html").exists()
    # (a finished demo is checked too: its report is of the settings it was started with, so a
    # --resume with others would answer exit 0 and a report of settings not asked for)
    if not (root / SETTINGS).is_file():
        if not finished:  # (one finished by an older tether has nothing left to run: kept)
            raise TetherError(f"{root} holds a demo that recorded no settings ({SETTINGS}: made "
                              "by an older tether), so --resume cannot check them; delete it to "
                              "run again")
    elif differences := changed_settings(root / SETTINGS, cfg):
        raise TetherError(f"--resume with other settings than the demo in {root} was started "
                          f"with ({'; '.join(differences)}); give the same options, or start a "
                          "new demo under another --run-name")
    if finished:
        raise AlreadyFinished(f"{root} already holds a finished demo ({root / 'report.html'}); "
                              "nothing was run or rewritten")
    return True


def settings(cfg: DemoConfig) -> dict[str, Any]:
    """The settings as given (before --quick scales them), as plain YAML values."""
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), (list, tuple)) else v)
            for f in dataclasses.fields(cfg)}


def changed_settings(path: Path, cfg: DemoConfig) -> list[str]:
    """`field: saved -> now` for every setting that changes the numbers."""
    saved = read_record(path)
    if not isinstance(saved, dict):
        raise TetherError(f"{path} cannot be read, so --resume cannot check the demo's settings; "
                          "delete the demo to run again")
    return [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in settings(cfg).items()
            if key not in NOT_COMPARED and saved.get(key) != value]


def record_settings(root: Path, cfg: DemoConfig) -> None:
    """Write demo.yaml (atomically: a kill mid-write leaves none, or the whole file)."""
    atomic_write_bytes(root / SETTINGS, yaml.safe_dump(settings(cfg), sort_keys=False).encode("utf-8"))


def read_eval(path: Path, name: str, seed: int) -> Curve:
    """One evaluation point, read back from the eval.json `tether eval` wrote."""
    record = json.loads(path.read_text(encoding="utf-8"))
    return Curve(name, seed, [0], {k: [float(v)] for k, v in record["metrics"].items()},
                 {0: record["samples"]})


def resume_command(cfg: DemoConfig) -> str:
    """`tether demo --resume` and the options given this time that change any number."""
    words, defaults = ["tether", "demo", "--resume"], settings(DemoConfig())
    for name, value in settings(cfg).items():
        if name in ("resume", "jobs") or value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *(f"{v:g}" for v in value)]
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def interrupted(exc: BaseException, cfg: DemoConfig):
    """The demo's own `Interrupted` for a stop inside it: what stopped and how to go on."""
    from tether.run.interrupt import Interrupted

    how = f"continue it with: {resume_command(cfg)}"
    if isinstance(exc, Interrupted):  # a stage that stopped at a checkpoint says where
        said = str(exc).removesuffix("; continue with --resume")
        return Interrupted(f"{said}; the demo's finished stages are kept: {how}",
                           exc.exit_code - 128)
    return Interrupted("the demo stopped; its finished stages and each stage's last checkpoint "
                       f"are kept: {how}", signal.SIGINT)
