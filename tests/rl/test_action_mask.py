"""`Rollout.action_mask`: the tokens the policy sampled, apart from the layout's `response_mask`.

Single-turn rollouts have one equal to the other (pinned here for the native engine, stop strings,
refilled batches and the vLLM layout). A hand-made rollout whose action mask has a hole in the
middle of a response (tokens the policy did not sample, as an environment's observation will be)
shows what reads it: the hole gets exactly zero gradient from every loss term (surrogate, value
loss, KL term by k3 x ratio and by the exact KL), no KL in the shaped rewards, the controller's
sum or the metrics, no entropy, and the score still goes on the last token the policy sampled.
The independent truth is a forward of the models on the same ids and the sums written out.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from update_helpers import loss_batch, prompt_batch

from tether.advantages import kl_shaped_rewards
from tether.models.trunk_head import score_responses
from tether.rl.engines import make_engine
from tether.rl.rollout import Rollout, apply_stop_strings, concat_rollouts, sampling_uniforms
from tether.rl.scoring import kl_sums, score_batch
from tether.rl.update import Forwards, counts_of, update_loss
from tether.run.distributed import Dist
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("action_mask") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def setup_for(model_dir, prompts_file, **overrides):
    values = dict(run_name="holes", output_dir=str(prompts_file.parent / "runs"),
                  policy=str(model_dir), prompts=str(prompts_file), batch_size=8,
                  samples_per_prompt=2, total_episodes=8, max_new_tokens=8, lr=1e-3,
                  device="cpu", save_every=0, sample_every=0) | overrides
    cfg = PPOConfig(**values)
    setup = build(cfg, reward_fn=length_reward)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the policy off its reference (every KL non-zero), the values off 0
        for p in [*setup.policy.parameters(), *(setup.critic.parameters() if setup.critic else [])]:
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return cfg, setup


def sampled(cfg, setup) -> Rollout:
    _, ids, mask = prompt_batch(setup, cfg, 0)
    return setup.engine.sample(ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_ids=[-1],  # never ends
                               pad_token_id=setup.tokenizer.pad_token_id,
                               uniforms=sampling_uniforms(0, len(ids), cfg.max_new_tokens))


def test_single_turn_rollouts_have_equal_masks(tiny_model_dir, prompts_file):
    cfg, setup = setup_for(tiny_model_dir, prompts_file)
    _, ids, mask = prompt_batch(setup, cfg, 0)
    engine = make_engine(cfg, setup.policy, longest_prompt=16, d=Dist())
    rollout = engine.sample(ids, mask, max_new_tokens=6, temperature=1.0,
                            eos_token_ids=setup.eos_token_ids,
                            pad_token_id=setup.tokenizer.pad_token_id,
                            uniforms=sampling_uniforms(3, len(ids), 6))
    assert torch.equal(rollout.action_mask, rollout.response_mask)
    cut = apply_stop_strings(rollout, setup.tokenizer, ["e"], setup.tokenizer.pad_token_id)
    assert not torch.equal(cut.response_mask, rollout.response_mask)  # the stop string cut some
    assert torch.equal(cut.action_mask, cut.response_mask)
    joined = concat_rollouts([cut.select(slice(0, 3)), rollout.select(slice(3, 8))],
                             setup.tokenizer.pad_token_id)
    assert torch.equal(joined.action_mask, joined.response_mask)


def test_the_vllm_layout_has_equal_masks():
    from tether.rl.engines.vllm_engine import _layout

    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1] * 3])
    rollout = _layout(prompt_ids, prompt_mask, [[3, 4, 2], [5]], [[-1.0, -2.0, -0.5], [-0.1]], 3,
                      eos=[2], pad_token_id=0, temperature=1.0)
    assert rollout.response_mask.tolist() == [[True] * 3, [True, False, False]]
    assert torch.equal(rollout.action_mask, rollout.response_mask)


def with_holes(rollout: Rollout) -> tuple[Rollout, torch.Tensor]:
    """Row 0: tokens 2 and 3 of 8 not sampled (a hole). Row 1: its last two tokens not sampled
    (so its last sampled token is not its last real one). The other rows as sampled."""
    action = rollout.action_mask.clone()
    hole = torch.zeros_like(action)
    hole[0, 2:4] = True
    hole[1, 6:8] = True
    assert bool(rollout.response_mask[hole].all())  # real tokens, every one of them
    return replace(rollout, action_mask=action & ~hole), hole


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_hole_gets_no_kl_and_the_score_sits_on_the_last_sampled_token(family, prompts_file,
                                                                        request):
    cfg, setup = setup_for(request.getfixturevalue(family), prompts_file, advantage="gae",
                           samples_per_prompt=1)
    rollout, hole = with_holes(sampled(cfg, setup))
    old = score_batch(setup.roles, setup.reference, rollout, setup.spec)
    # pi_old, the reference, the values, the entropy and the exact KL say nothing at the hole
    for name in ("logprobs", "ref_logprobs", "values", "entropy", "exact_kl"):
        assert bool((getattr(old, name)[hole] == 0).all()), name
    scores = torch.arange(8, dtype=torch.float32) + 1
    rewards, kl = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, rollout.action_mask,
                                    0.1)
    assert bool((kl[hole] == 0).all())
    # the score on the last sampled token: row 0's last real one, row 1's token 5, not 7
    placed = rewards + 0.1 * kl
    assert float(placed[0, 7]) == pytest.approx(1.0) and float(placed[1, 5]) == pytest.approx(2.0)
    assert float(placed[0, :7].abs().max()) < 1e-6 and float(rewards[1, 6:].abs().sum()) == 0.0
    # by hand: k1 summed over the sampled tokens of a plain forward of each model
    args = (rollout.input_ids, rollout.attention_mask, rollout.context_length, 1.0)
    with torch.no_grad():
        policy = score_responses(setup.policy, *args, chunked=False).logprobs
        reference = score_responses(setup.reference, *args, chunked=False).logprobs
    by_hand = ((policy - reference) * rollout.action_mask).sum(1).mean()
    with_hole_tokens = ((policy - reference) * rollout.response_mask).sum(1).mean()
    assert kl_sums(old, rollout.action_mask)["objective/kl_k1"] == pytest.approx(
        float(by_hand), rel=1e-4, abs=1e-6)
    assert abs(float(with_hole_tokens - by_hand)) > 1e-4  # the hole would have counted


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("estimator", ["k3_ratio", "exact"])
def test_a_hole_gets_exactly_zero_gradient_from_every_loss_term(family, estimator, prompts_file,
                                                                request):
    cfg, setup = setup_for(request.getfixturevalue(family), prompts_file, advantage="gae",
                           samples_per_prompt=1, kl_in="loss", kl_estimator=estimator,
                           beta=0.5)
    rollout, hole = with_holes(sampled(cfg, setup))
    old = score_batch(setup.roles, setup.reference, rollout, setup.spec)
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(hole.shape, generator=gen) * rollout.action_mask
    returns = torch.randn(hole.shape, generator=gen) * rollout.action_mask
    batch = loss_batch(rollout, old, advantages, returns, mask_truncated=False)
    forward = Forwards(setup.roles, setup.reference, rollout, setup.spec, 0.5)(torch.arange(8))
    for tensor in (forward.logprobs, forward.values) + ((forward.exact_kl,)
                                                        if estimator == "exact" else ()):
        tensor.retain_grad()
    loss, stats = update_loss(forward, batch, setup.spec, 0.5, counts_of(batch, False), True)
    assert stats["objective/kl_loss"] > 0 and stats["value/loss"] > 0
    loss.backward()
    sampled_tokens = rollout.action_mask
    for name, tensor in (("logprobs", forward.logprobs), ("values", forward.values),
                         ("exact_kl", forward.exact_kl)):
        if tensor is None:
            continue
        assert bool((tensor.grad[hole] == 0).all()), name  # exactly, not nearly
        assert float(tensor.grad[sampled_tokens].abs().sum()) > 0, name
    # the counts the losses divide by are the sampled tokens
    assert counts_of(batch, False).tokens == int(rollout.response_mask.sum()) - 4
