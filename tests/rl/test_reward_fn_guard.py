"""A user's reward or gold function, held to one line (issue 23): what it may return, what it
may raise (sys.exit included), and how `module:function` is found from the `tether` command.

Before: a set was accepted and its iteration order assigned the scores; `sys.exit(0)` in a
reward function ended `tether ppo` with exit 0 and nothing but config.yaml written; `--gold-fn
task:gold` failed from the `tether` script (its import path starts at its own bin directory).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from offline_fixtures import write_jsonl

from tether.cli import main
from tether.errors import TetherError
from tether.rl.reward.functions import call_reward_function
from tether.run.user_code.load import load_function

PROMPTS, RESPONSES = ["p0", "p1", "p2"], ["a", "bb", "ccc"]


def _returning(value):
    def fn(prompts, responses):
        return value
    return fn


@pytest.mark.parametrize("returned", [
    [3.0, 1.0, 2.0], (3, 1, 2), torch.tensor([3.0, 1.0, 2.0]), np.array([3.0, 1.0, 2.0]),
    [np.float32(3.0), np.int64(1), torch.tensor(2.0)], [3.0, True, 2],
], ids=["list", "tuple", "tensor", "ndarray", "scalars", "bool"])
def test_ordered_real_scores_are_taken_in_order(returned):
    scores = call_reward_function(_returning(returned), PROMPTS, RESPONSES)
    assert scores.dtype == torch.float32 and scores.tolist() == [3.0, 1.0, 2.0]


@pytest.mark.parametrize("returned, shown", [
    ({3.0, 1.0, 2.0}, r"returned set \{.*\} \(a set has no order: its scores would go to the "
                      r"wrong responses\), not a list of numbers in the responses' order"),
    (frozenset({3.0, 1.0, 2.0}), r"returned frozenset .*a set has no order"),
    ({"a": 3.0, "bb": 1.0, "ccc": 2.0}, "returned dict"),
    ((float(len(r)) for r in RESPONSES), "returned generator"),
    ("312", "returned str 312"),
    (None, "returned NoneType None"),
    (3.0, "returned float 3.0"),
    (torch.zeros(3, 1), "returned Tensor"),
    (np.zeros((3, 1)), "returned ndarray"),
    ([1j, 2j, 3j], r"returned list \[1j"),
    (["3", "1", "2"], "returned list"),
    ([[3.0], [1.0], [2.0]], "returned list"),
    ([3.0, None, 2.0], "returned list"),
], ids=["set", "frozenset", "dict", "generator", "str", "none", "scalar", "2d-tensor",
        "2d-ndarray", "complex", "strings", "nested", "a-none"])
def test_unordered_or_unreal_scores_are_one_line(returned, shown):
    fn = _returning(returned)
    with pytest.raises(TetherError) as info:
        call_reward_function(fn, PROMPTS, RESPONSES, "gold reward function")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"gold reward function {__name__}:_returning.<locals>.fn returned")
    assert re.search(shown, message), message
    assert message.endswith("it must return a list of one finite float per response, in their "
                            "order")


def test_a_set_really_scrambles_the_scores():
    """Why a set is refused: its iteration order is not the responses' order. Scores 3, 1, 2
    for responses 0, 1, 2 come back out of a set as 1, 2, 3 (small ints hash to themselves)."""
    assert list({3.0, 1.0, 2.0}) == [1.0, 2.0, 3.0] != [3.0, 1.0, 2.0]


def _at(marker: str) -> str:
    """`path:line` of the line of this file that ends in `# marker`, as the message shows it
    (relative to the working directory when under it)."""
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.rstrip().endswith(f"# {marker}"))
    where = os.path.relpath(__file__)
    return f"{__file__ if where.startswith('..') else where}:{line}"


@pytest.mark.parametrize("code", [0, 1, "bye"])
def test_sys_exit_in_a_reward_function_is_one_line(code):
    def exits(prompts, responses):
        raise SystemExit(code)  # RAISE LINE
    with pytest.raises(TetherError) as info:
        call_reward_function(exits, PROMPTS, RESPONSES)
    message = str(info.value)
    assert message.startswith(f"reward function {__name__}:test_sys_exit_in_a_reward_function_is_"
                              f"one_line.<locals>.exits raised SystemExit({code!r}): it called "
                              f"sys.exit (at {_at('RAISE LINE')})")
    assert "checkpoints written so far are intact" in message
    assert isinstance(info.value.__cause__, SystemExit)


def test_an_exception_names_the_line_of_the_users_own_file():
    """The innermost frame of the function's own file, not json's decoder where it surfaced;
    the whole traceback stays on __cause__ for a Python caller."""
    def parses(prompts, responses):
        return [json.loads("{") for _ in responses]  # PARSE LINE
    with pytest.raises(TetherError) as info:
        call_reward_function(parses, PROMPTS, RESPONSES)
    message = str(info.value)
    assert (f"raised JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
            f"column 2 (char 1) (at {_at('PARSE LINE')})") in message
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def test_ctrl_c_in_a_reward_function_stays_ctrl_c():
    def interrupted(prompts, responses):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        call_reward_function(interrupted, PROMPTS, RESPONSES)


def test_a_module_that_exits_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "leaves.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TetherError, match=r"cannot import leaves.py for reward function "
                       r"'leaves.py:f': SystemExit\(0\): it called sys.exit \(at leaves.py:2\)"):
        load_function("leaves.py:f", "reward function")


def test_a_module_name_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """As `python -m` finds it: the current directory first, also when the import path does not
    hold it (the `tether` script's does not), and its function's own imports find neighbours."""
    name = "h23_task_module"
    (tmp_path / f"{name}.py").write_text(
        "def gold(prompts, responses):\n    import h23_helper\n"
        "    return [h23_helper.LENGTH(r) for r in responses]\n")
    (tmp_path / "h23_helper.py").write_text("LENGTH = len\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for module in (name, "h23_helper"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ModuleNotFoundError):  # the premise: a plain import does not see it
        __import__(name)
    gold = load_function(f"{name}:gold", "reward function")
    assert call_reward_function(gold, PROMPTS, RESPONSES).tolist() == [1.0, 2.0, 3.0]
    for module in (name, "h23_helper"):
        sys.modules.pop(module, None)


# ----------------------------------------------------------------------------- through the CLI

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("guard")
    write_jsonl(base / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    (base / "fns.py").write_text(
        "import sys\n"
        "def as_set(prompts, responses):\n    return {float(len(r)) for r in responses}\n"
        "def exits(prompts, responses):\n    sys.exit(0)\n")
    return base


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_llama_dir"], ids=["gpt2", "llama"])
@pytest.mark.parametrize("fn, pattern", [
    ("as_set", r"reward function fns:as_set returned set .*a set has no order"),
    ("exits", r"reward function fns:exits raised SystemExit\(0\): it called sys.exit "
              r"\(at .*fns.py:5\)"),
], ids=["set", "sys-exit"])
def test_ppo_stops_with_one_line_and_exit_2(files, model, fn, pattern, request, capsys,
                                            monkeypatch):
    monkeypatch.chdir(files)
    out = files / "runs" / model
    argv = ["ppo", "--policy", str(request.getfixturevalue(model)), "--prompts", "prompts.jsonl",
            "--reward-fn", f"fns.py:{fn}", "--run-name", fn, "--output-dir", str(out),
            "--batch-size", "2", "--total-episodes", "2", "--max-new-tokens", "2",
            "--device", "cpu"]
    capsys.readouterr()
    assert main(argv) == 2  # before: 0 for both (a set trained, sys.exit(0) ended the run)
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.strip() and not line.startswith(f"ppo {fn}")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), lines
    run = out / fn
    assert not (run / "final").exists() and not (run / "checkpoints").exists()


def test_eval_stops_on_a_gold_function_that_exits(files, tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.chdir(files)
    capsys.readouterr()
    assert main(["eval", "--model", str(tiny_llama_dir), "--prompts", "prompts.jsonl",
                 "--gold-fn", "fns.py:exits", "--output", "eval.json", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gold reward function fns:exits raised SystemExit(0)" in err[0]
    assert not (files / "eval.json").exists()


def test_the_tether_script_finds_both_forms_in_the_current_directory(tmp_path, tiny_model_dir):
    """`tether eval --reward-fn task.py:proxy --gold-fn task:gold` from the directory that holds
    task.py, through the console script (not `python -m`, which would put the directory on the
    path itself): both functions load and score, checked against the samples they scored."""
    script = Path(sys.executable).with_name("tether")
    if not script.is_file():
        pytest.skip("the tether console script is not installed (pip install -e .)")
    (tmp_path / "task.py").write_text(
        "def gold(prompts, responses):\n    return [float(len(r)) for r in responses]\n"
        "def proxy(prompts, responses):\n    return [float(r.count(' ')) for r in responses]\n")
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(script), "eval", "--model", str(tiny_model_dir), "--prompts",
                           "prompts.jsonl", "--reward-fn", "task.py:proxy", "--gold-fn",
                           "task:gold", "--output", "eval.json", "--max-new-tokens", "6",
                           "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # before: "cannot import task ... No module named"
    record = json.loads((tmp_path / "eval.json").read_text())
    responses = [s["response"] for s in record["samples"]]
    assert [s["gold_score"] for s in record["samples"]] == [float(len(r)) for r in responses]
    assert [s["score"] for s in record["samples"]] == [float(r.count(" ")) for r in responses]
    assert record["metrics"]["eval/gold_score"] == pytest.approx(
        sum(len(r) for r in responses) / len(responses))


def test_the_demo_records_its_gold_function_and_a_rerun_keeps_it(tmp_path, tiny_model_dir,
                                                                 monkeypatch, capsys):
    """The demo's PPO runs were scored on gold through a Python object, so config.yaml said
    `gold_fn: ''` and a run re-made from it had no gold evaluation. Now it names the function:
    the re-made run scores gold again, the same numbers, and they are the gold reward of the
    samples it logged."""
    import yaml

    from tether.demo import pipeline, task
    from tether.demo.config import DemoConfig
    from tether.models.pretrained import load_tokenizer
    from tether.models.reward_model import RewardModel

    tokenizer = load_tokenizer(str(tiny_model_dir))
    RewardModel.from_causal_lm(str(tiny_model_dir), tokenizer).save_pretrained(tmp_path / "rm",
                                                                               tokenizer)
    paths = {"prompts": str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the movie"}] * 4)),
             "eval_prompts": str(write_jsonl(tmp_path / "e.jsonl",
                                             [{"prompt": "the plot"}, {"prompt": "it was"}]))}
    monkeypatch.setattr(pipeline, "PPO_BATCH", 4)  # the demo's sizes, made tiny
    monkeypatch.setattr(pipeline, "MAX_NEW_TOKENS", 4)
    pipeline.run_ppo(tmp_path, DemoConfig(ppo_batches=1, device="cpu"), paths,
                     str(tiny_model_dir), str(tmp_path / "rm"), "ppo-fixed", 0)
    config = tmp_path / "ppo-fixed-seed0" / "config.yaml"
    recorded = yaml.safe_load(config.read_text())["gold_fn"]
    assert recorded == "tether.demo.task:gold_reward"
    assert load_function(recorded, "reward function") is task.gold_reward

    assert main(["ppo", "--config", str(config), "--run-name", "again"]) == 0
    def step0(run):
        metrics = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text()
                   .splitlines()]
        samples = json.loads((tmp_path / run / "samples.jsonl").read_text().splitlines()[0])
        return next(m for m in metrics if m["step"] == 0), samples
    first, samples = step0("ppo-fixed-seed0")
    again, _ = step0("again")
    assert samples["step"] == 0 and "eval/gold_score" in again
    assert again["eval/gold_score"] == first["eval/gold_score"]
    rows = samples["samples"]
    gold = task.gold_reward([r["prompt"] for r in rows], [r["response"] for r in rows])
    assert first["eval/gold_score"] == pytest.approx(sum(gold) / len(gold), abs=1e-6)
