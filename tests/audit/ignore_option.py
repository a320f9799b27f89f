"""A pytest plugin (and sitecustomize-free helper) that makes tether silently ignore one option.

With TETHER_IGNORE_OPTION=<stage>:<field> (e.g. `ppo:missing_eos_penalty`), every read of that
field on that stage's config returns the field's default, as if the stage code never looked at
the option, while validation and the recorded config.yaml still see the value given: exactly the
bug "the flag is accepted, checked and recorded, then ignored". Used by tests/audit/mutate_options.py
(`python -m pytest -p ignore_option ...` with tests/tools on PYTHONPATH); it does nothing when the
variable is unset.

Stages: sft, rm, dpo, online (tether ppo, rloo and grpo share one loop and PPOConfig), demo,
generate, eval, report, sweep, serve-rm. Processes a test starts see the same variable: tests/dist_driver.py
(the torchrun ranks) installs it too.
A required field without a default reads as a different plausible value (IGNORED_REQUIRED).
"""

from __future__ import annotations

import dataclasses
import os
import sys

ENV = "TETHER_IGNORE_OPTION"

# Config code that may see the real value: checking it and recording it are not "using" it.
SEES_REAL_VALUE = {"validate", "_validate", "config_to_dict", "check_resumed_config",
                   "parse_config", "config_from_dict", "_check_block_acts"}

IGNORED_REQUIRED = {"run_name": "ignored-run-name"}

# Fields the code reads from the recorded config rather than from the object: for them, recording
# is the use, so config_to_dict sees the default too.
READ_FROM_RECORD = {"resume_allow_changes", "report_to"}


def stage_classes(stage: str) -> tuple[type, ...]:
    import importlib

    names = {"sft": ("tether.train.offline_config", "SFTConfig"),
             "rm": ("tether.train.offline_config", "RMConfig"),
             "dpo": ("tether.train.offline_config", "DPOConfig"),
             "online": ("tether.train.ppo_config", "PPOConfig", "RLOOConfig", "GRPOConfig",
                        "DistillConfig"),
             "demo": ("tether.demo.config", "DemoConfig"),
             "generate": ("tether.tools.config", "GenerateConfig"),
             "eval": ("tether.tools.config", "EvalConfig"),
             "bon": ("tether.tools.config", "BonConfig"),
             "interpolate": ("tether.tools.config", "InterpolateConfig"),
             "report": ("tether.tools.config", "ReportConfig"),
             "set-base": ("tether.tools.config", "SetBaseConfig"),
             "sweep": ("tether.tools.config", "SweepConfig"),
             "serve-rm": ("tether.tools.config", "ServeRMConfig"),
             "tiny-model": ("tether.demo.config", "TinyModelConfig")}[stage]
    module = importlib.import_module(names[0])  # only this stage's: a branch may lack the others
    return tuple(getattr(module, name) for name in names[1:])


def _default(cls: type, name: str):
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return IGNORED_REQUIRED.get(name, "")


class Ignored:
    """Data descriptor for one field: instances of the target classes store the given value but
    read back the default, except inside SEES_REAL_VALUE functions."""

    def __init__(self, name: str, targets: tuple[type, ...]):
        self.name, self.targets = name, targets

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value  # a data descriptor wins over the instance dict on reads

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(self.name)  # dataclasses looks up class defaults this way
        real = obj.__dict__[self.name]
        if type(obj) not in self.targets:
            return real
        frame = sys._getframe(1)
        exempt = SEES_REAL_VALUE - ({"config_to_dict"} if self.name in READ_FROM_RECORD else set())
        while frame is not None:
            if frame.f_code.co_name in exempt:
                return real
            frame = frame.f_back
        return _default(type(obj), self.name)


def install(spec: str):
    """Make `<stage>:<field>` ignored from now on, in this process; returns a function that
    undoes it (instances made meanwhile keep their values)."""
    stage, name = spec.split(":")
    targets = stage_classes(stage)
    # the descriptor goes on every class in the MRO that declares the field, so that no class
    # attribute (a default) hides it; other classes' instances read their real value through it
    owners = {c for t in targets for c in t.__mro__ if name in getattr(c, "__annotations__", {})}
    if not owners:
        raise SystemExit(f"{ENV}: {stage} has no field {name!r}")
    saved = {cls: cls.__dict__.get(name, _ABSENT) for cls in owners}
    for cls in owners:
        setattr(cls, name, Ignored(name, targets))

    def undo():
        for cls, value in saved.items():
            if value is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
    return undo


_ABSENT = object()


def pytest_configure(config):
    spec = os.environ.get(ENV)
    if spec:
        install(spec)
