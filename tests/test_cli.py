import subprocess
import sys

from tether.cli import STAGES, main


def test_help_lists_stages(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for stage in STAGES:
        assert stage in out


def test_unknown_stage_exit_2(capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown stage 'train'") and err.count("\n") == 1


def test_console_script_stage_help():
    # the installed entry point, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "tether.cli", "sft", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--model", "--data", "--max-length", "--lr", "--run-name", "--config"):
        assert flag in proc.stdout


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("tether ") and out != "tether "


def test_stage_help_is_sectioned_and_loads_no_torch():
    # In a fresh interpreter: --help must not import torch or transformers (it comes up at once).
    code = ("import sys; from tether.cli import main; rc = main(['ppo', '--help']); "
            "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules, rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LOADED False False 0" in proc.stdout
    sections = [line[:-1] for line in proc.stdout.splitlines() if line.endswith(":")
                and not line.startswith(" ")]
    assert sections[:3] == ["models and reward", "prompts and rollout",
                            "reward shaping and the KL penalty"]
    assert {"PPO update", "run and logging", "memory and scale"} <= set(sections)
    assert "  --lora-r INT" in proc.stdout and "(default: 0)" in proc.stdout


def test_missing_required_options_are_named_on_one_line(capsys):
    assert main(["sft", "--model", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: missing required options: --run-name, --data (give them as flags or "
                   "in --config FILE.yaml; see tether sft --help)")
