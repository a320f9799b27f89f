"""What a `--resume` may change: a resumed run's stage and config checked against what the run
recorded (its config.yaml, else its newest checkpoint's record), before anything loads and again
once the directory is held (`tether.run.rundir.RunDir`). A sweep reads a recorded run by the same
rule (tether.tools.sweep).

    HARMLESS_ON_RESUME    fields whose change does not change what is trained: accepted with
                          --resume-allow-changes and recorded in resumes.jsonl
    saved_config          what the run recorded it was started with, and where
    check_stage           another stage's run is refused
    check_resumed_config  any other change is refused; the harmless ones are returned
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from tether.errors import TetherError
from tether.run.atomic import read_record
from tether.run.checkpoint import recorded_config
from tether.run.paths import resolved_record
from tether.run.scopes import field_default

# Config fields whose change on --resume does not change what is trained (with
# --resume-allow-changes); any other difference makes the resumed run a different run.
HARMLESS_ON_RESUME = ("log_every", "save_every", "eval_every", "sample_every", "device",
                      "threads", "report_to", "fsdp", "reward_fn_timeout", "reward_url",
                      "reward_url_timeout", "reward_workers", "reward_retries")
# reward_url: the same model at another address; reward_workers, reward_retries: the same
# scores (a failure they turn into a redraw stopped the run without them)
NOT_COMPARED = ("resume", "resume_allow_changes", "stage")  # the stage: `check_stage`
# Defaults tether has changed: a run that recorded the former one, resumed with today's, is no
# change (report_to was tensorboard until TensorBoard became an extra; auto still takes it where
# it is installed).
FORMER_DEFAULTS = {"report_to": "tensorboard"}


def field_defaults(cfg: Any) -> dict[str, Any]:
    """Each field's default (a default factory's value too); fields without one are left out."""
    defaults = {f.name: field_default(f) for f in dataclasses.fields(cfg)}
    return {name: value for name, value in defaults.items() if value is not dataclasses.MISSING}


def saved_config(config_path: Path, checkpoint_dir: Path) -> tuple[dict[str, Any], str] | None:
    """What the run recorded it was started with, and where: its config.yaml, else (deleted)
    the config its newest checkpoint carries; None when it has neither (nothing ran yet)."""
    if config_path.exists():
        old = read_record(config_path, lambda text: yaml.safe_load(text) or {})
        if not isinstance(old, dict):  # unreadable, garbled, or not a mapping
            raise TetherError(f"{config_path} cannot be read; the run cannot be resumed "
                              "safely: start a new run")
        return old, str(config_path)
    record = recorded_config(checkpoint_dir)
    if record is None:
        return None
    if not record:
        raise TetherError(f"{config_path} is missing and the checkpoints in "
                          f"{checkpoint_dir} record no config (made before tether kept "
                          "one there), so this resume cannot be checked against the run's "
                          "settings; put config.yaml back, or start a new run under another "
                          "--run-name")
    return record, f"the config recorded in {checkpoint_dir} (config.yaml is missing)"


def check_stage(run: Path, old: dict[str, Any], new: dict[str, Any], source: str) -> None:
    """Refuse to go on with another stage's run (its weights, optimizer state, config).
    A run from before the stage was recorded is told by its fields: each stage has fields
    the others lack (ppo, rloo and grpo share theirs; their values are compared)."""
    stage = new.get("stage")
    if stage is None:
        return
    if "stage" in old:
        if old["stage"] != stage:
            raise TetherError(f"{run} is a tether {old['stage']} run ({source}); "
                              f"tether {stage} --resume would go on from its weights as "
                              f"{stage}: resume it with tether {old['stage']}, or choose "
                              "another --run-name")
        return
    foreign = sorted(k for k in old if k not in new)
    if foreign:
        raise TetherError(f"{run} was made by another stage than tether {stage} (its "
                          f"config has {', '.join(foreign[:4])}, which {stage} has not; "
                          f"{source}): resume it with the command that made it, or choose "
                          "another --run-name")


def check_resumed_config(new: dict[str, Any], defaults: dict[str, Any], allow_harmless: bool,
                         old: dict[str, Any], source: str, config_path: Path) -> dict[str, Any]:
    """Refuse a resumed config that differs from the saved one, `old` (read from `source`);
    returns the accepted harmless changes (for `resumes.jsonl`), {} when there are none."""
    # a relative path (an old run's, or a hand edit) is read as `tether eval` reads it,
    # against the run directory; else against here, as an old run was made
    old = resolved_record(old, config_path)
    changed = {k: (old.get(k), v) for k, v in new.items()
               if k not in NOT_COMPARED and k in old and old[k] != v
               and not (k in FORMER_DEFAULTS and old[k] == FORMER_DEFAULTS[k]
                        and v == defaults.get(k))}
    # A field tether gained after the run started is no change while it keeps its default.
    changed |= {k: (None, v) for k, v in new.items()
                if k not in old and k not in NOT_COMPARED and defaults.get(k, object()) != v}
    harmful = {k: d for k, d in changed.items() if k not in HARMLESS_ON_RESUME}
    if harmful:
        diff = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(harmful.items()))
        raise TetherError(f"--resume with a different config would mix two runs ({diff}); "
                          f"resume with the settings in {source}, or start a new run under "
                          "another --run-name")
    if changed and not allow_harmless:
        diff = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        raise TetherError(f"--resume with changed settings ({diff}); pass "
                          "--resume-allow-changes to accept them (they do not change what is "
                          "trained)")
    return {k: {"saved": a, "now": b} for k, (a, b) in changed.items()}
