"""The docs name only what exists: every `--option` in backticks is an option of some stage (or
a named exception below, with its reason), every repository path exists, and every metric name
is one the code writes. A doc that goes stale when an option, a file or a metric is renamed or
removed fails here, not in front of a reader."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tether.cli import STAGES, config_class
from tether.run.trl_names import ROWS

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCE = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "src" / "tether").rglob("*.py"))

# Inline code spans that run another program: their flags are that program's.
OTHER_PROGRAMS = ("bench/", "torchrun", "pip ", "pytest", "mutate_options", "same_weights",
                  "examples/")
# Flags shown on purpose as what tether does not take: the unknown-option examples of
# docs/errors.md and the TRL names of docs/from_trl.md (each answered with tether's option).
NOT_OPTIONS_ON_PURPOSE = {"--bogus", "--sample-per-prompt", "--top-p"}
NOT_OPTIONS_ON_PURPOSE |= {"--" + row.trl.replace("_", "-") for row in ROWS}
ON_PURPOSE_IN = {"errors.md", "from_trl.md"}
# torchrun's own flags (docs/scaling.md, docs/errors.md)
TORCHRUN_FLAGS = {"--nproc-per-node", "--master-addr", "--master-port", "--no-python"}
# Names that no longer exist, mentioned as history on purpose.
HISTORY = {"bench/grpo.py": "benchmarks.md: where the GRPO bench lived before issue 19",
           "objective/implicit_kl": "dpo.md: the old name of objective/logratio"}
METRIC = re.compile(r"(?<![\w/.])((?:objective|policy|rollout|value|perf|optim|eval|train|"
                    r"rewards|logps|data|env|reward)/[a-z0-9_]+)(?![\w<.])")
PATH = re.compile(r"(?<![\w./-])((?:src|tests|bench|docs|examples|\.ci)/[\w./-]*\w)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])")


def tether_options() -> set[str]:
    out = {"--config", "--help", "--version"}
    for stage in STAGES:
        for field in dataclasses.fields(config_class(stage)):
            flag = "--" + field.name.replace("_", "-")
            out |= {flag, "--no-" + flag[2:]}  # a boolean also reads as --no-<name>
        out |= set(getattr(config_class(stage), "FLAG_NAMES", {}))  # distill --student, ...
    return out


def script_flags() -> set[str]:
    """The flags the bench scripts and the audit tools define (`"--repeats"` in their argparse
    calls): a doc may name them apart from their command, but they must exist."""
    files = [*(ROOT / "bench").rglob("*.py"), *(ROOT / "tests" / "audit").glob("*.py")]
    return {flag.replace("_", "-") for path in files
            for flag in re.findall(r"""["'](--[a-z][a-z0-9_-]*)["']""",
                                   path.read_text(encoding="utf-8"))}


def spans(doc: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", doc.read_text(encoding="utf-8"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_option_a_doc_names_exists(doc):
    options = tether_options() | script_flags() | TORCHRUN_FLAGS
    unknown = set()
    for span in spans(doc):
        if any(program in span for program in OTHER_PROGRAMS):
            continue
        for flag in FLAG.findall(span):
            flag = flag.replace("_", "-")
            if flag in options:
                continue
            if doc.name in ON_PURPOSE_IN and flag in NOT_OPTIONS_ON_PURPOSE:
                continue
            unknown.add(flag)
    assert not unknown, f"{doc.name} names options no stage has: {sorted(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    missing = {path for span in spans(doc) for path in PATH.findall(span)
               if "*" not in path and not (ROOT / path).exists() and path not in HISTORY}
    assert not missing, f"{doc.name} names files that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_metric_a_doc_names_is_written_by_the_code(doc):
    def written(name: str) -> bool:
        # a literal, or an f-string's fixed part (`objective/kl_{name}`, `eval/{key}`)
        return name in SOURCE or any(name[:i] + "{" in SOURCE for i in range(name.index("/") + 1,
                                                                              len(name)))
    missing = {m for span in spans(doc) for m in METRIC.findall(span)
               if not written(m) and m not in HISTORY}
    assert not missing, f"{doc.name} names metrics the code does not write: {sorted(missing)}"


def test_the_check_bites():
    # a made-up option, file and metric are each caught by the rules above
    assert "--made-up-option" not in tether_options()
    assert not (ROOT / "src/tether/made_up.py").exists()
    assert FLAG.findall("tether ppo --made-up-option 1") == ["--made-up-option"]
    assert PATH.findall("see src/tether/made_up.py") == ["src/tether/made_up.py"]
    assert METRIC.findall("`objective/made_up`") == ["objective/made_up"]
    assert "objective/made_up" not in SOURCE
