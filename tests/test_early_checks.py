"""Checks that need no model run before any model is loaded (issue 23).

Every weight load of every stage goes through transformers' `PreTrainedModel.from_pretrained`
(tether.models.pretrained and the reward-model loaders call the auto classes, which call it).
Each case below replaces it with a function that fails the test, gives a bad input that can be
found without a model (a reward or gold function that cannot be imported, a prompt file that
does not parse, a reference on another path or vocabulary, two proxy rewards, a sweep grid's
gold function), and asserts the CLI's one `error:` line came, the loader was never called, and
nothing on disk changed. `test_the_guard_sees_a_model_load` shows the guard does catch the loads
the stages make.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import transformers
import yaml
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from processes import same_settings_env
from refusals import refused

from tether.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("early")
    write_jsonl(base / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    write_jsonl(base / "prefs.jsonl", preference_rows(4))
    write_jsonl(base / "sft.jsonl", sft_rows(4))
    files = {
        "bad.jsonl": '{"x": 1}\n',
        "rewards.py": "def score(prompts, responses):\n    return [0.0] * len(responses)\n",
        "notcallable.py": "score = 3\n",
        "exits.py": "import sys\nsys.exit(0)\n",
        "raises.py": "import json\njson.loads('{')\n",
    }
    for name, text in files.items():
        (base / name).write_text(text, encoding="utf-8")
    (base / "runs").mkdir()
    return base


@pytest.fixture
def loads(monkeypatch):
    """Every model load's class name, recorded (the load goes ahead)."""
    calls = []
    real = transformers.PreTrainedModel.from_pretrained.__func__

    def record(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(record))
    return calls


PPO = ["--prompts", "prompts.jsonl", "--output-dir", "runs", "--run-name", "x", "--device", "cpu"]
EVAL = ["--prompts", "prompts.jsonl", "--output", "runs/eval.json", "--device", "cpu"]
CASES = [  # (argv with POLICY / OTHER standing for the models, pattern of the one line)
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "rewards.py:score", "--gold-fn",
      "nope.py:gold", "--eval-prompts", "prompts.jsonl"], "reward function file nope.py does not exist"),
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "no_such_module_anywhere:score"],
     "cannot import no_such_module_anywhere .*ModuleNotFoundError"),
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "exits.py:score"],
     r"cannot import .*exits.py.*SystemExit\(0\): it called sys.exit \(at .*exits.py:2\)"),
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "rewards.py:score", "--eval-prompts",
      "bad.jsonl"], "row 0 has neither a 'prompt' nor a 'messages' field"),
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "rewards.py:score", "--ref-model",
      "./no_such_model"], "model path ./no_such_model does not exist"),
    (["ppo", "--policy", "POLICY", *PPO, "--reward-fn", "rewards.py:score", "--ref-model",
      "OTHER"], "reference model's tokenizer has a different vocabulary"),
    (["rloo", "--policy", "POLICY", *PPO, "--reward-fn", "notcallable.py:score"],
     "has no callable named 'score'"),
    (["grpo", "--policy", "POLICY", *PPO, "--reward-fn", "raises.py:score"],
     r"cannot import .*JSONDecodeError.*\(at .*raises.py:2\)"),
    (["dpo", "--model", "POLICY", "--data", "prefs.jsonl", "--output-dir", "runs", "--run-name",
      "x", "--device", "cpu", "--ref-model", "./no_such_model"], "model path ./no_such_model"),
    (["dpo", "--model", "POLICY", "--data", "prefs.jsonl", "--output-dir", "runs", "--run-name",
      "x", "--device", "cpu", "--ref-model", "OTHER"], "different vocabulary"),
    (["sft", "--model", "POLICY", "--data", "bad.jsonl", "--output-dir", "runs", "--run-name",
      "x", "--device", "cpu"], "row 0 is not an SFT row"),
    (["rm", "--model", "POLICY", "--data", "prefs.jsonl", "--eval-data", "nope.jsonl",
      "--output-dir", "runs", "--run-name", "x", "--device", "cpu"], "nope.jsonl not found"),
    (["eval", "--model", "POLICY", *EVAL, "--gold-fn", "nope.py:gold"],
     "reward function file nope.py does not exist"),
    (["eval", "--model", "POLICY", *EVAL, "--reward-fn", "exits.py:score"],
     r"SystemExit\(0\): it called sys.exit"),
    (["eval", "--model", "POLICY", *EVAL, "--reward-fn", "rewards.py:score", "--reward-model",
      "POLICY"], "give at most one proxy reward"),
    (["eval", "--model", "POLICY", *EVAL, "--reward-model", "POLICY"], "is not a reward model"),
    (["eval", "--model", "POLICY", "--prompts", "bad.jsonl", "--output", "runs/eval.json",
      "--device", "cpu"], "row 0 has neither a 'prompt' nor a 'messages' field"),
    (["eval", "--model", "POLICY", *EVAL, "--reference", "OTHER"], "different vocabulary"),
    (["generate", "--model", "POLICY", "--prompts", "bad.jsonl", "--device", "cpu"],
     "row 0 has neither a 'prompt' nor a 'messages' field"),
    (["generate", "--model", "POLICY", "--prompts", "nope.jsonl", "--device", "cpu"],
     "nope.jsonl not found"),
]
MODELS = [("tiny_model_dir", "tiny_llama_dir"), ("tiny_llama_dir", "tiny_model_dir")]


def _run_refused(root, argv, pattern, capsys, monkeypatch, no_loads):
    monkeypatch.chdir(root)
    refused(root, argv, pattern, capsys)
    assert no_loads == [], f"models loaded before the error: {no_loads}"


IDS = ["ppo-gold-missing", "ppo-module-missing", "ppo-exit-on-import", "ppo-bad-eval-prompts",
       "ppo-ref-missing", "ppo-ref-vocab", "rloo-not-callable", "grpo-raises-on-import",
       "dpo-ref-missing", "dpo-ref-vocab", "sft-bad-data", "rm-eval-data-missing",
       "eval-gold-missing", "eval-exit-on-import", "eval-two-proxies", "eval-not-a-reward-model",
       "eval-bad-prompts", "eval-reference-vocab", "generate-bad-prompts",
       "generate-prompts-missing"]


# Every case on GPT-2 and on Llama (its BOS and chat template), but for the stages whose check
# reads no model-specific file (sft's rows, rm's paths, rloo/grpo: ppo's own code path).
PARAMS = [pytest.param(argv, pattern, models, id=f"{name}-{kind}")
          for (argv, pattern), name in zip(CASES, IDS, strict=True)
          for models, kind in zip(MODELS, ("gpt2", "llama"), strict=True)
          if kind == "gpt2" or argv[0] not in ("sft", "rm", "rloo", "grpo")]


@pytest.mark.parametrize("argv, pattern, models", PARAMS)
def test_found_before_any_model_loads(root, argv, pattern, models, request, capsys, monkeypatch,
                                      no_loads):
    names = {"POLICY": str(request.getfixturevalue(models[0])),
             "OTHER": str(request.getfixturevalue(models[1]))}
    _run_refused(root, [names.get(a, a) for a in argv], pattern, capsys, monkeypatch, no_loads)


def test_a_grid_gold_function_is_checked_before_any_run(root, tiny_model_dir, capsys,
                                                        monkeypatch, no_loads):
    """A DPO run's evaluation met a bad gold_fn only after its training (three model loads and a
    finished DPO run, exit 1); now the sweep refuses it before it writes anything."""
    grid = {"name": "g", "output_dir": "runs", "seeds": [0],
            "dpo": {"model": str(tiny_model_dir), "data": "prefs.jsonl", "max_steps": 1,
                    "batch_size": 4, "device": "cpu", "beta": [0.1]},
            "eval": {"prompts": "prompts.jsonl", "gold_fn": "nope.py:gold", "device": "cpu"}}
    (root / "grid.yaml").write_text(yaml.safe_dump(grid), encoding="utf-8")
    _run_refused(root, ["sweep", "grid.yaml"], "^error: grid: reward function file nope.py does "
                 "not exist", capsys, monkeypatch, no_loads)
    assert not (root / "runs" / "g").exists()


def test_the_guard_sees_a_model_load(root, tiny_model_dir, capsys, monkeypatch, loads):
    """The guard is not vacuous: a good `tether eval` loads the policy and its reference through
    it (so a stage that loaded before checking would fail the tests above)."""
    monkeypatch.chdir(root)
    assert main(["eval", "--model", str(tiny_model_dir), *EVAL, "--max-new-tokens", "2"]) == 0
    assert loads == ["GPT2LMHeadModel", "GPT2LMHeadModel"]


NO_MODEL = ["--prompts", "prompts.jsonl", "--device", "cpu"]
BEFORE_TORCH = [  # (argv, the one line's start): each needs no model, and --policy/--model is none
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--env", "env.py:make_env",
      "--reward-workers", "2"], "--reward-workers 2 scores a batch's responses in parallel"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--env", "env.py:make_env",
      "--reward-fn", "rewards.py:score"], "an environment rewards its own episodes"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--tools", "tools.py:add",
      "--reward-model", "./rm"], "--tools episodes are scored by --reward-fn"),
    (["ppo", "--policy", "./no_such_model", *NO_MODEL, "--reward-model", "./rm", "--reward-fn",
      "rewards.py:score"], "give exactly one reward: .* \\(got --reward-fn, --reward-model\\)"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--reward-model", "./rm",
      "--reward-weights", "1"], "--reward-weights weighs reward functions"),
    (["eval", "--model", "./no_such_model", *NO_MODEL, "--reward-url", "localhost:8000"],
     "--reward-url localhost:8000 is not an http:// URL"),
    (["eval", "--model", "./no_such_model", *NO_MODEL, "--reward-workers", "3"],
     "--reward-workers 3 scores the rows of --reward-fn and --gold-fn functions"),
    (["eval", "--model", "./no_such_model", *NO_MODEL, "--reward-fn-timeout", "5"],
     "--reward-fn-timeout 5 limits the calls"),
    (["eval", "--model", "./no_such_model", *NO_MODEL, "--reward-retries", "4",
      "--reward-fn", "rewards.py:score"], "--reward-retries 4 retries calls of the reward pool"),
    # the user's code as named (its form, a file that is there); importing it waits for the stage
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--reward-fn", "nope.py:score"],
     "reward function file nope.py does not exist; fix the path"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--reward-fn", "rewards.py"],
     "reward function 'rewards.py' must look like module:function"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--tools", "rewards.py:score,nope.py:sub",
      "--reward-fn", "rewards.py:score"], "tool file nope.py does not exist"),
    (["grpo", "--policy", "./no_such_model", *NO_MODEL, "--env", "nope.py:make_env"],
     "environment factory file nope.py does not exist"),
    (["eval", "--model", "./no_such_model", *NO_MODEL, "--gold-fn", "task"],
     "reward function 'task' must look like module:function"),
    # and a model path that is not there, once the settings are right
    (["ppo", "--policy", "./no_such_model", *NO_MODEL, "--reward-fn", "rewards.py:score"],
     "model path ./no_such_model does not exist; pass a model directory or hub name"),
    (["eval", "--model", "runs/no/such/model", *NO_MODEL],
     "model path runs/no/such/model does not exist"),
]


@pytest.mark.parametrize("argv, pattern", BEFORE_TORCH, ids=lambda v: v[0] if isinstance(v, list) else "")
def test_reward_settings_are_refused_before_torch_loads(root, argv, pattern):
    """Issue 47: these were refused after torch and transformers loaded (10 s), in the reward's
    wiring; the configs' own checks make them now (tether.run.reward_checks). A child process
    runs the CLI and reports whether torch was imported; the model path does not exist, so a
    line about the reward proves no model was read first."""
    code = ("import sys\nfrom tether.cli import main\n"
            f"code = main({argv!r})\nprint('torch' in sys.modules)\nsys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=root, env=same_settings_env(), timeout=300)
    assert done.returncode == 2 and done.stdout == "False\n", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(f"error: {pattern}", lines[0]), done.stderr
