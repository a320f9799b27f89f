"""The engine-vs-trainer mismatch metrics and corrections on hand-computed tensors
(tether.rl.engines.mismatch), the layout of an engine's responses, per-row seeds, and the
config's checks. None of these needs vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from tether.errors import TetherError
from tether.losses import ppo_policy_loss
from tether.rl.engines.mismatch import (
    Correction,
    correction_weights,
    mismatch_metrics,
    sequence_k3,
)
from tether.rl.engines.vllm_engine import _layout, import_vllm, row_seed
from tether.rl.rollout import sampling_uniforms
from tether.run.scopes import check_given
from tether.train.ppo_config import GRPOConfig

# Two rows: three real tokens in all, padding after them.
TRAINER = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
ENGINE = torch.tensor([[-1.1, -1.9, 0.0], [-0.5, 0.0, 0.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


def test_engine_kl_is_the_batch_mean_of_per_sequence_k3_sums():
    row0 = k3(0.1) + k3(-0.1)  # 0.005170918 + 0.004837418
    assert sequence_k3(TRAINER, ENGINE, MASK).tolist() == pytest.approx([row0, 0.0], abs=1e-7)
    metrics = mismatch_metrics(TRAINER, ENGINE, MASK)
    assert metrics["rollout/engine_kl"] == pytest.approx(row0 / 2, abs=1e-7)  # 0.005004168
    assert metrics["rollout/engine_max_logprob_diff"] == pytest.approx(0.1, abs=1e-6)
    # padding never counts, whatever it holds
    noisy = ENGINE.clone()
    noisy[~MASK] = -30.0
    assert mismatch_metrics(TRAINER, noisy, MASK) == pytest.approx(metrics)


def test_truncated_weights_and_their_mean_over_real_tokens():
    weights, stats = correction_weights(TRAINER, ENGINE, MASK, Correction(engine_is_cap=1.05))
    # ratios exp(0.1) = 1.10517 (capped to 1.05), exp(-0.1) = 0.904837, exp(0) = 1
    expected = torch.tensor([[1.05, math.exp(-0.1), 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(weights, expected, atol=1e-6)
    # The mean over the 3 real tokens is 0.984946; averaging the padded [2, 3] tensor (padding
    # read as 0) would say 0.492473: the aggregation error a ratio metric must not make.
    assert stats["rollout/engine_is_weight"] == pytest.approx((1.05 + math.exp(-0.1) + 1) / 3,
                                                             abs=1e-6)
    assert weights.mean().item() == pytest.approx(0.492473, abs=1e-6)  # the wrong reading
    assert stats["rollout/engine_is_truncated"] == pytest.approx(1 / 3)
    assert stats["rollout/engine_masked_rows"] == 0.0


def test_rows_past_the_kl_threshold_get_no_policy_gradient():
    # row 0's summed k3 is 0.0100; row 1's is 0
    weights, stats = correction_weights(TRAINER, ENGINE, MASK, Correction(engine_mask_kl=0.005))
    assert weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert stats["rollout/engine_masked_rows"] == 0.5
    assert stats["rollout/engine_is_weight"] == pytest.approx(1 / 3)
    kept, _ = correction_weights(TRAINER, ENGINE, MASK, Correction(engine_mask_kl=0.02))
    assert kept.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_weighting_the_advantage_weights_each_tokens_clipped_surrogate():
    # What update_batch relies on: for w >= 0, max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)).
    g = torch.Generator().manual_seed(0)
    logprobs, old = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    adv, w = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) * 2
    mask = torch.ones(4, 6, dtype=torch.bool)
    weighted, _ = ppo_policy_loss(logprobs, old, adv * w, mask, 0.2)
    ratio = torch.exp(logprobs - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert weighted.item() == pytest.approx((w * per_token).mean().item(), rel=1e-5)


def test_a_rows_seed_depends_on_its_own_noise_only():
    whole = sampling_uniforms(7, 8, 5)
    part = sampling_uniforms(7, 4, 5)  # a smaller batch of the same stream
    assert [row_seed(r) for r in part] == [row_seed(r) for r in whole[:4]]
    seeds = [row_seed(r) for r in whole]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert row_seed(sampling_uniforms(8, 1, 5)[0]) != seeds[0]


def test_engine_responses_are_laid_out_as_every_rollout():
    prompt_ids = torch.tensor([[9, 5, 6], [9, 9, 7]])  # 9: pad, left-padded
    prompt_mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    # row 0 ends on the second EOS id (11), row 1 on max_new_tokens; a width of 4
    rollout = _layout(prompt_ids, prompt_mask, [[3, 11], [4, 4, 4]], [[-0.5, -0.25], [-1.0] * 3],
                      4, [10, 11], 9, 0.7)
    assert rollout.responses.tolist() == [[3, 11, 9, 9], [4, 4, 4, 9]]
    assert rollout.response_mask.tolist() == [[True, True, False, False],
                                              [True, True, True, False]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]]
    assert rollout.ended.tolist() == [True, False]
    assert rollout.engine_logprobs.tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, -1.0, -1.0, 0.0]]
    assert rollout.context_length == 3 and rollout.temperature == 0.7
    assert rollout.select(torch.tensor([1])).engine_logprobs.tolist() == [[-1.0, -1.0, -1.0, 0.0]]


def test_without_vllm_the_engine_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if not installed
    with pytest.raises(TetherError, match=r"needs vLLM, which is not installed.*\.\[vllm\]") as e:
        import_vllm()
    assert "\n" not in str(e.value)


def test_corrections_are_checked(tmp_path):
    base = dict(policy="p", prompts="q", output_dir=str(tmp_path))
    with pytest.raises(TetherError, match="--engine-is-cap 0.5 must be 0 .off. or >= 1"):
        GRPOConfig(engine="vllm", engine_is_cap=0.5, **base).validate()
    with pytest.raises(TetherError, match="--engine-mask-kl applies with --engine vllm"):
        check_given(GRPOConfig(engine_mask_kl=1.0, **base), {"engine_mask_kl"})
    vllm = GRPOConfig(engine="vllm", engine_is_cap=2.0, engine_mask_kl=1.0, **base)
    vllm.validate()
    check_given(vllm, {"engine_is_cap", "engine_mask_kl"})
