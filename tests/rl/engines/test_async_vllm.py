"""Asynchronous generation with the vLLM engine (`--engine vllm --max-staleness S`): the
generator process runs vLLM on its copy of the policy, takes each sync's weights into the copy
and then into vLLM (full weights; with LoRA the adapter alone, as vLLM's adapter), and reports
vLLM's own log-probs as the behaviour policy's.

The independent truth: each batch's behaviour log-probs equal the trainer's recomputation with
the weights it held L batches earlier (fp32 on CPU: within the engine's 1e-4), and differ from
the weights that train it. Needs vLLM (`pip install -e '.[vllm]'`); CI installs it and sets
TETHER_REQUIRE_VLLM=1, so there these fail instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("TETHER_REQUIRE_VLLM"):
        raise RuntimeError("TETHER_REQUIRE_VLLM is set but vllm is not installed: "
                           "pip install -e '.[vllm]'")
    pytest.skip("vllm is not installed (pip install -e '.[vllm]')", allow_module_level=True)

from async_helpers import check_behaviour_policy, policy_as_loaded, recorded_run  # noqa: E402
from conftest import sample_texts  # noqa: E402
from offline_fixtures import sft_rows, write_jsonl  # noqa: E402

from tether.models.tiny import save_tiny_llama  # noqa: E402
from tether.train.ppo_config import GRPOConfig  # noqa: E402

TOLERANCE = 1e-4  # fp32 on CPU: vLLM and the trainer agree to ~1e-5 per token


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):  # vLLM's CPU attention needs a head size of 32 or more
    return save_tiny_llama(tmp_path_factory.mktemp("llama128"), sample_texts(), vocab_size=300,
                           hidden_size=128, n_head=4)


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [("tiny_model_dir", 0), ("llama_dir", 4)])
def test_vllm_behind_the_trainer_samples_with_the_weights_of_l_batches_before(
        family, lora, request, tmp_path, monkeypatch):
    model_dir = request.getfixturevalue(family)
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"prompt": r["prompt"]} for r in sft_rows(8)])
    cfg = GRPOConfig(policy=str(model_dir), prompts=str(prompts), output_dir=str(tmp_path / "o"),
                     run_name="vllm-ahead", engine="vllm", engine_kv_cache_mb=64,
                     max_staleness=2, num_minibatches=2, batch_size=4, samples_per_prompt=2,
                     total_episodes=12, max_new_tokens=6, lr=3e-2, lora_r=lora, device="cpu",
                     save_every=0, sample_every=0, report_to="none", threads=1,
                     generator_threads=1)
    seen, _ = recorded_run(cfg, monkeypatch, length_reward)
    assert [v for _, _, v, _ in seen] == [0, 2, 4]
    check_behaviour_policy(seen, cfg, policy_as_loaded(cfg), TOLERANCE)
