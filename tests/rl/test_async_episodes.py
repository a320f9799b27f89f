"""Episodes sampled ahead of the trainer (--max-staleness with --env or --tools): the batch's
episodes run in a thread of the trainer's process while it updates, the environment there and
every turn sampled by the generator process. Checked against independent truths:

- the behaviour policy is the right one on every turn: each batch's recorded log-probs equal
  those of the weights the trainer held L batches earlier (recomputed from saved copies), every
  sampled token carries that version and no observation token carries one;
- the episodes are the ones the synchronous loop's engine samples from those weights: the same
  tokens, observations and rewards, from a native engine run here on the saved weights;
- the run does not depend on timing: an environment that sleeps a random time in each step
  trains the same weights, bit for bit, as one that does not;
- a failing environment in the background is one line, and no generator is left;
- the handles `submit` returns run their work in order and raise its errors in the caller.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import pytest
import torch
from async_helpers import check_behaviour_policy, policy_as_loaded, recorded_run

from tether.errors import TetherError
from tether.rl.engines import ahead, native
from tether.rl.engines.jobs import Background, Deferred
from tether.rl.sources import make_source
from tether.run.distributed import Dist
from tether.run.optim import StepCounter
from tether.train import ppo
from tether.train.ppo_config import GRPOConfig

ENV = '''
import random, time


class Hint:
    """Two turns: the prompt, then a hint that depends on the seed and the turn; the reward
    counts characters of each turn (a dense signal for the tiny models)."""

    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        hint = [" warmer", " colder and"][(self.seed + self.turn) % 2]
        return hint, (len(action) % 5) / 4, self.turn == 2


class Slow(Hint):
    """Hint, each step after a random sleep: the timing varies, the episodes must not."""

    def step(self, action):
        time.sleep(random.random() * 0.05)
        return super().step(action)


class Breaks(Hint):
    """Hint whose step raises from the third batch on (each batch makes 4 environments)."""

    made = 0

    def __init__(self):
        Breaks.made += 1
        self.late = Breaks.made > 8

    def step(self, action):
        if self.late:
            raise ValueError("the simulator crashed")
        return super().step(action)
'''
ENV += '''

class Flaky(Hint):
    """Hint that raises from the third batch on when TETHER_TEST_CRASH is set."""

    made = 0

    def __init__(self):
        import os

        Flaky.made += 1
        self.late = Flaky.made > 8 and os.environ.get("TETHER_TEST_CRASH") == "1"

    def step(self, action):
        if self.late:
            raise ValueError("the simulator crashed")
        return super().step(action)
'''
PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ahead_env")
    (root / "envs.py").write_text(ENV)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in PROMPTS))
    return root


def grpo(model_dir, env_dir, name, env="Hint", **overrides) -> GRPOConfig:
    values = dict(run_name=name, output_dir=str(env_dir / "runs"), policy=str(model_dir),
                  prompts=str(env_dir / "prompts.jsonl"), env=f"{env_dir / 'envs.py'}:{env}",
                  max_turns=2, stop_strings=["a", "e"], batch_size=4, samples_per_prompt=2,
                  total_episodes=16, max_new_tokens=5, lr=3e-2, beta=0.1, device="cpu",
                  save_every=0, sample_every=0, report_to="none", generator_threads=1,
                  threads=1, max_staleness=2, num_minibatches=2)
    return GRPOConfig(**values | overrides)


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_llama_dir"])
def test_each_turn_is_sampled_by_the_weights_of_l_batches_before(model, request, env_dir,
                                                                monkeypatch):
    """S = 2 at 2 steps a batch: one batch ahead. Batch b's episodes, every turn of them, were
    sampled by the weights batch b - 1 started from: their recorded log-probs are those weights'
    (recomputed here), their tokens and observations are what a native engine on those weights
    samples from the batch's noise, and each sampled token carries that version."""
    model_dir = request.getfixturevalue(model)
    cfg = grpo(model_dir, env_dir, f"episodes-{model}")
    assert cfg.batches_ahead == 1
    seen, threads = recorded_run(cfg, monkeypatch, None)
    assert threads == 1 and len(seen) == cfg.n_batches == 4
    policy = policy_as_loaded(cfg)
    check_behaviour_policy(seen, cfg, policy, tolerance=1e-4)
    two_turns = 0
    for b, (rollout, _state, version, _done) in enumerate(seen):
        behaviour = seen[max(b - 1, 0)]
        mask = rollout.action_mask
        assert torch.equal(rollout.versions[mask], torch.full_like(rollout.versions[mask],
                                                                   behaviour[2]))
        assert not rollout.versions[~mask].any()  # observations were not sampled by anyone
        assert version == 2 * b  # versions count optimizer steps: 2 a batch
        # What the synchronous loop's engine samples from those weights, here in this process.
        policy.load_state_dict(behaviour[1], strict=False)
        again = synchronous_episodes(cfg, policy, b)
        assert torch.equal(again.rollout.input_ids, rollout.input_ids), b
        assert torch.equal(again.rollout.action_mask, rollout.action_mask), b
        assert torch.equal(again.rollout.attention_mask, rollout.attention_mask), b
        two_turns += int((mask.int().diff(dim=1) == 1).any(dim=1).sum())  # a turn after text
    assert two_turns > 0  # observations sat between turns: the episodes were multi-turn


def synchronous_episodes(cfg: GRPOConfig, policy, batch: int):
    """Batch `batch`'s episodes (its rows and noise, as the loop draws them) sampled by the
    native engine on `policy`, the synchronous loop's way."""
    from tether.models.pretrained import load_tokenizer
    from tether.rl.env.load import load_environment

    tokenizer = load_tokenizer(cfg.policy)
    rows = [json.loads(x) for x in open(cfg.prompts)]
    source = make_source(cfg, native.start(cfg, policy, None, 0, Dist()), tokenizer, prompts=[],
                         prompt_ids=[], rows=rows, reward=None, env=load_environment(cfg.env),
                         tools=[], eos_token_ids=[tokenizer.eos_token_id],
                         device=torch.device("cpu"), source_name="prompts")
    setup = type("Setup", (), {"n_rows": len(rows)})()
    order = ppo.batch_rows(setup, cfg, batch)
    try:
        return source.collect(order, slice(0, len(order)), ppo.batch_seed(cfg, batch))
    finally:
        source.close()


def test_the_run_does_not_depend_on_how_long_the_environment_takes(tiny_model_dir, env_dir):
    """An environment that sleeps a random time in every step trains the weights of one that
    answers at once, to the bit: which version samples which turn follows from the order of the
    trainer's calls, not from timing."""
    from safetensors.torch import load_file

    weights = []
    for env in ("Hint", "Slow"):
        result = ppo.run(grpo(tiny_model_dir, env_dir, f"timing-{env}", env=env,
                              total_episodes=24, max_staleness=4))
        weights.append(load_file(str(next(result.output_path.glob("*.safetensors")))))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_an_environment_failing_in_the_background_is_one_line(tiny_model_dir, env_dir):
    """The third batch's environment raises while its episodes run ahead: the run stops with the
    environment's one line, and its generator process is gone."""
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(TetherError, match=r"environment envs:Breaks: step of episode of .* raised "
                                          r"ValueError: the simulator crashed"):
        ppo.run(grpo(tiny_model_dir, env_dir, "breaks", env="Breaks"))
    import multiprocessing

    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    assert "tether-ahead" not in {t.name for t in threading.enumerate()} - before


def test_a_resumed_run_trains_what_the_uninterrupted_run_trains(tiny_llama_dir, env_dir,
                                                                 monkeypatch):
    """Episodes in flight when the run died (batch 3's, sampled by batch 2's starting weights)
    are sampled again by those weights on resume: the final weights and metrics are the
    uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    kw = dict(env="Flaky", save_every=1, max_staleness=2, num_minibatches=2)
    whole = ppo.run(grpo(tiny_llama_dir, env_dir, "whole", **kw))
    monkeypatch.setenv("TETHER_TEST_CRASH", "1")
    with pytest.raises(TetherError, match="the simulator crashed"):
        ppo.run(grpo(tiny_llama_dir, env_dir, "cut", **kw))
    monkeypatch.delenv("TETHER_TEST_CRASH")
    resumed = ppo.run(grpo(tiny_llama_dir, env_dir, "cut", resume=True, **kw))
    a, b = (load_file(str(next(r.output_path.glob("*.safetensors")))) for r in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [[json.loads(x) for x in (r.output_path.parent / "metrics.jsonl").read_text()
              .splitlines()] for r in (whole, resumed)]
    assert [x["step"] for x in lines[1]] == [1, 2, 3, 4]
    for x, y in zip(*lines, strict=True):
        assert ({k: v for k, v in x.items() if not k.startswith("perf/")}
                == {k: v for k, v in y.items() if not k.startswith("perf/")}), x["step"]


def test_a_run_failing_while_episodes_run_ahead_reports_its_own_error(tiny_model_dir, env_dir,
                                                                      monkeypatch):
    """The update of batch 2 fails while batch 3's episodes are still running ahead (each step
    sleeps): the error raised is the update's, and the episodes' thread and the generator
    end."""
    import multiprocessing

    real = ppo.update_batch
    calls = {"n": 0}

    def breaks(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            time.sleep(0.05)  # batch 3's episodes are under way
            raise RuntimeError("the update broke")
        return real(*args, **kwargs)
    monkeypatch.setattr(ppo, "update_batch", breaks)
    with pytest.raises(RuntimeError, match="the update broke"):
        ppo.run(grpo(tiny_model_dir, env_dir, "update-breaks", env="Slow"))
    deadline = time.monotonic() + 10
    while (multiprocessing.active_children() or any(
            t.name == "tether-ahead" for t in threading.enumerate())) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    assert not any(t.name == "tether-ahead" for t in threading.enumerate())


def test_background_jobs_run_in_order_and_raise_in_the_caller():
    order: list[int] = []

    def work(i: int, delay: float):
        def run():
            time.sleep(delay)
            order.append(i)
            if i == 1:
                raise TetherError("job 1 failed")
            return i
        return run
    first = Background(work(0, 0.2))
    second = Background(work(1, 0.0), after=first)
    third = Background(work(2, 0.0), after=second)
    assert third.result() == 2 and order == [0, 1, 2]  # the slow first job still went first
    assert first.result() == 0
    with pytest.raises(TetherError, match="job 1 failed"):
        second.result()
    calls: list[str] = []
    deferred = Deferred(lambda: calls.append("ran") or 7)
    assert calls == []  # nothing runs before its result is asked for
    assert deferred.result() == 7 and deferred.result() == 7 and calls == ["ran"]


def test_the_engine_waits_for_its_jobs_before_anything_else(monkeypatch):
    """`sync`, `sample` and `prefetch` wait for the submitted work: its requests reach
    the generator before any weights sent after it."""
    sent: list[str] = []
    engine = ahead.AheadEngine.__new__(ahead.AheadEngine)
    engine.jobs, engine.pending, engine.history = [], {}, deque()
    engine.replay, engine.replayed = [], None
    monkeypatch.setattr(ahead.AheadEngine, "_put", lambda self, message: sent.append(message[0]))
    monkeypatch.setattr(ahead, "flatten", lambda params: {})
    engine.counter, engine.params = StepCounter(), []

    def job(turns):
        time.sleep(0.2)
        sent.append("job")
    engine.submit(job)
    engine.sync()
    assert sent == ["job", "weights"] and engine.jobs == []
