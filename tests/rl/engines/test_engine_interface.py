"""The rollout-engine interface (tether.rl.engines.RolloutEngine): the loop holds an engine and never
asks which one. A third engine registered as one entry of `tether.choices.ENGINES` (here: the
native sampler behind a recorder) trains the same weights as the native engine, bit for bit, and
is called in the documented order: sample, sleep through the update, sync after it, close at the
end (also when the run fails); with --max-staleness its generator samples ahead."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tether.choices import ENGINES, Engine
from tether.errors import TetherError
from tether.rl.engines import RolloutEngine, native
from tether.run.distributed import Dist
from tether.run.parse import parse_config
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


class Recorder(RolloutEngine):
    """The native engine, every call written down: an engine that samples only when asked
    inherits what it has nothing to do in (`RolloutEngine`) and writes the rest."""

    lockstep = True

    def __init__(self, inner, calls: list[str]):
        self.inner, self.calls = inner, calls

    def sample(self, prompt_ids, prompt_mask, **settings):
        self.calls.append("sample")
        return self.inner.sample(prompt_ids, prompt_mask, **settings)

    def sleep(self):
        self.calls.append("sleep")

    def sync(self):
        self.calls.append("sync")

    def close(self):
        self.calls.append("close")


def recorder(calls: list[str]) -> Engine:
    """The table entry of the recording engine, written as docs/architecture.md's recipe says."""
    return Engine("the native sampler, its calls recorded",
                  start=lambda settings, model, peft, longest, d, run_model: Recorder(
                      native.start(settings, model, peft, longest, d, run_model), calls),
                  generator=native.start_recording)


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
    monkeypatch.setitem(ENGINES, "recorder", recorder(calls))
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
    monkeypatch.setitem(ENGINES, "recorder", recorder(calls))

    def broken(prompts, responses):
        raise RuntimeError("the reward server is down")
    with pytest.raises(TetherError, match="the reward server is down"):
        run(config(tiny_model_dir, tmp_path, "broken", engine="recorder"), reward_fn=broken)
    assert calls == ["sample", "close"]


def test_a_new_engine_samples_ahead_through_its_own_generator(tiny_model_dir, tmp_path,
                                                              monkeypatch):
    # Registered as the recipe says, the engine runs under --max-staleness too: its entry names
    # the generator the second process runs (before the table, a KeyError there).
    monkeypatch.setitem(ENGINES, "recorder", recorder([]))
    ahead = run(config(tiny_model_dir, tmp_path, "ahead", engine="recorder", max_staleness=1,
                       generator_threads=1), reward_fn=reward)
    native_ahead = run(config(tiny_model_dir, tmp_path, "native-ahead", max_staleness=1,
                              generator_threads=1), reward_fn=reward)
    for name in sorted(p.name for p in ahead.output_path.glob("*.safetensors")):
        a, b = (load_file(str(r.output_path / name)) for r in (ahead, native_ahead))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_engines_own_log_probs_are_said_alike_by_the_table_and_by_instance(tiny_model_dir,
                                                                              root_dir=None):
    # The table says which engines' log-probs are their own; that fact, and nothing else, is
    # where the corrections act: --engine-is-cap is refused with an engine without (before
    # anything loads), accepted with one.
    from tether.rl.engines.vllm_engine import VLLMEngine

    # the native engine has its own log-probs only as the copy sampling ahead (--max-staleness)
    assert native.start(None, None, None, 0, Dist()).own_logprobs is False
    assert native.start_recording(None, None, None, 0, Dist()).own_logprobs is True
    assert ENGINES["native"].own_logprobs is False
    assert VLLMEngine.own_logprobs is True and ENGINES["vllm"].own_logprobs is True
    for name, engine in ENGINES.items():
        argv = ["--policy", "p", "--prompts", "x.jsonl", "--engine", name, "--engine-is-cap", "2"]
        if engine.own_logprobs:
            parse_config(PPOConfig, argv)
        else:
            with pytest.raises(TetherError, match=f"--engine-is-cap applies with --engine vllm "
                                                  f"or --max-staleness above 0, and tether ppo "
                                                  f"runs with --engine {name}"):
                parse_config(PPOConfig, argv)
