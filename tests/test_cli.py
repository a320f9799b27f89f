import os
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
    assert sections[:4] == ["models and reward", "prompts and rollout", "rollout engine",
                            "reward shaping and the KL penalty"]
    assert {"PPO update", "run and logging", "memory and scale"} <= set(sections)
    assert "  --lora-r INT" in proc.stdout and "(default: 0)" in proc.stdout


def test_missing_required_options_are_named_on_one_line(capsys):
    assert main(["sft", "--model", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: missing required options: --run-name, --data (give them as flags or "
                   "in --config FILE.yaml; see tether sft --help)")


PREFLIGHT = ("import sys; from tether.cli import main; rc = main({argv!r}); "
             "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules, rc)")


def test_a_bad_option_and_a_missing_engine_fail_before_torch_loads(tmp_path):
    # In a fresh interpreter: the config is read, and found wrong, before any heavy import.
    for argv, error in [(["sft", "--model", "m"], "error: missing required options"),
                        (["grpo", "--policy", "p", "--prompts", "q", "--reward-fn", "f.py:f",
                          "--run-name", "r", "--engine", "vllm"], "error: --engine vllm needs")]:
        proc = subprocess.run([sys.executable, "-c", PREFLIGHT.format(argv=argv)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        if "vllm" in argv and proc.stdout.startswith("LOADED True"):
            continue  # vLLM is installed here: the engine check passed and the run went on
        assert "LOADED False False 2" in proc.stdout, proc.stderr
        assert proc.stderr.startswith(error) and proc.stderr.count("\n") == 1


def test_a_good_config_gets_a_first_line_before_torch_loads(tmp_path, monkeypatch, capsys):
    # The line comes before the stage's heavy import, which here fails on purpose: nothing else
    # could have printed it. stdout, with the progress lines: stderr holds errors alone.
    import importlib

    real = importlib.import_module

    def no_stage(name, *args):
        if name == "tether.train.sft":
            raise RuntimeError("the stage module was imported")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_stage)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    try:
        main(["sft", "--model", "some/model", "--data", str(data), "--run-name", "r",
              "--output-dir", str(tmp_path)])
    except RuntimeError as exc:
        assert "stage module" in str(exc)
    out = capsys.readouterr().out
    assert out == "sft r: loading torch and transformers, then some/model\n"


EXIT_SCRIPT = """
import atexit, sys, threading, time
class Finalized:  # prints when the interpreter finalizes its modules
    def __del__(self):
        print("finalized", flush=True)
keep = Finalized()
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(1.0), print("thread joined"))).start()
print("buffered output")  # stdout is a pipe: block-buffered, so the exit must flush it
sys.argv = ["tether", "--version"]
from tether.cli import entry
entry()
"""


def _run_entry(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | env_extra
    return subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_torchrun_rank_exits_without_finalization_after_what_exit_runs_first():
    """Under torchrun (RANK and WORLD_SIZE set) `tether` ends through
    `distributed.exit_process`: the non-daemon thread is joined, atexit handlers run, buffered
    output is flushed, the code is main's, and the interpreter's finalization (where a rank with
    a gloo worker still alive could abort) never runs; without torchrun the plain exit does."""
    launched = _run_entry({"RANK": "0", "WORLD_SIZE": "1"})
    assert launched.returncode == 0, launched.stderr[-2000:]
    lines = launched.stdout.splitlines()
    assert lines[0] == "buffered output" and any(line.startswith("tether ") for line in lines)
    assert "thread joined" in lines and "atexit ran" in lines  # the thread outlives main (1 s)
    assert lines.index("thread joined") < lines.index("atexit ran")  # Python's own order
    assert "finalized" not in lines

    plain = _run_entry({})
    assert plain.returncode == 0 and "finalized" in plain.stdout.splitlines()
    assert "atexit ran" in plain.stdout


def test_a_torchrun_rank_keeps_the_exit_code():
    launched = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['tether', 'train']\n"
                               "from tether.cli import entry; entry()"],
        capture_output=True, text=True, timeout=120,
        env=os.environ | {"RANK": "0", "WORLD_SIZE": "1"})
    assert launched.returncode == 2 and launched.stderr.startswith("error: unknown stage")


def test_every_stage_module_ships_with_its_cli():
    # `tether <stage>` imports STAGES[stage].module after the preflight: every one ships in the
    # package (a missing one would end in a traceback, not an error line)
    import importlib

    for stage in STAGES.values():
        assert callable(importlib.import_module(stage.module).cli)
