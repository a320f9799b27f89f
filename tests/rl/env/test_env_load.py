"""`--env` values (tether.rl.env.load): a prefix names an adapter, anything else the user's own
factory; an adapter whose package is not installed says, on one line, the pip command that
installs it. These run with or without the extras (a missing one is simulated)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tether.cli import main
from tether.errors import TetherError
from tether.rl.env.load import load_environment, parse_options


def without(monkeypatch, package: str) -> None:
    """Make `import package` (and its submodules) fail as if it were not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # import then raises ModuleNotFoundError


@pytest.mark.parametrize("spec, package, hint", [
    ("reasoning-gym:leg_counting?size=10", "reasoning_gym",
     "needs the reasoning-gym package; pip install 'tether[reasoning-gym]'"),
    ("openenv:http://127.0.0.1:8000", "openenv",
     "needs the openenv-core package; pip install 'tether[openenv]'"),
])
def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch, spec, package,
                                                                  hint):
    without(monkeypatch, package)
    with pytest.raises(TetherError) as caught:
        load_environment(spec)
    assert str(caught.value) == f"--env {spec} {hint}"


def test_the_python_adapters_say_it_too(monkeypatch):
    from tether.rl.env.openenv import openenv_environment
    from tether.rl.env.reasoning_gym import reasoning_gym_environment

    without(monkeypatch, "openenv")
    without(monkeypatch, "reasoning_gym")
    with pytest.raises(TetherError, match=r"^openenv_environment\(\) needs the openenv-core"):
        openenv_environment("http://127.0.0.1:8000")
    with pytest.raises(TetherError, match=r"^reasoning_gym_environment\('leg_counting'\) needs "
                                          r"the reasoning-gym package"):
        reasoning_gym_environment("leg_counting")


def test_the_cli_prints_the_hint_and_exits_2(monkeypatch, tmp_path, capsys):
    without(monkeypatch, "reasoning_gym")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 0}) + "\n")
    # a hub-like name: a missing local path is refused before torch loads, ahead of this
    code = main(["grpo", "--policy", "no-such-model", "--prompts", str(prompts),
                 "--env", "reasoning-gym:leg_counting", "--output-dir", str(tmp_path / "runs"),
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: --env reasoning-gym:leg_counting needs the "
                                            "reasoning-gym package; pip install "
                                            "'tether[reasoning-gym]'")


def test_any_other_value_is_the_user_s_factory(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text("def make_env():\n    return 'an env'\n")
    assert load_environment(f"{tmp_path / 'my_env.py'}:make_env")() == "an env"
    monkeypatch.chdir(tmp_path)
    assert load_environment("my_env:make_env")() == "an env"  # module:function
    with pytest.raises(TetherError, match="environment factory 'nothing' must look like"):
        load_environment("nothing")


def test_options_are_key_value_pairs_with_escapes_and_plus_signs_kept():
    assert parse_options('operators=["+","-"]&name=a%26b&empty=', "x") == {
        "operators": '["+","-"]', "name": "a&b", "empty": ""}
    assert parse_options("", "x") == {}
    with pytest.raises(TetherError, match="gives size twice"):
        parse_options("size=1&size=2", "reasoning-gym:x?size=1&size=2")
    with pytest.raises(TetherError, match="option 'size' is not key=value"):
        parse_options("size", "x")


def test_tether_imports_and_loads_user_factories_without_the_extras(tmp_path):
    """In a fresh interpreter where neither extra can be imported: the modules that read --env
    import, and a user's own factory loads."""
    (tmp_path / "my_env.py").write_text("def make_env():\n    return 'an env'\n")
    code = ("import sys\n"
            "for name in ('reasoning_gym', 'openenv'): sys.modules[name] = None\n"
            "import tether.cli, tether.train.ppo, tether.tools.evaluate, tether.tools.generate\n"
            "from tether.rl.env.load import load_environment\n"
            f"assert load_environment({str(tmp_path / 'my_env.py')!r} + ':make_env')() == 'an env'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
