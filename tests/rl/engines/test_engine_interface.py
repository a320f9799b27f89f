"""The rollout-engine interface (tether.rl.engines.RolloutEngine): the loop holds an engine and never
asks which one. A third engine registered as one entry of `ENGINES` (here: the native sampler
behind a recorder) trains the same weights as the native engine, bit for bit, and is called in
the documented order: sample, sleep through the update, sync after it, close at the end (also
when the run fails)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tether.errors import TetherError
from tether.rl import engines
from tether.rl.engines import ENGINES, OWN_LOGPROBS, native
from tether.rl.engines.jobs import Deferred
from tether.run.distributed import Dist
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


class Recorder:
    """The native engine, every call written down."""

    own_logprobs = False
    lockstep = True

    def __init__(self, inner, calls: list[str]):
        self.inner, self.calls = inner, calls

    def sample(self, prompt_ids, prompt_mask, **settings):
        self.calls.append("sample")
        return self.inner.sample(prompt_ids, prompt_mask, **settings)

    def prefetch(self, prompt_ids, prompt_mask, **settings):
        self.calls.append("prefetch")

    def submit(self, work):
        self.calls.append("submit")
        return Deferred(lambda: work(self))

    def sleep(self):
        self.calls.append("sleep")

    def sync(self):
        self.calls.append("sync")

    def close(self):
        self.calls.append("close")


def config(model_dir, tmp_path, name, **overrides) -> GRPOConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                  prompts=str(prompts), batch_size=8, total_episodes=16, max_new_tokens=5,
                  lr=1e-3, device="cpu", save_every=0, sample_every=0, eval_prompts=str(prompts))
    return GRPOConfig(**values | overrides)


def reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_new_engine_is_one_table_entry_and_the_loop_calls_it_in_order(family, tmp_path,
                                                                         monkeypatch, request):
    model_dir = request.getfixturevalue(family)
    calls: list[str] = []
    monkeypatch.setitem(ENGINES, "recorder", lambda settings, model, peft, prompt_ids, d, run_model:
                        Recorder(native.start(model, d, run_model), calls))
    recorded = run(config(model_dir, tmp_path, "recorded", engine="recorder"), reward_fn=reward)
    plain = run(config(model_dir, tmp_path, "plain"), reward_fn=reward)
    files = sorted(p.name for p in recorded.output_path.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in plain.output_path.glob("*.safetensors"))
    for name in files:
        a, b = (load_file(str(r.output_path / name)) for r in (recorded, plain))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # 2 batches; the evaluation samples 4 held-out prompts in one chunk at the end
    assert calls == ["sample", "sleep", "sync"] * 2 + ["sample", "close"]


def test_a_failed_run_closes_its_engine(tiny_model_dir, tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(ENGINES, "recorder", lambda settings, model, peft, prompt_ids, d, run_model:
                        Recorder(native.start(model, d, run_model), calls))

    def broken(prompts, responses):
        raise RuntimeError("the reward server is down")
    with pytest.raises(TetherError, match="the reward server is down"):
        run(config(tiny_model_dir, tmp_path, "broken", engine="recorder"), reward_fn=broken)
    assert calls == ["sample", "close"]


def test_the_engines_own_log_probs_are_said_alike_by_name_and_by_instance(tiny_model_dir):
    # The config refuses the mismatch corrections for an engine without its own log-probs,
    # before anything loads; the table and the engines agree on which those are.
    from tether.rl.engines.vllm_engine import VLLMEngine

    # the native engine has its own log-probs only as the copy sampling ahead (--max-staleness)
    assert engines.native.start(None, Dist()).own_logprobs is False
    assert engines.native.start(None, Dist(), record_logprobs=True).own_logprobs is True
    assert "native" not in OWN_LOGPROBS
    assert VLLMEngine.own_logprobs is True and "vllm" in OWN_LOGPROBS
    for name in ENGINES:
        cfg = PPOConfig(policy="p", prompts="x.jsonl", engine=name, engine_is_cap=2.0)
        if name in OWN_LOGPROBS:
            cfg.validate()
        else:
            with pytest.raises(TetherError, match="--engine-is-cap 2.0 corrects vLLM.s sampling"):
                cfg.validate()
