"""The reward pool (--reward-workers, --reward-retries; tether.rl.reward.pool) and async def reward
functions (issue 34).

Independent truths: the sequential call (one call per batch, today's path) for the scores, in
the rows' order, whatever order the pooled calls finish in; counts of calls kept by the
functions themselves for the retries; hand-made rounds for the refill (which groups a batch
keeps); and, end to end, the final weights of the run without the pool, byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from offline_fixtures import write_jsonl
from refusals import refused
from safetensors.torch import load_file

from tether.cli import main
from tether.errors import TetherError
from tether.rl.dynamic_sampling import BatchUnscored, Drawn, collect
from tether.rl.reward import FailedRows
from tether.rl.reward.functions import reward_from_functions
from tether.rl.reward.pool import RewardPool
from tether.rl.rollout import Rollout
from tether.train import ppo

PROMPTS = [f"prompt {i}" for i in range(12)]
RESPONSES = ["x" * (i % 5 + 1) + "y" * (i // 5) for i in range(12)]


def delay(prompt: str) -> float:
    """A per-row delay drawn at random (seeded by the row), 0-30 ms: calls finish out of order."""
    return random.Random(prompt).random() * 0.03


class Recorder:
    """Reward functions that record the order their calls finish in and how many run at once."""

    def __init__(self):
        self.lock, self.finished, self.running, self.most = threading.Lock(), [], 0, 0

    def enter(self):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def leave(self, prompts):
        with self.lock:
            self.running -= 1
            self.finished += prompts

    def tether_form(self, prompts, responses):
        self.enter()
        time.sleep(delay(prompts[0]))
        self.leave(prompts)
        return [len(r) + 0.5 * len(p) for p, r in zip(prompts, responses, strict=True)]

    async def async_tether_form(self, prompts, responses):
        self.enter()
        await asyncio.sleep(delay(prompts[0]))
        self.leave(prompts)
        return [len(r) + 0.5 * len(p) for p, r in zip(prompts, responses, strict=True)]

    def trl_form(self, prompts, completions, level, **kwargs):
        self.enter()
        time.sleep(delay(prompts[0]))
        self.leave(prompts)
        return [len(c) * lv for c, lv in zip(completions, level, strict=True)]

    async def async_trl_form(self, prompts, completions, level, **kwargs):
        self.enter()
        await asyncio.sleep(delay(prompts[0]))
        self.leave(prompts)
        return [len(c) * lv for c, lv in zip(completions, level, strict=True)]


ROWS = [{"prompt": p, "level": i % 3 + 1} for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("form", ["tether_form", "async_tether_form", "trl_form",
                                  "async_trl_form"])
def test_pooled_scores_equal_the_sequential_call_in_the_rows_order(form):
    # Truth: the same function called once on the whole batch (no pool), hand-checked below.
    recorder = Recorder()
    fn = getattr(recorder, form)
    sequential = reward_from_functions([fn]).score(PROMPTS, RESPONSES, ROWS, None)
    assert recorder.finished == PROMPTS  # one call, every row
    recorder.finished.clear()
    pooled = reward_from_functions([fn], pool=RewardPool(workers=4)).score(PROMPTS, RESPONSES,
                                                                           ROWS, None)
    assert sorted(recorder.finished) == sorted(PROMPTS) and len(recorder.finished) == 12
    assert recorder.finished != PROMPTS  # the calls finished out of the rows' order ...
    assert pooled.scores.tolist() == sequential.scores.tolist()  # ... the scores did not
    expected = ([len(r) + 0.5 * len(p) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
                if "tether" in form else
                [len(r) * row["level"] for r, row in zip(RESPONSES, ROWS, strict=True)])
    assert pooled.scores.tolist() == expected
    assert pooled.failed.causes == {} and not pooled.failed.failed.any()
    assert recorder.most == 4  # N at a time: never more, and the pool does fill up


def test_several_functions_are_pooled_together_with_their_weights():
    recorder = Recorder()
    fns = [recorder.async_tether_form, recorder.trl_form]
    sequential = reward_from_functions(fns, [1.0, -0.5]).score(PROMPTS, RESPONSES, ROWS, None)
    pooled = reward_from_functions(fns, [1.0, -0.5], pool=RewardPool(workers=8)).score(
        PROMPTS, RESPONSES, ROWS, None)
    assert pooled.scores.tolist() == sequential.scores.tolist()
    assert {k: v.tolist() for k, v in pooled.parts.items()} == {
        k: v.tolist() for k, v in sequential.parts.items()}
    assert recorder.most == 8  # both functions' calls share the N workers


def test_an_async_function_runs_on_one_loop_kept_across_batches():
    # A client bound to the loop that first used it (aiohttp, httpx) must keep working: every
    # call of every batch, pooled or not, sees the same running loop.
    loops = set()

    async def judged(prompts, responses):
        loops.add(id(asyncio.get_running_loop()))
        return [1.0] * len(responses)
    for pool in (None, RewardPool(workers=4), None):
        reward_from_functions([judged], pool=pool).score(PROMPTS, RESPONSES, None, None)
    assert len(loops) == 1


# ----------------------------------------------------------------------------- failures

class Flaky:
    """Raises on the first `failures` calls of each response, then scores it; counts calls."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, {}

    def __call__(self, prompts, responses):
        for r in responses:
            self.calls[r] = self.calls.get(r, 0) + 1
            if self.calls[r] <= self.failures:
                raise ConnectionError(f"try {self.calls[r]} of {r}")
        return [len(r) / 10 for r in responses]


def test_a_call_that_raises_twice_then_succeeds_scores_as_the_sequential_call():
    responses = [f"r{i}" * (i + 1) for i in range(6)]
    truth = reward_from_functions([Flaky(0)]).score(PROMPTS[:6], responses, None, None)
    flaky = Flaky(2)
    pooled = reward_from_functions([flaky], pool=RewardPool(4, retries=2, retry_delay=0.001)
                                   ).score(PROMPTS[:6], responses, None, None)
    assert pooled.scores.tolist() == truth.scores.tolist()
    assert flaky.calls == {r: 3 for r in responses}  # 2 failures + the success, per response
    assert pooled.failed.retries.tolist() == [2] * 6 and not pooled.failed.failed.any()


def test_a_call_that_raises_past_its_retries_is_a_counted_failure():
    flaky = Flaky(2)
    pooled = reward_from_functions([flaky], pool=RewardPool(4, retries=1, retry_delay=0.001)
                                   ).score(PROMPTS[:3], ["a", "b", "c"], None, None)
    assert flaky.calls == {"a": 2, "b": 2, "c": 2}
    assert pooled.failed.failed.tolist() == [True] * 3
    assert all(math.isnan(s) for s in pooled.scores.tolist())  # no score, never a zero
    assert pooled.failed.retries.tolist() == [1, 1, 1]
    assert pooled.failed.causes[1].startswith("reward function ")
    assert "raised ConnectionError: try 2 of b (at " in pooled.failed.causes[1]
    assert pooled.failed.causes[1].endswith("(prompt 'prompt 1'; 2 tries)")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_past_the_timeout_fails_and_the_others_score(kind):
    # Row 1 sleeps 2 s against a 0.2 s timeout, on both tries: it fails; rows 0 and 2 score.
    calls = []

    def slow(prompts, responses):
        calls.append(responses[0])
        time.sleep(2.0 if responses[0] == "stuck" else 0.0)
        return [1.0]

    async def async_slow(prompts, responses):
        calls.append(responses[0])
        await asyncio.sleep(2.0 if responses[0] == "stuck" else 0.0)
        return [1.0]
    started = time.monotonic()
    pooled = reward_from_functions([slow if kind == "sync" else async_slow],
                                   pool=RewardPool(4, retries=1, timeout=0.2, retry_delay=0.001)
                                   ).score(PROMPTS[:3], ["a", "stuck", "b"], None, None)
    assert time.monotonic() - started < 1.5  # not waited out: 2 tries of 0.2 s
    assert pooled.failed.failed.tolist() == [False, True, False]
    assert pooled.scores[[0, 2]].tolist() == [1.0, 1.0]
    assert "did not return within 0.2 s (--reward-fn-timeout)" in pooled.failed.causes[1]
    assert calls.count("stuck") == 2 and pooled.failed.retries.tolist() == [0, 1, 0]


def test_a_nan_or_out_of_range_score_fails_at_once_without_retries():
    calls = []

    def bad(prompts, responses):
        calls.append(responses[0])
        return [{"nan": math.nan, "inf": math.inf, "big": 1e20}.get(responses[0], 2.0)]
    pooled = reward_from_functions([bad], pool=RewardPool(4, retries=3)).score(
        PROMPTS[:4], ["nan", "ok", "inf", "big"], None, None)
    assert pooled.failed.failed.tolist() == [True, False, True, True]
    assert pooled.scores[1].item() == 2.0
    assert sorted(calls) == ["big", "inf", "nan", "ok"]  # one call each: the function answered
    assert "returned a non-finite score (nan)" in pooled.failed.causes[0]
    assert "returned a score of 1e+20" in pooled.failed.causes[3]


def test_a_return_that_is_not_a_score_is_still_a_bug_not_a_failure():
    # A set has no order: the batch stops with the sequential path's line, pooled or not.
    def as_set(prompts, responses):
        return {1.0}
    with pytest.raises(TetherError, match=r"as_set returned set \{1.0\} \(a set has no order"):
        reward_from_functions([as_set], pool=RewardPool(4)).score(PROMPTS[:2], ["a", "b"],
                                                                  None, None)


# ----------------------------------------------------------------------------- the refill

def hand_round(number: int, scores: list[float], failed_rows: list[int] = (),
               pool: bool = True) -> Drawn:
    """A round of groups of 2 whose rows carry their round in their ids and prompts."""
    n = len(scores)
    ids = torch.full((n, 4), 10 + number, dtype=torch.long)
    rollout = Rollout(ids, torch.ones_like(ids), torch.ones(n, 2, dtype=torch.bool),
                      torch.ones(n, dtype=torch.bool), 2)
    s = torch.tensor(scores, dtype=torch.float32)
    failed = torch.zeros(n, dtype=torch.bool)
    failed[list(failed_rows)] = True
    s[failed] = math.nan
    report = FailedRows(failed, torch.ones(n, dtype=torch.long),
                        {r: f"reward function f raised ValueError: row {r}"
                         for r in failed_rows}) if pool else None
    return Drawn([f"r{number}g{i // 2}" for i in range(n)], rollout, s, s, None, {}, report)


def test_without_dynamic_sampling_a_failed_group_is_dropped_and_refilled():
    # Groups of 2. Round 0: g1 has a failed row. Round 1: g0 failed, g1 and g2 scored: the
    # batch is r0's g0 and g2, then r1's g1 (the first scored group of the refill).
    rounds = {0: hand_round(0, [1, 1, 0, 2, 3, 3], [3]), 1: hand_round(1, [5, 5, 6, 6, 7, 7], [0])}
    calls, warnings = [], []

    def draw(j):
        calls.append(j)
        return rounds[j]
    batch, stats = collect(draw, 2, 4, pad_token_id=0, warn=warnings.append, dynamic=False)
    assert calls == [0, 1]
    assert batch.prompts == ["r0g0", "r0g0", "r0g2", "r0g2", "r1g1", "r1g1"]
    assert batch.raw_scores.tolist() == [1, 1, 3, 3, 6, 6]  # the right size, no failed row
    assert not batch.raw_scores.isnan().any()
    assert stats == {"reward_pool/failed": 2.0, "reward_pool/failed_groups": 2.0, "reward_pool/retries": 12.0,
                     "reward_pool/redraws": 1.0}
    assert warnings == [
        "response 3: reward function f raised ValueError: row 3; 1 group of 2 dropped and "
        "drawn again (counted in reward_pool/failed)",
        "response 0: reward function f raised ValueError: row 0; 1 group of 2 dropped and "
        "drawn again (counted in reward_pool/failed)"]


def test_a_round_without_failures_is_the_batch_as_it_is():
    # Without the pool's failures, collect returns round 0 itself (bit-identical to before).
    first = hand_round(0, [1, 1, 0, 2], pool=False)
    batch, stats = collect(lambda j: first, 2, 4, pad_token_id=0, dynamic=False)
    assert batch is first and stats == {}
    pooled = hand_round(0, [1, 1, 0, 2])
    batch, stats = collect(lambda j: pooled, 2, 4, pad_token_id=0, dynamic=False)
    assert batch is pooled
    assert stats == {"reward_pool/failed": 0.0, "reward_pool/failed_groups": 0.0, "reward_pool/retries": 4.0,
                     "reward_pool/redraws": 0.0}


def test_with_dynamic_sampling_a_failed_group_never_tops_a_batch_up():
    # Round 0: g0 equal, g1 failed, g2 equal; round 1: g0 equal, g1 equal, g2 varied. One
    # round allowed: the batch is r1's g2 (varied), then equal groups: r0's g0 and g2 (round 0
    # first), never r0's failed g1.
    rounds = {0: hand_round(0, [1, 1, 0, 2, 3, 3], [2]), 1: hand_round(1, [5, 5, 6, 6, 7, 8])}
    batch, stats = collect(lambda j: rounds[j], 2, 1, pad_token_id=0, say=lambda _: None)
    assert batch.prompts == ["r0g0", "r0g0", "r0g2", "r0g2", "r1g2", "r1g2"]
    assert stats["reward_pool/failed"] == 1.0 and stats["rollout/dynamic_rounds"] == 1.0
    assert "reward_pool/redraws" not in stats


def test_with_dynamic_sampling_later_rounds_equal_groups_replace_failed_ones():
    # A constant reward (no group varies) with round 0's every group failed but one: the
    # batch is topped up from round 1's equal groups instead of ending the run.
    rounds = {0: hand_round(0, [1, 1, 1, 1, 1, 1], [0, 2]), 1: hand_round(1, [1, 1, 1, 1, 1, 1])}
    batch, _ = collect(lambda j: rounds[j], 2, 1, pad_token_id=0, say=lambda _: None)
    assert batch.prompts == ["r0g2", "r0g2", "r1g0", "r1g0", "r1g1", "r1g1"]


def test_failures_that_persist_end_the_batch_with_one_line():
    rounds = [hand_round(j, [1, 2, 3, 4], [0, 1, 2, 3]) for j in range(5)]
    with pytest.raises(BatchUnscored) as caught:
        collect(lambda j: rounds[j], 2, 4, pad_token_id=0, dynamic=False)
    assert str(caught.value) == (
        "the reward pool failed on every response of 5 draws, leaving 0 of 2 groups of 2 scored; "
        "the last: response 0: reward function f raised ValueError: row 0; fix the reward "
        "function (run it by hand on that response), or raise --reward-retries or "
        "--reward-fn-timeout; checkpoints written so far are intact")


# ----------------------------------------------------------------------------- end to end

FNS = '''
import asyncio, os, random, time

HERE = os.path.dirname(os.path.abspath(__file__))


def length(prompts, responses):
    time.sleep(random.Random(responses[0]).random() * 0.01)
    return [len(r) / 10.0 for r in responses]


async def async_length(prompts, responses):
    await asyncio.sleep(random.Random(responses[0]).random() * 0.01)
    return [len(r) / 10.0 for r in responses]


def fails_on_it(prompts, responses):
    """Raises on every response to the prompt "it"; one line per such call in a file (an
    appended line is one write: calls running at once lose none)."""
    if any(p == "it" for p in prompts):
        with open(os.path.join(HERE, "it.calls"), "a") as f:
            f.write("call\\n")
        raise RuntimeError("judge unreachable")
    return [len(r) / 10.0 for r in responses]


def always_fails(prompts, responses):
    raise RuntimeError("judge unreachable")
'''

E2E_PROMPTS = [{"prompt": p} for p in ("the movie was", "a film", "it", "the plot")]


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "fns.py").write_text(FNS)
    write_jsonl(tmp_path / "prompts.jsonl", E2E_PROMPTS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def grpo(policy: Path, name: str, fn: str, *extra: str) -> list[str]:
    return ["grpo", "--policy", str(policy), "--prompts", "prompts.jsonl", "--run-name", name,
            "--output-dir", "runs", "--batch-size", "8", "--samples-per-prompt", "4",
            "--total-episodes", "16", "--max-new-tokens", "4", "--lr", "1e-3", "--device",
            "cpu", "--report-to", "none", "--reward-fn", f"fns.py:{fn}", *extra]


def metrics(files: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (files / "runs" / name / "metrics.jsonl").read_text()
            .splitlines() if "objective/score" in x]


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_pooled_run_trains_the_sequential_runs_weights(family, files, request):
    # Truth: the same run with one call per batch; sync and async def alike.
    policy = request.getfixturevalue(family)
    assert main(grpo(policy, "sequential", "length")) == 0
    assert main(grpo(policy, "pooled", "length", "--reward-workers", "4")) == 0
    assert main(grpo(policy, "async", "async_length", "--reward-workers", "4")) == 0

    def weights(name):
        return (files / "runs" / name / "final" / "model.safetensors").read_bytes()
    assert weights("pooled") == weights("sequential") == weights("async")
    start, trained = load_file(str(policy / "model.safetensors")), load_file(
        str(files / "runs" / "pooled" / "final" / "model.safetensors"))
    assert any(not torch.equal(start[k], trained[k]) for k in start if k in trained)  # it learned
    scores = [m["objective/score"] for m in metrics(files, "sequential")]
    assert [m["objective/score"] for m in metrics(files, "pooled")] == scores
    assert [m["reward_pool/failed"] for m in metrics(files, "pooled")] == [0.0, 0.0]
    assert "reward_pool/failed" not in metrics(files, "sequential")[0]


def test_failed_groups_are_dropped_counted_and_refilled_in_a_run(files, tiny_model_dir,
                                                                 monkeypatch, capsys):
    # Every response to "it" fails (no retries): each draw that holds "it" loses that group,
    # and the batch that trains holds 8 scored rows and never "it".
    trained = []
    update = ppo.update

    def spy(setup, rollout, scores, *args, **kwargs):
        trained.append((len(rollout), scores.clone()))
        return update(setup, rollout, scores, *args, **kwargs)
    monkeypatch.setattr(ppo, "update", spy)
    collected = []
    collect_batch = ppo.collect_batch

    def spy_collect(*args):
        drawn, stats = collect_batch(*args)
        collected.append(drawn.prompts)
        return drawn, stats
    monkeypatch.setattr(ppo, "collect_batch", spy_collect)
    assert main(grpo(tiny_model_dir, "failing", "fails_on_it", "--reward-workers", "4",
                     "--reward-retries", "0", "--total-episodes", "32")) == 0
    err = capsys.readouterr().err
    lines = metrics(files, "failing")
    failed = sum(m["reward_pool/failed"] for m in lines)
    calls = len((files / "it.calls").read_text().splitlines())
    assert failed == calls > 0  # each failed response counted, once (no retries)
    assert sum(m["reward_pool/failed_groups"] for m in lines) == calls / 4  # groups of 4
    assert [n for n, _ in trained] == [8] * 4
    assert all(not s.isnan().any() for _, s in trained)
    assert all("it" not in prompts for prompts in collected)
    warned = [x for x in err.splitlines() if x.startswith("warning: batch ")]
    assert len(warned) == sum(1 for m in lines for _ in range(int(m["reward_pool/failed_groups"])))
    assert ("reward function fns:fails_on_it raised RuntimeError: judge unreachable (at "
            in warned[0] and "(prompt 'it'; 1 try)" in warned[0])
    assert "1 group of 4 dropped and drawn again (counted in reward_pool/failed)" in warned[0]


def test_a_reward_that_always_fails_ends_the_run_with_one_line(files, tiny_model_dir, capsys):
    assert main(grpo(tiny_model_dir, "down", "always_fails", "--reward-workers", "4",
                     "--reward-retries", "1")) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1
    assert errors[0].startswith("error: batch 1: the reward pool failed on every response of 5 "
                                "draws, leaving 0 of 2 groups of 4 scored; the last: response ")
    assert "raised RuntimeError: judge unreachable (at " in errors[0]


@pytest.mark.parametrize(("extra", "pattern"), [
    (["--reward-fn", "fns.py:length", "--reward-workers", "-1"],
     r"--reward-workers -1 must lie in \[0, 1024\]"),
    (["--reward-fn", "fns.py:length", "--reward-workers", "4", "--reward-retries", "-2"],
     r"--reward-retries -2 must lie in \[0, 100\] \(0: a failed call is not tried again"),
    (["--reward-fn", "fns.py:length", "--reward-workers", "4", "--reward-retries", "1000000"],
     r"--reward-retries 1000000 must lie in \[0, 100\] \(0: a failed call is not tried again; "
     r"each retry waits up to 10 s\)$"),  # its backoff overflowed
    (["--reward-fn", "fns.py:length", "--reward-retries", "5"],
     r"--reward-retries 5 retries calls of the reward pool, and there is none"),
    (["--reward-model", "rm", "--reward-workers", "4"],
     r"--reward-workers 4 scores the rows of --reward-fn and --gold-fn functions in parallel, "
     r"and this run has none"),
    (["--env", "fns.py:length", "--reward-workers", "4"],
     r"an episode's reward is scored inside its environment's step"),
])
def test_bad_pool_settings_are_refused(extra, pattern, files, tiny_model_dir, capsys):
    argv = ["grpo", "--policy", str(tiny_model_dir), "--prompts", "prompts.jsonl",
            "--output-dir", "runs", "--samples-per-prompt", "2", "--device", "cpu", *extra]
    refused(files, argv, pattern, capsys)


def test_eval_refuses_a_pool_without_functions(files, tiny_model_dir, capsys):
    refused(files, ["eval", "--model", str(tiny_model_dir), "--prompts", "prompts.jsonl",
                    "--output", "eval.json", "--reward-workers", "4"],
            r"--reward-workers 4 scores the rows of --reward-fn", capsys)


@pytest.mark.parametrize("command", ["eval", "bon", "interpolate"])
def test_eval_scores_through_the_pool_as_without_it(command, files, tiny_model_dir, capsys):
    # Truth: the same evaluation with one call per batch; a held-out row cannot be drawn again,
    # so a failed one ends `tether eval` with one line (here after 1 + 0 tries). The baselines
    # evaluate as eval does: bon's pool (of 2), interpolate's points (the line from the model to
    # itself).
    def base(out):
        target = {"bon": ["--model", str(tiny_model_dir), "--n", "2", "--output", out],
                  "interpolate": ["--from", str(tiny_model_dir), "--to", str(tiny_model_dir),
                                  "--points", "0,1", "--output-dir", out]}.get(
            command, ["--model", str(tiny_model_dir), "--output", out])
        return [command, *target, "--prompts", "prompts.jsonl", "--max-new-tokens", "4",
                "--device", "cpu"]
    assert main([*base("one.json"), "--reward-fn", "fns.py:length", "--gold-fn",
                 "fns.py:length"]) == 0
    assert main([*base("pooled.json"), "--reward-fn", "fns.py:async_length", "--gold-fn",
                 "fns.py:length", "--reward-workers", "4"]) == 0

    def scores(name, key):
        path = files / name / "eta1.eval.json" if command == "interpolate" else files / name
        record = json.loads(path.read_text())
        return record if command == "bon" else [s[key] for s in record["samples"]]
    assert scores("pooled.json", "score") == scores("one.json", "score")
    assert scores("pooled.json", "gold_score") == scores("one.json", "gold_score")
    capsys.readouterr()
    assert main([*base("failed.json"), "--reward-fn", "fns.py:fails_on_it", "--reward-workers",
                 "4", "--reward-retries", "0"]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: 1 of 4 responses of the held-out evaluation have no score: response 2: reward "
        "function fns:fails_on_it raised RuntimeError: judge unreachable (at ")
    assert "(prompt 'it'; 1 try); fix the function" in errors[0]


def test_each_async_call_has_the_guard_against_a_blocked_event_loop(monkeypatch):
    # An async def function that blocks the loop stops every per-call timeout, its own too; so
    # each of its calls is awaited under a deadline of its timeout plus LOOP_GRACE_S, naming the
    # function. A plain function runs in a thread, where it cannot block the loop: no deadline;
    # and no timeout (0), no deadline either. tests/run/test_user_code.py ends a blocked loop.
    from tether.run.user_code import calls
    seen = []

    class Spy(calls.Deadline):
        def __init__(self, seconds, message):
            seen.append((seconds, message))
            super().__init__(0, message)  # armed with no limit: this test only reads it

    async def judge(prompts, responses):
        return [1.0] * len(responses)
    monkeypatch.setattr(calls, "Deadline", Spy)
    for fn, timeout in ((judge, 1.0), (Flaky(0), 1.0), (judge, 0.0)):
        reward_from_functions([fn], pool=RewardPool(4, 2, timeout, retry_delay=0.1)
                              ).score(PROMPTS[:10], RESPONSES[:10], None, None)
    assert len(seen) == 10  # the first run's calls, one each
    assert all(1.0 + calls.LOOP_GRACE_S - 0.5 < seconds <= 1.0 + calls.LOOP_GRACE_S
               for seconds, _ in seen)
    assert seen[0][1].startswith(
        f"reward function {judge.__module__}:{judge.__qualname__} did not return within 1 s "
        "(--reward-fn-timeout) and holds the event loop, so no timeout can act")


def test_an_object_with_an_async_call_method_is_awaited_in_and_out_of_the_pool():
    class Judge:
        async def __call__(self, prompts, responses):
            await asyncio.sleep(0)
            return [len(r) for r in responses]
    for pool in (None, RewardPool(workers=4)):
        scored = reward_from_functions([Judge()], pool=pool).score(PROMPTS, RESPONSES, None, None)
        assert scored.scores.tolist() == [float(len(r)) for r in RESPONSES]
