"""PPO with the KL penalty in the reward converges to the KL-regularised optimum

    pi*(y | x) = pi_ref(y | x) * exp(r(y) / beta) / Z

(the maximiser of E_pi[r] - beta * KL(pi || pi_ref); e.g. Rafailov et al. 2023, eq. 4, or
Korbak et al. 2022), and the adaptive controller steers the measured KL to its target.

The task has one-token responses, so the exact pi* is a softmax over the vocabulary that we can
compute from the reference's next-token distribution, and we compare it with the trained policy's
full next-token distribution (its softmax, not sampled frequencies).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.train.ppo import PPOConfig, run

PROMPT = "the movie was"
# Rewards on five single tokens whose decoded text no other token shares; every other token 0.
TABLE = {"the": 4.0, "was": 3.0, "plot": 2.0, "a": 2.0, ".": 1.0}


def table_reward(prompts, responses):
    return [TABLE.get(r, 0.0) for r in responses]


@pytest.fixture(scope="module")
def task(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_token")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    decoded = [tokenizer.decode([i], skip_special_tokens=True) for i in range(len(tokenizer))]
    for word in TABLE:
        assert decoded.count(word) == 1, f"{word!r} must be exactly one token"
    rewards = torch.tensor([TABLE.get(text, 0.0) for text in decoded], dtype=torch.float64)
    # The reference as PPO sees it: loaded by the same code, with the added pad row.
    reference = load_causal_lm(str(tiny_model_dir), tokenizer).eval()
    return root, tokenizer, rewards, next_token_probs(reference, tokenizer)


def next_token_probs(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)


def optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """pi*(y) = pi_ref(y) exp(r(y) / beta) / Z, computed in log space."""
    return torch.softmax(ref_probs.log() + rewards / beta, -1)


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def one_token_config(root, model_dir, name, **overrides) -> PPOConfig:
    # Small, fast settings: 60 batches of 128 one-token episodes; a large learning rate decayed
    # linearly to 0 lets the last updates average the sampling noise out.
    values = dict(run_name=name, output_dir=str(root / "runs"), policy=str(model_dir),
                  prompts=str(root / "prompts.jsonl"), max_new_tokens=1, batch_size=128,
                  total_episodes=128 * 60, ppo_epochs=2, lr=3e-3, lr_schedule="linear",
                  max_grad_norm=0.0, kl_ctl="fixed", device="cpu", save_every=0, sample_every=0,
                  log_every=1)
    values.update(overrides)
    return PPOConfig(**values)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_ppo_converges_to_kl_regularised_optimum(task, tiny_model_dir, beta):
    root, tokenizer, rewards, ref_probs = task
    target = optimum(ref_probs, rewards, beta)
    # The optimum is far from the reference, and the two betas' optima are far from each other,
    # so landing within 0.05 of the right one is informative.
    assert tv(target, ref_probs) > 0.25
    assert tv(optimum(ref_probs, rewards, 0.5), optimum(ref_probs, rewards, 1.0)) > 0.5
    cfg = one_token_config(root, tiny_model_dir, f"beta_{beta}", beta=beta)
    result = run(cfg, reward_fn=table_reward)
    policy = AutoModelForCausalLM.from_pretrained(result.output_path).eval()
    probs = next_token_probs(policy, tokenizer)
    assert tv(probs, target) < 0.05, (tv(probs, target), tv(probs, ref_probs))


@pytest.mark.slow
def test_ppo_stays_at_reference_when_beta_is_huge(task, tiny_model_dir):
    root, tokenizer, rewards, ref_probs = task
    cfg = one_token_config(root, tiny_model_dir, "beta_huge", beta=1e4, critic="shared")
    result = run(cfg, reward_fn=table_reward)
    policy = AutoModelForCausalLM.from_pretrained(result.output_path).eval()
    # pi* = ref * exp(r / 1e4) / Z is within 1e-3 of ref; the policy must not chase the reward.
    assert tv(optimum(ref_probs, rewards, 1e4), ref_probs) < 1e-3
    assert tv(next_token_probs(policy, tokenizer), ref_probs) < 0.05  # same bar as the others


@pytest.mark.slow
def test_adaptive_controller_brings_kl_to_target(task, tiny_model_dir):
    # Start at beta 0.6, where the reward pulls the policy far from the reference (the exact KL of
    # pi*_0.6 is over 3 nats). With a target of 0.6 nats the controller must raise beta until the
    # measured KL (the batch mean of per-sequence k1 sums, what the controller sees) sits near
    # 0.6; the exact pi*_beta has KL 0.6 at beta of about 1. horizon = 8 batches: beta moves at
    # most 2.5% a batch, slower than the policy, as in practice (Ziegler et al. use 10k episodes).
    root, _, rewards, ref_probs = task
    exact_kl = lambda p: float((p * (p / ref_probs).log()).sum())  # noqa: E731
    assert exact_kl(optimum(ref_probs, rewards, 0.6)) > 3.0
    assert 0.4 < exact_kl(optimum(ref_probs, rewards, 1.0)) < 0.9
    cfg = one_token_config(root, tiny_model_dir, "adaptive", kl_ctl="adaptive", beta=0.6,
                           kl_target=0.6, kl_horizon=1024, total_episodes=128 * 70,
                           lr_schedule="constant", lr=5e-3, critic="shared")
    run(cfg, reward_fn=table_reward)
    lines = [json.loads(x) for x in (root / "runs" / "adaptive" / "metrics.jsonl").read_text()
             .splitlines()]
    kls = [x["objective/kl"] for x in lines]
    betas = [x["objective/beta"] for x in lines]
    assert max(kls[:25]) > 2.0, "the reward should first pull the policy well past the target"
    late = sum(kls[-20:]) / 20
    assert abs(late - 0.6) < 0.3, kls
    assert 0.75 < betas[-1] < 1.4, betas  # near the beta whose optimum has KL 0.6
