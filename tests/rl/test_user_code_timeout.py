"""User code under a deadline (issue 33, cluster 7): a reward or gold function that never returns
ends the run with one line and exit 2 (--reward-fn-timeout), an environment's hung step with
one line (--env-timeout), a hung tool goes back to the model as the tool's error, and a
--dynamic-sampling search that finds nothing says so instead of looking like a hang.

Before: a reward function that never returned hung `tether ppo` with no output for ever, and
`--dynamic-sampling 100000` with a constant reward drew 100000 silent rounds per batch, holding
every one of them in memory.

A hung reward or gold function ends the process itself (tether.run.user_code.deadline: nothing can stop a
thread from outside), so those runs go through `python -m tether` in a subprocess; the rest
through `tether.cli.main`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from offline_fixtures import write_jsonl
from refusals import refused

import tether
from tether.cli import main
from tether.rl import dynamic_sampling
from tether.rl.reward.functions import call_reward_function

FNS = '''
import os, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))


def _calls(name):
    """How many times `name` was called, this call included (kept in a file beside this one)."""
    path = os.path.join(HERE, name + ".calls")
    n = (int(open(path).read()) if os.path.exists(path) else 0) + 1
    with open(path, "w") as f:
        f.write(str(n))
    return n


def length(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def constant(prompts, responses):
    return [1.0 for r in responses]


def slow(prompts, responses):
    time.sleep(0.05)
    return [len(r) / 10.0 for r in responses]


def hangs_second(prompts, responses):
    """Scores the first batch, then never returns."""
    if _calls("hangs_second") >= 2:
        time.sleep(10 ** 6)
    return [len(r) / 10.0 for r in responses]


def gold_hangs_second(prompts, responses):
    if _calls("gold_hangs_second") >= 2:
        time.sleep(10 ** 6)
    return [len(r) / 10.0 for r in responses]


def hangs_on_rank_1(prompts, responses):
    """Under torchrun: rank 1's second call never returns; rank 0 waits for it in a collective."""
    if os.environ.get("RANK") == "1" and _calls("rank_1") >= 2:
        time.sleep(10 ** 6)
    return [len(r) / 10.0 for r in responses]


def trl_hangs(completions, **kwargs):
    """TRL's form, beside a function that returns."""
    time.sleep(10 ** 6)


def spins(prompts, responses):
    """A pure-Python loop that never ends (no sleep, no C call to wait in)."""
    while True:
        pass


def wait(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "waited"


class HangingStep:
    def reset(self, row, seed):
        return row["prompt"]

    def step(self, action):
        time.sleep(10 ** 6)


class BlockingAsyncStep(HangingStep):
    """An async def step that waits without await: it holds the event loop."""

    async def step(self, action):
        time.sleep(10 ** 6)


class ExitingAsyncStep(HangingStep):
    async def step(self, action):
        sys.exit(3)  # EXIT LINE


class InterruptedAsyncStep(HangingStep):
    async def step(self, action):
        raise KeyboardInterrupt


async def quits(x: int) -> str:
    """Exit.

    Args:
        x: A number.
    """
    sys.exit(3)  # TOOL EXIT LINE


def interrupts(x: int) -> str:
    """Stop.

    Args:
        x: A number.
    """
    raise KeyboardInterrupt
'''

PROMPTS = [{"prompt": p} for p in ("the movie was", "a film", "it", "the plot")]
MESSAGE = ("did not return within 1 s (--reward-fn-timeout); fix the hang, or raise "
           "--reward-fn-timeout (0: no limit); checkpoints written so far are intact")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "fns.py").write_text(FNS)
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    write_jsonl(tmp_path / "held_out.jsonl", PROMPTS[:2])  # one --batch-size chunk: one call
    return tmp_path


def tether_process(cwd: Path, *argv: str, limit: float = 240) -> subprocess.CompletedProcess:
    """`python -m tether ARGV` from `cwd`, this checkout's tether first on the path."""
    src = str(Path(tether.__file__).resolve().parents[1])
    env = os.environ | {"PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tether", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=limit)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """Exit 2, one `error:` line, no traceback; the line."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    return errors[0]


def online(policy: Path, name: str, *extra: str, stage: str = "ppo", batch: int = 2,
           tokens: int = 3) -> list[str]:
    return [stage, "--policy", str(policy), "--prompts", "prompts.jsonl", "--run-name", name,
            "--output-dir", "runs", "--batch-size", str(batch), "--max-new-tokens", str(tokens),
            "--device", "cpu", "--report-to", "none", *extra]


# ----------------------------------------------------------------------------- reward functions

@pytest.mark.parametrize("hung", ["reward", "gold"])
def test_a_hung_function_ends_the_run_with_one_line_and_its_checkpoint(hung, files,
                                                                        tiny_model_dir, capsys,
                                                                        monkeypatch):
    """The second call hangs: the process ends about 1 s into the hang (before: no output, for
    ever) with batch 1's checkpoint complete, and `--resume` goes on from it once the function
    returns, with a longer timeout (a harmless change: it does not change what is trained).
    Gold: scored at step 0 and step 2, so step 1's checkpoint comes first."""
    fn = "hangs_second" if hung == "reward" else "gold_hangs_second"
    extra = (["--reward-fn", f"fns.py:{fn}"] if hung == "reward" else
             ["--reward-fn", "fns.py:length", "--gold-fn", f"fns.py:{fn}",
              "--eval-prompts", "held_out.jsonl", "--eval-every", "2"])
    argv = online(tiny_model_dir, hung, "--total-episodes", "6", "--save-every", "1",
                  "--reward-fn-timeout", "1", *extra)
    started = time.monotonic()
    line = one_error_line(tether_process(files, *argv))
    what = "reward function" if hung == "reward" else "gold reward function"
    assert line == f"error: {what} fns:{fn} {MESSAGE}"
    assert time.monotonic() - started < 200
    run = files / "runs" / hung
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_1"]
    assert not (run / "final").exists()
    (files / f"{fn}.calls").write_text("-100")  # fixed: it returns from now on
    monkeypatch.chdir(files)
    capsys.readouterr()
    longer = [("30" if before == "--reward-fn-timeout" else x)
              for before, x in zip(["", *argv], argv)]
    assert main([*longer, "--resume", "--resume-allow-changes"]) == 0
    assert re.search(rf"resuming \S*runs/{hung} from step 1", capsys.readouterr().err)
    assert (run / "final").is_dir()


def test_a_hung_trl_style_function_among_several_on_llama(files, tiny_llama_dir):
    done = tether_process(files, *online(tiny_llama_dir, "several", "--total-episodes", "4",
                                         "--samples-per-prompt", "2", "--reward-fn",
                                         "fns.py:length,fns.py:trl_hangs", "--reward-weights",
                                         "1,0.5", "--reward-fn-timeout", "1", stage="grpo"))
    assert one_error_line(done) == f"error: reward function fns:trl_hangs {MESSAGE}"
    assert not (files / "runs" / "several" / "final").exists()


@pytest.mark.parametrize("flag, fn, what", [
    ("--gold-fn", "sleeps", "gold reward function fns:gold_hangs_second"),
    ("--reward-fn", "spins", "reward function fns:spins"),
], ids=["gold-sleeps", "reward-spins"])
def test_tether_eval_ends_on_a_hung_gold_or_spinning_reward(flag, fn, what, files,
                                                            tiny_llama_dir):
    if fn == "sleeps":
        (files / "gold_hangs_second.calls").write_text("1")  # the next call hangs
        fn = "gold_hangs_second"
    done = tether_process(files, "eval", "--model", str(tiny_llama_dir), "--prompts",
                          "prompts.jsonl", flag, f"fns.py:{fn}", "--reward-fn-timeout", "1",
                          "--output", "eval.json", "--max-new-tokens", "3", "--device", "cpu")
    assert one_error_line(done) == f"error: {what} {MESSAGE}"
    assert not (files / "eval.json").exists()


@pytest.mark.slow
def test_under_torchrun_the_hung_rank_ends_the_job(files, tiny_model_dir):
    """Rank 1 hangs in batch 2 while rank 0 waits for it: rank 1 prints the line and ends, and
    torchrun stops rank 0 (before: both waited for ever, or rank 0 for the 600 s collective
    timeout). Batch 1's checkpoint stays."""
    from torchrun_helpers import torchrun

    started = time.monotonic()
    done = torchrun(["-m", "tether", "ppo", "--policy", str(tiny_model_dir), "--prompts",
                     str(files / "prompts.jsonl"), "--run-name", "dist", "--output-dir",
                     str(files / "runs"), "--batch-size", "4", "--total-episodes", "8",
                     "--max-new-tokens", "3", "--save-every", "1", "--device", "cpu",
                     "--report-to", "none", "--reward-fn", f"{files / 'fns.py'}:hangs_on_rank_1",
                     "--reward-fn-timeout", "1"], timeout=200)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and errors == [
        f"error: reward function fns:hangs_on_rank_1 {MESSAGE}"], done.stderr
    assert time.monotonic() - started < 150
    assert [p.name for p in (files / "runs" / "dist" / "checkpoints").iterdir()] == ["step_1"]


def test_a_function_that_returns_in_time_gives_bit_identical_results(files, tiny_model_dir,
                                                                     monkeypatch):
    """The valid neighbour: a slow function inside its deadline, with the deadline and without
    it: the same scores, the same final weights."""
    monkeypatch.chdir(files)
    for name, timeout in (("limited", "5"), ("unlimited", "0")):
        assert main(online(tiny_model_dir, name, "--total-episodes", "4", "--reward-fn",
                           "fns.py:slow", "--reward-fn-timeout", timeout, "--lr", "1e-3")) == 0

    def scores(name):
        return [json.loads(x)["objective/score"]
                for x in (files / "runs" / name / "metrics.jsonl").read_text().splitlines()
                if "objective/score" in x]

    def weights(name):
        return (files / "runs" / name / "final" / "model.safetensors").read_bytes()
    assert scores("limited") == scores("unlimited") and len(scores("limited")) == 2
    assert weights("limited") == weights("unlimited")


@pytest.mark.parametrize("command", ["ppo", "eval", "bon", "interpolate"])
def test_the_timeout_reaches_every_call(command, files, tiny_model_dir, monkeypatch):
    """Every reward and gold call runs under --reward-fn-timeout's seconds (the deadlines seen,
    by what they name), in training (its evaluations too), in `tether eval` and in the baselines
    (`tether bon`'s pool, `tether interpolate`'s points)."""
    from tether.rl.reward import functions

    seen, real = [], functions.Deadline

    def spy(seconds, message):  # the line is built only when a deadline passes: built here
        seen.append((seconds, message().split(" fns:")[0]))
        return real(seconds, message)
    monkeypatch.setattr(functions, "Deadline", spy)
    monkeypatch.chdir(files)
    functions = ["--reward-fn", "fns.py:length", "--gold-fn", "fns.py:length",
                 "--reward-fn-timeout", "7"]
    if command == "ppo":
        assert main(online(tiny_model_dir, "reach", "--total-episodes", "2", "--eval-prompts",
                           "held_out.jsonl", *functions)) == 0
    else:
        target = {"bon": ["--model", str(tiny_model_dir), "--n", "2", "--output", "bon.json"],
                  "interpolate": ["--from", str(tiny_model_dir), "--to", str(tiny_model_dir),
                                  "--points", "0,1", "--output-dir", "line"]}.get(
            command, ["--model", str(tiny_model_dir), "--output", "eval.json"])
        assert main([command, *target, "--prompts", "prompts.jsonl", "--max-new-tokens", "3",
                     "--device", "cpu", *functions]) == 0
    assert {what for _, what in seen} == {"reward function", "gold reward function"}
    assert {seconds for seconds, _ in seen} == {7.0}


def test_one_watchdog_thread_and_microseconds_per_call():
    """No thread per call: the first deadline starts the one watchdog, later calls reuse it;
    each call costs microseconds more (a thread per call costs tens)."""
    def fast(prompts, responses):
        return [0.0] * len(responses)
    call_reward_function(fast, ["p"], ["r"], timeout=600)
    threads = threading.active_count()
    best = {}
    for timeout in (0, 600, 0, 600):
        started = time.perf_counter()
        for _ in range(2000):
            call_reward_function(fast, ["p"], ["r"], timeout=timeout)
        took = (time.perf_counter() - started) / 2000
        best[timeout] = min(best.get(timeout, took), took)
    assert threading.active_count() == threads
    assert [t.name for t in threading.enumerate()].count("tether-watchdog") == 1
    assert best[600] - best[0] < 20e-6, best


@pytest.mark.parametrize("argv, pattern", [
    (["--reward-fn", "fns.py:length", "--reward-fn-timeout", "-1"],
     r"config field 'reward_fn_timeout' must be >= 0, got -1"),
    (["--reward-model", "rm", "--reward-fn-timeout", "30"],
     r"--reward-fn-timeout 30 limits the calls of --reward-fn and --gold-fn functions, and "
     r"this run has none; drop it"),
], ids=["negative", "no-functions"])
def test_a_timeout_that_cannot_apply_is_refused(argv, pattern, files, tiny_model_dir, capsys,
                                                monkeypatch):
    monkeypatch.chdir(files)
    refused(files, ["ppo", "--policy", str(tiny_model_dir), "--prompts", "prompts.jsonl",
                    "--output-dir", "runs", *argv], pattern, capsys)


def test_eval_refuses_a_timeout_without_functions(files, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(files)
    refused(files, ["eval", "--model", str(tiny_model_dir), "--prompts", "prompts.jsonl",
                    "--output", "eval.json", "--reward-fn-timeout", "5"],
            r"--reward-fn-timeout 5 limits the calls", capsys)


# ----------------------------------------------------------------------------- environments, tools

def test_a_hung_environment_step_ends_the_process(files, tiny_model_dir):
    """--env-timeout's line, exit 2, and the process exits: the thread still in step() is a
    daemon, which does not keep the interpreter alive."""
    done = tether_process(files, *online(tiny_model_dir, "env", "--total-episodes", "2",
                                         "--env", "fns.py:HangingStep", "--env-timeout", "1"))
    assert re.fullmatch(r"error: environment fns:HangingStep: step of .* did not return within "
                        r"1 s; fix the hang or raise --env-timeout .*", one_error_line(done))


def test_a_hung_tool_goes_back_to_the_model_as_its_error(files, tiny_qwen2_tools_dir, capsys,
                                                         monkeypatch):
    """Through the CLI, with an engine that calls `wait` (a random tiny model writes no calls):
    each call passes --env-timeout 0.5, goes back to the model as the tool's error, is counted,
    and is said once; the run finishes (exit 0)."""
    from tether.models.pretrained import load_tokenizer
    from tether.train import ppo_setup

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "env"))
    Scripted = importlib.import_module("episode_helpers").Scripted

    tokenizer = load_tokenizer(str(tiny_qwen2_tools_dir))
    call = '<tool_call>\n{"name": "wait", "arguments": {"seconds": 3}}\n</tool_call>'
    engine = Scripted(tokenizer, lambda context: "done" if "<tool_response>" in context else call)
    monkeypatch.setattr(ppo_setup, "make_engine", lambda *args, **kwargs: engine)
    monkeypatch.chdir(files)
    capsys.readouterr()
    assert main(online(tiny_qwen2_tools_dir, "tools", "--total-episodes", "2", "--tools",
                       "fns.py:wait", "--reward-fn", "fns.py:length", "--env-timeout", "0.5",
                       "--max-prompt-len", "512", tokens=200)) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: tool")]
    assert warnings == ["warning: tool wait did not return within 0.5 s (--env-timeout); the "
                        "call went back to the model as an error (counted in env/tool_errors) "
                        "and is left running; fix the tool or raise --env-timeout"]
    told = [c for c in engine.contexts if "<tool_response>" in c]
    assert told and all("error: wait did not return within 0.5 s" in c for c in told)
    last = json.loads((files / "runs" / "tools" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["env/tool_errors"] == last["env/tool_calls"] > 0


@pytest.mark.parametrize("command", ["grpo", "eval"])
def test_an_async_step_that_blocks_the_event_loop_ends_the_process(command, files,
                                                                   tiny_model_dir):
    """`async def step` calling time.sleep holds the loop every timeout runs on (before: the run
    hung for ever, even with --env-timeout 5): the guard ends it about 1 + LOOP_GRACE_S s in,
    with one line naming the call, exit 2."""
    from tether.run.user_code.calls import LOOP_GRACE_S

    env = ["--env", "fns.py:BlockingAsyncStep", "--env-timeout", "1"]
    argv = (online(tiny_model_dir, "blocked", "--total-episodes", "2", "--samples-per-prompt",
                   "2", *env, stage="grpo") if command == "grpo" else
            ["eval", "--model", str(tiny_model_dir), "--prompts", "prompts.jsonl", *env,
             "--output", "eval.json", "--max-new-tokens", "3", "--device", "cpu"])
    started = time.monotonic()
    done = tether_process(files, *argv, limit=120)
    assert re.fullmatch(r"error: environment fns:BlockingAsyncStep: step of .*, turn 0 did not "
                        r"return within 1 s \(--env-timeout\) and holds the event loop, so no "
                        r"timeout can act: an async def function .*", one_error_line(done))
    assert "Task" not in done.stderr
    assert time.monotonic() - started > 1 + LOOP_GRACE_S  # the guard, not a timeout, ended it


def _line_of(mark: str) -> int:
    return FNS.splitlines().index(next(x for x in FNS.splitlines() if mark in x)) + 1


def test_sys_exit_or_ctrl_c_in_an_async_step_is_the_caller_s(files, tiny_model_dir):
    """SystemExit raised on the event loop is the environment's one error line, exit 2; a
    KeyboardInterrupt raised there stops the run as Ctrl-C does (exit 130). Before: asyncio let
    both out of the loop, with its tracebacks ("Task exception was never retrieved")."""
    exits = tether_process(files, *online(tiny_model_dir, "exits", "--total-episodes", "2",
                                          "--env", "fns.py:ExitingAsyncStep"))
    assert re.fullmatch(r"error: environment fns:ExitingAsyncStep: step of .*, turn 0 raised "
                        rf"SystemExit\(3\): it called sys.exit \(at fns.py:{_line_of('EXIT LINE')}"
                        r"\); fix the environment \(what the run wrote before is intact\)",
                        one_error_line(exits))
    assert "Task" not in exits.stderr
    stopped = tether_process(files, *online(tiny_model_dir, "stopped", "--total-episodes", "2",
                                            "--env", "fns.py:InterruptedAsyncStep"))
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.splitlines()[-1].startswith("interrupted: quit at once")
    assert "Traceback" not in stopped.stderr and "Task" not in stopped.stderr
    assert "error:" not in stopped.stderr


def test_sys_exit_or_ctrl_c_in_a_tool_is_the_caller_s(files, tiny_qwen2_tools_dir, capsys,
                                                      monkeypatch):
    """An `async def` tool that calls sys.exit goes back to the model as its error, as a raise
    does, and the run goes on (exit 0); a tool that raises KeyboardInterrupt stops the run as
    Ctrl-C does (exit 130). No traceback either way, and nothing of asyncio's."""
    import gc

    from tether.models.pretrained import load_tokenizer
    from tether.train import ppo_setup

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "env"))
    Scripted = importlib.import_module("episode_helpers").Scripted
    tokenizer = load_tokenizer(str(tiny_qwen2_tools_dir))
    monkeypatch.chdir(files)
    results = {}
    for tool in ("quits", "interrupts"):
        call = f'<tool_call>\n{{"name": "{tool}", "arguments": {{"x": 1}}}}\n</tool_call>'
        engine = Scripted(tokenizer, lambda context, call=call: (
            "done" if "<tool_response>" in context else call))
        monkeypatch.setattr(ppo_setup, "make_engine", lambda *args, engine=engine, **kw: engine)
        capsys.readouterr()
        code = main(online(tiny_qwen2_tools_dir, tool, "--total-episodes", "2", "--tools",
                           f"fns.py:{tool}", "--reward-fn", "fns.py:length",
                           "--max-prompt-len", "512", tokens=200))
        gc.collect()  # an asyncio task left behind would say so now
        results[tool] = (code, capsys.readouterr().err, engine.contexts)
    code, err, contexts = results["quits"]
    assert code == 0 and "Traceback" not in err and "Task" not in err, err
    told = [c for c in contexts if "<tool_response>" in c]
    assert told and all(f"error: SystemExit(3): it called sys.exit (at fns.py:"
                        f"{_line_of('TOOL EXIT LINE')})" in c for c in told)
    code, err, _ = results["interrupts"]
    assert code == 130 and "Traceback" not in err and "Task" not in err, err
    assert err.splitlines()[-1].startswith("interrupted: quit at once")


# ----------------------------------------------------------------------------- dynamic sampling

def test_dynamic_sampling_above_its_cap_is_refused(files, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(files)
    refused(files, online(tiny_model_dir, "cap", "--reward-fn", "fns.py:constant",
                          "--samples-per-prompt", "2", "--dynamic-sampling", "100000",
                          stage="grpo"),
            r"--dynamic-sampling 100000 is more than 100 extra rounds per batch, each as costly as "
            r"the batch itself; .*: give at most 100", capsys)


@pytest.mark.parametrize("fn", ["constant", "length"])
def test_a_search_that_finds_nothing_says_so(fn, files, tiny_model_dir, capsys, monkeypatch):
    """A constant reward: a note per round (the interval set to 0 here; 30 s by default) and
    one when the rounds run out, saying what the batch holds instead. The neighbour, a reward
    whose groups differ (or that the rounds fill), says nothing. --dynamic-sampling 100, the
    cap, is accepted."""
    monkeypatch.setattr(dynamic_sampling, "NOTE_EVERY_S", 0.0)
    monkeypatch.chdir(files)
    capsys.readouterr()
    rounds = "2" if fn == "constant" else "100"
    assert main(online(tiny_model_dir, fn, "--total-episodes", "4", "--samples-per-prompt", "2",
                       "--reward-fn", f"fns.py:{fn}", "--dynamic-sampling", rounds,
                       stage="grpo", batch=4, tokens=6)) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note: batch")]
    if fn == "length":
        assert not any("drew all its rounds" in x for x in notes), notes
        return
    why = ("the reward may be constant: check it; or the prompts are too easy or too hard for "
           "the policy")
    assert notes == [
        f"note: batch 1: dynamic sampling round 1 of 2 has found 0 of 2 groups with differing "
        f"rewards ({why})",
        f"note: batch 1: --dynamic-sampling 2 drew all its rounds and found 0 of 2 groups with "
        f"differing rewards: the batch is topped up with 2 groups of equal rewards, which add "
        f"only the KL term's gradient ({why})"]
