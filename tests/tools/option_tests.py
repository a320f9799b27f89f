"""OPTION_TESTS: for each option of each stage, the tests that fail when the stage silently
ignores it (checked by tests/tools/mutate_options.py; table in docs/options.md)."""

from __future__ import annotations

import dataclasses

STAGES = ("sft", "rm", "dpo", "online", "demo")


def all_units() -> list[str]:
    """Every `stage:field`, in declaration order."""
    from ignore_option import stage_classes

    return [f"{stage}:{f.name}" for stage in STAGES
            for f in dataclasses.fields(stage_classes(stage)[0])]


OPTION_TESTS: dict[str, list[str]] = {}
