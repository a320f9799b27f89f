import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Literal

import pytest

from tether.errors import TetherError
from tether.run.config import RunConfig, config_to_dict
from tether.run.parse import config_from_dict, parse_config
from tether.run.paths import resolve_paths


@dataclass(kw_only=True)
class DemoConfig(RunConfig):
    model: str = "m"
    """Model path."""
    lr: float = 1e-3
    """Learning rate."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """Loss kind."""
    steps: int = 5
    """Steps."""
    reward_weights: list[float] = dataclasses.field(default_factory=list)
    """Weights (a list of numbers that may join its values with commas)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Tags."""


def test_flags_override_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_name: a\nlr: 2\nsteps: 7\nloss: ipo\n")
    cfg = parse_config(DemoConfig, ["--config", str(path), "--steps", "9"])
    assert cfg.run_name == "a"
    assert cfg.lr == 2.0 and isinstance(cfg.lr, float)  # YAML int widened to float
    assert cfg.steps == 9  # flag wins over the file
    assert cfg.loss == "ipo"
    assert cfg.output_dir == os.path.abspath("runs")  # the default, recorded absolute (issue 23)


def test_unknown_yaml_field_names_field_and_what_to_use(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_name: a\nlearning_rate: 2\n")
    with pytest.raises(TetherError, match="'learning_rate' in .* is TRL's name; tether's is lr "):
        parse_config(DemoConfig, ["--config", str(path)])
    path.write_text("run_name: a\nstep: 1\n")
    with pytest.raises(TetherError, match="unknown config field 'step' in .*; did you mean 'steps'"):
        parse_config(DemoConfig, ["--config", str(path)])


@pytest.mark.parametrize("yaml_text, pattern", [
    ("run_name: a\nloss: hinge\n", "'loss' must be one of: sigmoid, ipo"),
    ("run_name: a\nsteps: 1.5\n", "'steps' must be an integer"),
    ("run_name: a\nseed: 9223372036854775808\n", "'seed' must be an integer within "),
    ("run_name: a\nlr: 1" + "0" * 400 + "\n", "'lr' must be a finite number, got 1000"),
    ("run_name: a\nresume: 'yes'\n", "'resume' must be true or false"),
    ("run_name: a\ndevice: tpu\n", "'device' must be one of: auto, cpu"),
    ("run_name: a\nlog_every: 0\n", "'log_every' must be >= 1"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_bad_yaml_values(tmp_path, yaml_text, pattern):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(TetherError, match=pattern):
        parse_config(DemoConfig, ["--config", str(path)])


def test_bad_flags_are_one_line_errors():
    with pytest.raises(TetherError, match="^unknown option --bogus; see tether demo --help$"):
        parse_config(DemoConfig, ["--run-name", "a", "--bogus", "1"], prog="tether demo")
    with pytest.raises(TetherError, match="sigmoid") as info:
        parse_config(DemoConfig, ["--run-name", "a", "--loss", "hinge"])
    assert "\n" not in str(info.value)
    with pytest.raises(TetherError, match="run-name"):
        parse_config(DemoConfig, [])  # required field missing


def test_missing_config_file():
    with pytest.raises(TetherError, match="not found"):
        parse_config(DemoConfig, ["--config", "/nonexistent/x.yaml"])


def test_dict_round_trip():
    cfg = DemoConfig(run_name="r", lr=0.5, loss="ipo")
    d = config_to_dict(cfg)
    assert d["lr"] == 0.5 and d["loss"] == "ipo" and d["run_name"] == "r"
    assert config_from_dict(DemoConfig, d) == resolve_paths(cfg)  # output_dir made absolute
    with pytest.raises(TetherError, match="missing required config field 'run_name'"):
        config_from_dict(DemoConfig, {"lr": 1.0})


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(DemoConfig, ["--help"], prog="tether demo")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--run-name", "--output-dir", "--seed", "--resume", "--lr", "--loss", "--steps"):
        assert flag in out
    assert "Learning rate" in out and "default: 0.001" in out


@pytest.mark.parametrize("argv, field, value", [
    (["--steps", "-3"], "steps", -3),  # a negative number is a value, not a flag
    (["--steps=-3"], "steps", -3),
    (["--steps", "1_000"], "steps", 1000),  # as Python's int() reads it
    (["--lr", "-1e-3"], "lr", -1e-3),
    (["--lr", "2"], "lr", 2.0),
    (["--resume"], "resume", True),
    (["--resume", "--no-resume"], "resume", False),  # the last of a repeated flag wins
    (["--steps", "4", "--steps", "5"], "steps", 5),
    (["--run_name", "b"], "run_name", "b"),  # underscores spell the same flag
    (["--run-name", "-"], "run_name", "-"),  # `-` alone is a value
    (["--tags", "a", "-1", "b"], "tags", ["a", "-1", "b"]),
    (["--tags"], "tags", []),  # a list flag with no values: the empty list
    (["--tags=a,b", "c"], "tags", ["a,b", "c"]),  # strings keep their commas
    (["--reward-weights", "1,0.5", "-2"], "reward_weights", [1.0, 0.5, -2.0]),
    (["--loss", "ipo"], "loss", "ipo"),
])
def test_flags_read_as_typed_values(argv, field, value):
    cfg = parse_config(DemoConfig, ["--run-name", "a", *argv], prog="tether demo")
    assert getattr(cfg, field) == value and type(getattr(cfg, field)) is type(value)


def test_every_seed_the_options_take_seeds_every_stage():
    """A seed outside NumPy's 0 .. 2**32 - 1 (-1, 2**33: torch and ppo take them) was NumPy's
    ValueError traceback in sft, rm and dpo; it is reduced into NumPy's range, and a seed in
    that range seeds NumPy as before, draw for draw."""
    import numpy as np

    from tether.run.launch import seed_everything
    from tether.run.parse import MAX_INT

    for seed in (-1, 2**33, MAX_INT, -MAX_INT):
        seed_everything(seed)
    seed_everything(5)
    drawn = np.random.rand(3).tolist()
    np.random.seed(5)
    assert np.random.rand(3).tolist() == drawn


@pytest.mark.parametrize("argv, line", [
    (["--steps", "1.5"], "config field 'steps' must be an integer, got '1.5'"),
    (["--seed", str(2**63)], "config field 'seed' must be an integer within +-1099511627775 "
                             "(2**40 - 1), got 9223372036854775808"),  # not an overflow inside
    (["--steps", str(-2**40)], "config field 'steps' must be an integer within +-1099511627775 "
                               "(2**40 - 1), got -1099511627776"),
    (["--lr", "fast"], "config field 'lr' must be a number, got 'fast'"),
    (["--lr", "nan"], "config field 'lr' must be a finite number, got nan"),
    (["--reward-weights", "1,x"], "config field 'reward_weights' must be a number, got 'x'"),
    (["--steps"], "--steps needs a value (see --help)"),
    (["--steps", "-x"], "--steps needs a value (see --help)"),  # -x reads as a mistyped flag
    (["--steps", "--lr", "1"], "--steps needs a value (see --help)"),
    (["--resume=yes"], "--resume takes no value (got '--resume=yes'): --resume sets it, "
                       "--no-resume clears it"),
    (["--resume", "yes"], "unexpected argument 'yes': a value goes after its flag "
                          "(see --help)"),
    (["--steps", "4", "5"], "unexpected argument '5': a value goes after its flag "
                            "(see --help)"),
    (["-s", "1"], "unexpected argument '-s': a value goes after its flag "
                  "(see --help)"),
    (["--no-steps"], "unknown option --no-steps; did you mean --steps?"),  # not a bool
    (["--loss", "hinge"], "config field 'loss' must be one of: sigmoid, ipo (got 'hinge')"),
])
def test_flag_mistakes_are_one_line_errors(argv, line):
    with pytest.raises(TetherError) as info:
        parse_config(DemoConfig, ["--run-name", "a", *argv], prog="tether demo")
    assert str(info.value) == line


def test_every_stage_field_has_a_type_flags_and_yaml_read():
    """The flag reader and the type check know bool, int, float, str, a Literal of strings and a
    list of int, float or str: a field of another type (Optional, a tuple) would pass unchecked."""
    from tether.cli import STAGES, config_class

    plain = (bool, int, float, str)
    for stage in STAGES:
        cls = config_class(stage)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            args = typing.get_args(tp)
            ok = (tp in plain or (typing.get_origin(tp) is Literal
                                  and all(isinstance(a, str) for a in args))
                  or (typing.get_origin(tp) is list and args[0] in (int, float, str)))
            assert ok, f"{cls.__name__}.{f.name}: {tp}"
