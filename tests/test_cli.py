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
