"""tether.rl.update.update_batch: one optimizer step per batch on a single policy forward (pi_old
scored by the update's own forward) gives what the two-pass path gives (score_batch, then
kl_shaped_rewards, estimate_advantages, ppo_update): the same old-policy scores, KL, advantages,
loss, and parameters after the step."""

from __future__ import annotations

import json

import pytest
import torch
from update_helpers import prompt_batch

from tether.rl import update
from tether.rl.engines.native import sample_responses
from tether.rl.update import one_pass, update_batch
from tether.run.distributed import Dist
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import build, update_spec

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("onpolicy") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def config(model_dir, prompts_file, **overrides) -> PPOConfig:
    values = dict(run_name="onpolicy", output_dir=str(prompts_file.parent / "runs"),
                  policy=str(model_dir), prompts=str(prompts_file), batch_size=8,
                  samples_per_prompt=4, total_episodes=16, max_new_tokens=6, lr=1e-3,
                  ppo_epochs=1, device="cpu", save_every=0, sample_every=0)
    values.update(overrides)
    return PPOConfig(**values)


def moved_setup(cfg):
    """A setup whose policy is no longer its reference (seeded noise on every weight), so the KL,
    its reward shaping and its loss term are not trivially zero."""
    setup = build(cfg, reward_fn=length_reward)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in setup.policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return setup


CASES = {  # name: (family fixture, config overrides)
    "rloo, KL k1 in the reward": ("tiny_model_dir", dict(advantage="rloo")),
    "grpo, k3 x ratio in the loss": ("tiny_llama_dir", dict(
        advantage="grpo", kl_in="loss", kl_per_token_mean=True, beta=0.5)),
    "grpo, exact KL in the loss": ("tiny_model_dir", dict(
        advantage="grpo", kl_in="loss", kl_estimator="exact", beta=0.5)),
    "gae, separate critic": ("tiny_llama_dir", dict(advantage="gae", samples_per_prompt=1)),
    "grpo, bf16 autocast": ("tiny_model_dir", dict(
        advantage="grpo", kl_in="loss", beta=0.5, mixed_precision="bf16")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_forward_step_equals_the_two_pass_step(case, prompts_file, request, monkeypatch):
    family, overrides = CASES[case]
    cfg = config(request.getfixturevalue(family), prompts_file, **overrides)
    assert one_pass(update_spec(cfg, Dist()), cfg.batch_size, Dist())
    two_pass, fused = moved_setup(cfg), moved_setup(cfg)  # identical models and optimizers
    _, ids, mask = prompt_batch(two_pass, cfg, 0)
    rollout = sample_responses(two_pass.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_ids=two_pass.eos_token_ids,
                               pad_token_id=two_pass.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    scores = torch.randn(len(rollout), generator=torch.Generator().manual_seed(2))

    def steps_2_to_4(setup, fuse: bool):
        # the batch allows both paths; one_pass decides which update_batch takes
        monkeypatch.setattr(update, "one_pass", lambda spec, rows, d: fuse)
        done = update_batch(setup.roles, setup.reference, setup.optimizer, rollout, scores,
                            cfg.beta, setup.spec, torch.Generator().manual_seed(0))
        return done.old, done.kl, done.advantages, done.returns, done.stats
    old, kl, advantages, returns, stats = steps_2_to_4(two_pass, fuse=False)
    old_f, kl_f, advantages_f, returns_f, stats_f = steps_2_to_4(fused, fuse=True)
    monkeypatch.undo()

    assert kl.abs().sum() > 0.01  # the policy really differs from its reference
    for name in ("logprobs", "ref_logprobs", "values", "entropy", "exact_kl"):
        torch.testing.assert_close(getattr(old_f, name), getattr(old, name), atol=1e-5, rtol=1e-5,
                                   msg=name)
    torch.testing.assert_close(kl_f, kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(advantages_f, advantages, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns_f, returns, atol=1e-5, rtol=1e-5)
    assert stats_f["policy/ratio_mean"] == 1.0 and stats_f["policy/approx_kl"] == 0.0
    for key in stats:
        assert stats_f[key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
    # One optimizer step each, to the same parameters (and away from where they started).
    moved = 0.0
    for name, p in fused.policy.named_parameters():
        q = dict(two_pass.policy.named_parameters())[name]
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    start = moved_setup(cfg).policy
    for p, p0 in zip(fused.policy.parameters(), start.parameters(), strict=True):
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-4
    if two_pass.critic is not None:
        for p, q in zip(fused.critic.parameters(), two_pass.critic.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("overrides", [dict(ppo_epochs=2), dict(num_minibatches=2),
                                       dict(micro_batch_size=4)])
def test_two_pass_loop_kept_when_a_batch_gets_more_than_one_forward(overrides):
    fields = dict(policy="p", prompts="p", batch_size=8, ppo_epochs=1) | overrides
    one = PPOConfig(policy="p", prompts="p", batch_size=8, ppo_epochs=1)
    assert one_pass(update_spec(one, Dist()), 8, Dist())
    assert not one_pass(update_spec(PPOConfig(**fields), Dist()), 8, Dist())
    assert not one_pass(update_spec(one, Dist(world_size=2)), 8, Dist(world_size=2))  # torchrun
