"""`tether <stage> --help` says what the parser does (issue 23).

Before: `--stop-strings` (a list with an empty default) was called required, `--policy` and
`--prompts` of ppo/rloo/grpo showed `(default: '')` although the run refused to start without
them, `tether sweep --help` did not show the `tether sweep grid.yaml` form the README uses, a
description was cut after its first line, and `--help | head` ended in a BrokenPipeError
traceback.

Every option of every stage's help is parsed and held against the parser itself: an option shown
as required is one whose omission is the "missing required option" line, and an option with a
default shows the value a config left alone gets (never "required").
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from tether.cli import STAGES, config_class, main
from tether.errors import TetherError
from tether.run.parse import parse_config
from tether.tools.config import ReportConfig, SweepConfig


def _config(stage: str) -> type:
    return config_class(stage)


def _help(stage: str, capsys) -> str:
    capsys.readouterr()
    assert main([stage, "--help"]) == 0
    return capsys.readouterr().out


def _options(text: str) -> dict[str, str]:
    """Flag -> what its help shows in the closing parentheses (`required`, `default: 32`)."""
    shown: dict[str, str] = {}
    for block in re.split(r"\n  (?=--)", text)[1:]:
        flag = block.split()[0].rstrip(",")
        words = " ".join(block.split("\n\n")[0].split())
        start = max(words.rfind("(default: "), words.rfind("(required"))  # the last: the doc
        assert start >= 0 and words.endswith(")"), f"{flag}: no (required) or (default: ...)"
        assert flag not in shown, f"{flag} listed twice"  # may itself say "(default: ...)"
        shown[flag] = words[start + 1:-1]
    return shown


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _minimal_argv(cls: type) -> list[str]:
    """The required flags alone, each with a placeholder (every required field is a string)."""
    argv = []
    for field in dataclasses.fields(cls):
        if _required(field):
            assert field.type in (str, "str"), field
            argv += [_flag(field), "x"]
    return argv


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_option_shows_its_real_default_or_required(stage, capsys):
    cls = _config(stage)
    shown = _options(_help(stage, capsys))
    fields = dataclasses.fields(cls)
    assert set(shown) == {_flag(f) for f in fields}  # every field, and nothing else
    positional = getattr(cls, "POSITIONAL", None)
    for field in fields:
        text = shown[_flag(field)]
        if field.name == positional:
            text = text.removesuffix("; or give it as the first argument(s), before any flag")
        if _required(field):
            assert text == "required", (field.name, text)
        else:
            value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            assert text == f"default: {value!r}", (field.name, text)
            assert "required" not in text


@pytest.mark.parametrize("stage", list(STAGES))
def test_required_in_the_help_is_what_the_parser_requires(stage):
    # The required flags alone parse and validate: nothing else is required in secret; each one
    # left out is the one missing-option line, before anything loads.
    cls = _config(stage)
    argv = _minimal_argv(cls)
    parse_config(cls, argv, prog=f"tether {stage}")
    for field in dataclasses.fields(cls):
        if not _required(field):
            continue
        k = argv.index(_flag(field))
        with pytest.raises(TetherError, match=f"^missing required option: {_flag(field)} "):
            parse_config(cls, argv[:k] + argv[k + 2:], prog=f"tether {stage}")


@pytest.mark.parametrize("stage", ["ppo", "rloo", "grpo"])
def test_online_stages_require_policy_and_prompts_and_not_stop_strings(stage, capsys):
    shown = _options(_help(stage, capsys))
    assert shown["--policy"] == "required" and shown["--prompts"] == "required"
    assert shown["--stop-strings"] == "default: []"
    with pytest.raises(TetherError, match="^missing required options: --policy, --prompts "):
        parse_config(_config(stage), ["--reward-fn", "r.py:f"], prog=f"tether {stage}")


def test_list_options_say_how_they_take_several_values(capsys):
    text = " ".join(_help("generate", capsys).split())
    assert ("--stop-strings LIST Strings that end a response (kept in it); EOS always ends one. "
            "Several values follow one flag (--stop-strings A B), not comma-separated. "
            "(default: [])") in text
    cfg = parse_config(_config("generate"), ["--model", "m", "--prompts", "p", "--stop-strings",
                                             "A", "B,C"])
    assert cfg.stop_strings == ["A", "B,C"]  # what the help says, done


def test_sweep_and_report_show_and_take_their_positional_form(capsys):
    sweep = _help("sweep", capsys)
    assert sweep.splitlines()[0] == "usage: tether sweep GRID [--config FILE.yaml] [--field value ...]"
    assert "(required; or give it as the first argument(s), before any flag)" in " ".join(sweep.split())
    assert parse_config(SweepConfig, ["grid.yaml"]).grid == "grid.yaml"  # the README's form
    assert parse_config(SweepConfig, ["grid.yaml", "--jobs", "2"]).jobs == 2
    assert parse_config(SweepConfig, ["--grid", "g.yaml"]).grid == "g.yaml"
    report = _help("report", capsys)
    assert report.splitlines()[0].startswith("usage: tether report RUNS ... [--config FILE.yaml]")
    cfg = parse_config(ReportConfig, ["runs/a", "runs/b", "--title", "t"])
    assert (cfg.runs, cfg.title) == (["runs/a", "runs/b"], "t")


def test_the_description_is_the_docstrings_whole_first_paragraph(capsys):
    lines = _help("eval", capsys).splitlines()
    assert " ".join(lines[2:4]) == ("Held-out evaluation of a policy, as PPO and the demo run it: "
                                    "proxy and gold score, KL to the reference (k1 and exact), "
                                    "entropy, EOS rate, distinct-2, length.")
    assert all(len(line) <= 100 for line in lines)


def test_help_into_a_closed_pipe_is_no_traceback():
    # `tether ppo --help | head -3`: the reader leaves before the help is written
    child = subprocess.Popen([sys.executable, "-m", "tether", "ppo", "--help"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 0 and err == "", err
