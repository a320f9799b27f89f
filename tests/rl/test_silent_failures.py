"""Runs that learn nothing without a word, and non-finite scores named far from their source
(issue 33, clusters 2 and 6), through the real CLI on the tiny GPT-2 and Llama-style models.

Before: with --mask-truncated and every response cut at --max-new-tokens, grpo, rloo and ppo
dropped every row, skipped every minibatch (ppo: trained its critic alone) and wrote final/, the
starting policy bit for bit, with exit 0 and only PyTorch's "lr_scheduler.step() before
optimizer.step()" warning; a constant reward under rloo/grpo gave every advantage 0 without a
word. A reward model's NaN score, a reward function's 1e300 (finite in float64, inf in float32)
and a NaN --margin-column value all ended as "the loss is nan ... lower --lr".
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from offline_fixtures import preference_rows, write_jsonl
from refusals import refused
from safetensors.torch import load_file, save_file

from tether.cli import main
from tether.errors import TetherError
from tether.rl.env.calls import checked_step
from tether.rl.reward import MAX_SCORE
from tether.rl.reward.functions import call_reward_function
from tether.run.optim import make_lr_schedule, make_optimizer, step_schedule

MODELS = {"gpt2": "tiny_model_dir", "llama": "tiny_llama_dir"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("silent")
    write_jsonl(base / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"},
                                         {"prompt": "the plot"}, {"prompt": "a film"}])
    (base / "fns.py").write_text(
        "def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n"
        "def constant(prompts, responses):\n    return [1.0 for _ in responses]\n"
        "def alternating(prompts, responses):\n"
        "    return [float(i % 2) for i in range(len(responses))]\n"
        "def huge(prompts, responses):\n"
        "    return [1e300 if i == 1 else 0.0 for i in range(len(responses))]\n"
        "def minus_huge(prompts, responses):\n    return [-1e300 for _ in responses]\n"
        "def squares_overflow(prompts, responses):\n"
        "    return [1e20 * (i % 2) for i in range(len(responses))]\n")
    return base


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Exit code and the stderr lines (tqdm's progress lines left out), with every Python
    warning recorded: none may be PyTorch's schedule-order warning."""
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    err = capsys.readouterr().err
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], caught
    assert "Traceback" not in err and "lr_scheduler" not in err, err
    return code, [line for line in err.splitlines()
                  if line.strip() and not re.match(r"^\S+ \S+: step ", line)]


def _online(stage: str, policy: str, name: str, out: Path, *extra: str) -> list[str]:
    return [stage, "--policy", policy, "--prompts", "prompts.jsonl", "--run-name", name,
            "--output-dir", str(out), "--batch-size", "4", "--total-episodes", "8",
            "--device", "cpu", *extra]


# ----------------------------------------------------------------------------- cluster 2

TRUNCATED = [  # (stage, model, extra options, whether a critic learned alone)
    ("grpo", "gpt2", ["--samples-per-prompt", "2"], False),
    ("rloo", "llama", ["--samples-per-prompt", "2"], False),
    ("grpo", "llama", ["--samples-per-prompt", "2", "--overlong-penalty", "1",
                       "--missing-eos-penalty", "1"], False),
    ("ppo", "llama", [], True),
    ("ppo", "gpt2", ["--missing-eos-penalty", "0.5"], True),
]


@pytest.mark.parametrize("stage, model, extra, critic", TRUNCATED,
                         ids=["grpo-gpt2", "rloo-llama", "grpo-penalties-llama", "ppo-llama",
                              "ppo-eos-penalty-gpt2"])
def test_mask_truncated_with_nothing_left_warns_each_batch_and_fails(
        files, stage, model, extra, critic, request, capsys, monkeypatch):
    monkeypatch.chdir(files)
    out = files / "runs" / f"trunc-{stage}-{model}-{len(extra)}"
    policy = str(request.getfixturevalue(MODELS[model]))
    argv = _online(stage, policy, "x", out, "--reward-fn", "fns.py:length", "--max-new-tokens",
                   "2", "--mask-truncated", *extra)
    code, lines = _run(argv, capsys)
    assert code == 2, lines  # before: 0, final/ the starting policy
    only = r" for the policy \(only the critic learned\)" if critic else ""
    for step, line in zip((1, 2), lines[:2], strict=True):
        assert re.fullmatch(rf"warning: batch {step}: all 4 responses reached --max-new-tokens 2 "
                            rf"and --mask-truncated left nothing to train on{only}; raise "
                            r"--max-new-tokens or drop --mask-truncated", line), line
    assert lines[2:] == [
        "error: no batch of this run trained the policy: in all 2 batches every response "
        "reached --max-new-tokens 2 and --mask-truncated left nothing to train on, so final/ "
        "was not written (the checkpoints are kept); raise --max-new-tokens or drop "
        "--mask-truncated"], lines
    run = out / "x"
    assert not (run / "final").exists()
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["state"]["trained_batches"] == 0
    if not critic:  # no step at all: the checkpoint is the starting policy, bit for bit
        start = transformers.AutoModelForCausalLM.from_pretrained(policy).state_dict()
        saved = load_file(run / "checkpoints" / "step_2" / "policy.safetensors")
        # (tether added a pad token: the embedding's rows past the model's own are new)
        assert saved and all(torch.equal(saved[k][:len(start[k])], start[k]) for k in saved)
    # a resume of the finished run knows (from the checkpoint) that nothing trained
    code, lines = _run([*argv, "--resume"], capsys)
    assert code == 2 and lines[-1].startswith("error: no batch of this run trained"), lines
    assert not (run / "final").exists()


@pytest.mark.parametrize("stage, model", [("grpo", "gpt2"), ("ppo", "llama")])
def test_the_same_run_without_mask_truncated_trains_without_a_word(files, stage, model, request,
                                                                   capsys, monkeypatch):
    """The valid neighbour: the same truncated responses, trained on."""
    monkeypatch.chdir(files)
    out = files / "runs" / f"neighbour-{stage}-{model}"
    extra = ["--samples-per-prompt", "2"] if stage == "grpo" else []
    code, lines = _run(_online(stage, str(request.getfixturevalue(MODELS[model])), "x", out,
                               "--reward-fn", "fns.py:length", "--max-new-tokens", "2", *extra),
                       capsys)
    assert code == 0 and not any(line.startswith(("warning:", "error:")) for line in lines), lines
    assert (out / "x" / "final").is_dir()


@pytest.mark.parametrize("stage, model, extra, fix", [
    ("grpo", "gpt2", [], r"check that the reward tells responses apart, or resample such groups "
                         r"with --dynamic-sampling 3"),
    ("rloo", "llama", [], r"check that the reward tells responses apart, or resample"),
    ("grpo", "llama", ["--dynamic-sampling", "2"],
     r"even after --dynamic-sampling 2 rounds: check that the reward tells responses apart"),
], ids=["grpo-gpt2", "rloo-llama", "grpo-dynamic-llama"])
def test_every_advantage_zero_is_named_each_batch(files, stage, model, extra, fix, request,
                                                  capsys, monkeypatch):
    """A constant reward: each group's responses score alike, every advantage is 0 and the
    reward teaches nothing. Said each batch; the run goes on (a KL term may still act), as
    before."""
    monkeypatch.chdir(files)
    out = files / "runs" / f"zero-{stage}-{model}-{len(extra)}"
    code, lines = _run(_online(stage, str(request.getfixturevalue(MODELS[model])), "x", out,
                               "--reward-fn", "fns.py:constant", "--max-new-tokens", "3",
                               "--samples-per-prompt", "2", *extra), capsys)
    assert code == 0, lines
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 2, lines
    for step, line in zip((1, 2), warned, strict=True):
        assert re.match(rf"warning: batch {step}: every advantage is 0 \(each prompt's 2 "
                        rf"responses scored alike\), so the reward taught the policy nothing; "
                        rf"{fix}", line), line
    # the neighbour: a reward that varies within each group (of consecutive rows) is silent
    code, lines = _run(_online(stage, str(request.getfixturevalue(MODELS[model])), "y", out,
                               "--reward-fn", "fns.py:alternating", "--max-new-tokens", "3",
                               "--samples-per-prompt", "2"), capsys)
    assert code == 0 and not [line for line in lines if "every advantage is 0" in line], lines


def test_what_each_batch_is_told():
    """The cases the CLI runs above do not reach: episodes, and a batch that trained."""
    from types import SimpleNamespace

    from tether.train.ppo_watch import nothing_learned

    def cfg(**kw):
        return SimpleNamespace(**({"episodic": False, "max_new_tokens": 8, "advantage": "grpo",
                                   "samples_per_prompt": 4, "dynamic_sampling": 0} | kw))
    assert nothing_learned(3, 8, 0, False, cfg(episodic=True), False) == (
        "batch 3: all 8 episodes were cut off before they ended and --mask-truncated left "
        "nothing to train on; raise --max-new-tokens, --max-turns or --max-episode-tokens or "
        "drop --mask-truncated")
    assert nothing_learned(3, 8, 1, False, cfg(), False) is None  # one row carried a loss
    assert nothing_learned(3, 8, 8, True, cfg(advantage="gae"), True) is None  # no groups
    assert "every advantage is 0" in nothing_learned(3, 8, 8, True, cfg(), False)


def test_the_schedule_steps_by_batch_without_pytorchs_warning():
    """A batch with no optimizer step still spends its place in the schedule (the state a resume
    restores is the batches done), and PyTorch's step-order warning is not shown for it."""
    layer = torch.nn.Linear(2, 2)
    quiet = make_lr_schedule(make_optimizer(layer, 1.0), 4, 0, "linear")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_schedule(quiet)
    assert not caught
    loud = make_lr_schedule(make_optimizer(torch.nn.Linear(2, 2), 1.0), 4, 0, "linear")
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # the premise: PyTorch warns
        loud.step()
    assert quiet.state_dict() == loud.state_dict() and set(quiet.get_last_lr()) == {0.75}


# ----------------------------------------------------------------------------- cluster 6

@pytest.fixture(scope="module")
def bad_reward_models(tiny_model_dir, tiny_llama_dir, tmp_path_factory):
    """Tiny tether reward models with a NaN head, and with huge (finite) head weights whose
    float32 score is past 1e15, written past tether's own finite-weights check."""
    from tether.models.pretrained import load_tokenizer
    from tether.models.reward_model import RewardModel

    base, made = tmp_path_factory.mktemp("bad_rms"), {}
    for model, path in (("gpt2", tiny_model_dir), ("llama", tiny_llama_dir)):
        tokenizer = load_tokenizer(str(path))
        for kind, value in (("finite", None), ("nan", float("nan")), ("huge", 1e37)):
            out = base / f"{model}-{kind}"
            RewardModel.from_causal_lm(str(path), tokenizer).save_pretrained(out, tokenizer)
            if value is not None:
                weights = load_file(out / "model.safetensors")
                weights["score.weight"] = torch.full_like(weights["score.weight"], value)
                save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
            made[model, kind] = out
    return made


@pytest.mark.parametrize("stage, policy, rm, kind, shown", [
    ("grpo", "gpt2", "gpt2", "nan", r"a non-finite score \(nan\)"),
    ("ppo", "llama", "llama", "nan", r"a non-finite score \(nan\)"),
    ("rloo", "llama", "llama", "huge", r"a score of -?[0-9.]+e\+3\d \(past \+-1e\+15: float32 "
                                       r"maths on it overflows\)"),
    ("grpo", "gpt2", "llama", "nan", r"a non-finite score \(nan\)"),  # reads text: another vocab
], ids=["grpo-gpt2-nan", "ppo-llama-nan", "rloo-llama-huge", "grpo-text-path-nan"])
def test_a_reward_models_bad_score_is_named_as_the_reward_models(
        files, bad_reward_models, stage, policy, rm, kind, shown, request, capsys, monkeypatch):
    monkeypatch.chdir(files)
    out = files / "runs" / f"rm-{stage}-{policy}-{rm}-{kind}"
    extra = ["--samples-per-prompt", "2"] if stage != "ppo" else []
    model = bad_reward_models[rm, kind]
    code, lines = _run(_online(stage, str(request.getfixturevalue(MODELS[policy])), "x", out,
                               "--reward-model", str(model), "--max-new-tokens", "3", *extra),
                       capsys)
    assert code == 2, lines  # before: "batch 1: the loss is nan ... lower --lr"
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"error: batch 1: the reward model {re.escape(str(model))} gave response "
                        rf"0 \(prompt 'the movie was'\) {shown}: its weights hold NaN or inf, or "
                        r"are so large that its forward overflows; check or retrain the reward "
                        r"model, and what it reads; checkpoints written so far are intact",
                        lines[0]), lines[0]
    assert not (out / "x" / "final").exists()


def test_a_finite_reward_model_trains(files, bad_reward_models, tiny_llama_dir, capsys,
                                      monkeypatch):
    """The neighbour: the same reward model with its finite head."""
    monkeypatch.chdir(files)
    out = files / "runs" / "rm-finite"
    code, lines = _run(_online("rloo", str(tiny_llama_dir), "x", out, "--reward-model",
                               str(bad_reward_models["llama", "finite"]), "--max-new-tokens", "3",
                               "--samples-per-prompt", "2"), capsys)
    assert code == 0 and not [line for line in lines if line.startswith("error:")], lines


@pytest.mark.parametrize("stage, model, fn, shown", [
    ("grpo", "gpt2", "huge", r"a score of 1e\+300 \(past \+-1e\+15: float32 maths on it "
                             r"overflows\) for response 1"),
    ("ppo", "llama", "minus_huge", r"a score of -1e\+300 .* for response 0"),
    ("rloo", "llama", "squares_overflow", r"a score of 1e\+20 .* for response 1"),
], ids=["grpo-gpt2-1e300", "ppo-llama-minus-1e300", "rloo-llama-1e20"])
def test_a_reward_function_score_that_would_overflow_is_refused_at_the_call(
        files, stage, model, fn, shown, request, capsys, monkeypatch):
    monkeypatch.chdir(files)
    out = files / "runs" / f"fn-{stage}-{fn}"
    extra = ["--samples-per-prompt", "2"] if stage != "ppo" else []
    code, lines = _run(_online(stage, str(request.getfixturevalue(MODELS[model])), "x", out,
                               "--reward-fn", f"fns.py:{fn}", "--max-new-tokens", "2", *extra),
                       capsys)
    assert code == 2 and len(lines) == 1, lines  # before: "the loss is nan" (1e20: exit 0)
    assert re.match(rf"error: reward function fns:{fn} returned {shown}; it must return a list "
                    r"of one finite float per response, in their order, each within \+-1e\+15$",
                    lines[0]), lines[0]
    assert not (out / "x" / "final").exists()


def test_a_gold_function_score_that_would_overflow_is_refused(files, tiny_llama_dir, capsys,
                                                               monkeypatch):
    monkeypatch.chdir(files)
    code, lines = _run(["eval", "--model", str(tiny_llama_dir), "--prompts", "prompts.jsonl",
                        "--gold-fn", "fns.py:huge", "--output", "runs/eval.json",
                        "--max-new-tokens", "2", "--device", "cpu"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: gold reward function fns:huge returned a score of 1e+300")
    assert not (files / "runs" / "eval.json").exists()


def test_the_bound_is_the_documented_one():
    """+-1e15 is accepted (the valid neighbour), just past it is not; NaN as before."""
    def returning(value):
        return lambda prompts, responses: [value] * len(responses)
    ok = call_reward_function(returning(MAX_SCORE), ["p"], ["r"])
    assert MAX_SCORE == 1e15 and ok.tolist() == [pytest.approx(1e15)]
    assert call_reward_function(returning(-MAX_SCORE), ["p"], ["r"]).tolist()[0] < 0
    for value, shown in ((1.01e15, "a score of 1.01e+15"), (float("nan"), "non-finite score")):
        with pytest.raises(TetherError, match=re.escape(shown)):
            call_reward_function(returning(value), ["p"], ["r"])


@pytest.mark.parametrize("reward, shown", [(1e300, r"a reward of 1e\+300 \(past \+-1e\+15"),
                                           (float("inf"), r"a non-finite reward \(inf\)")])
def test_an_environment_reward_that_would_overflow_is_refused(reward, shown):
    with pytest.raises(TetherError, match=rf"env step returned {shown}.*; return a finite float "
                                          r"within \+-1e\+15"):
        checked_step((None, reward, True), "env step")
    assert checked_step((None, 1e15, True), "env step")[1] == 1e15


# The margin column: refused at data load, before the model loads, with nothing written.


MARGINS = [(float("nan"), "nan"), (float("inf"), "inf"), (1e300, "1e+300"), ("nan", "'nan'"),
           (-1e39, "-1e+39")]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("margin, shown", MARGINS,
                         ids=["nan", "inf", "1e300", "nan-string", "past-float32"])
def test_a_non_finite_margin_is_refused_at_data_load(tmp_path, model, margin, shown, request,
                                                     capsys, monkeypatch, no_loads):
    rows = [dict(r, margin=1.0) for r in preference_rows(8)]
    rows[3]["margin"] = margin
    write_jsonl(tmp_path / "pairs.jsonl", rows)  # json writes NaN and Infinity, as Python reads
    monkeypatch.chdir(tmp_path)
    refused(tmp_path, ["rm", "--model", str(request.getfixturevalue(MODELS[model])), "--data",
                       "pairs.jsonl", "--margin-column", "margin", "--run-name", "x",
                       "--output-dir", "runs", "--device", "cpu"],
            rf"^error: \S*pairs\.jsonl: row 3 column 'margin' is {re.escape(shown)}, not a finite "
            r"float32 number; give every row a finite margin \(0 for none\), or drop "
            r"--margin-column$", capsys)
    assert no_loads == []


def test_finite_margins_train(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """The neighbour: the same rows with finite margins (one large, well inside float32)."""
    rows = [dict(r, margin=1.0) for r in preference_rows(8)]
    rows[3]["margin"] = 1e30
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    code, lines = _run(["rm", "--model", str(tiny_llama_dir), "--data", "pairs.jsonl",
                        "--margin-column", "margin", "--run-name", "x", "--output-dir", "runs",
                        "--device", "cpu", "--batch-size", "4"], capsys)
    assert code == 0 and (tmp_path / "runs" / "x" / "final").is_dir(), lines
