"""PPO's memory and precision knobs: micro-batches, gradient checkpointing and bf16 autocast.

The independent truth is the plain update (whole minibatch per forward, no checkpointing, fp32):
micro-batches and checkpointing must reproduce it to float rounding, bf16 must come close, and
all three must keep the on-policy invariant (first-epoch ratio exactly 1, KL exactly 0). Layer
calls and dtypes show that each knob really acted.
"""

from __future__ import annotations

import json

import pytest
import torch
from scale_helpers import (
    assert_same_weights,
    layer_calls,
    layer_output_dtypes,
    max_change,
    weights,
)
from update_helpers import prompt_batch, update_on

from tether.advantages import gae, kl_shaped_rewards, whiten
from tether.cli import main
from tether.models import forward as shared_prompt
from tether.models import trunk_head
from tether.models.forward import autocast
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.trunk_head import trunk_and_head
from tether.rl import scoring
from tether.rl.engines.native import sample_responses
from tether.rl.scoring import score_rollout
from tether.train.ppo import PPOConfig, run
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music"]
MODELS = ["tiny_model_dir", "tiny_llama_dir"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_memory")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def config(env, model_dir, name, **overrides) -> PPOConfig:
    values = dict(run_name=name, output_dir=str(env / "runs"), policy=str(model_dir),
                  prompts=str(env / "prompts.jsonl"), batch_size=8, total_episodes=8,
                  max_new_tokens=6, lr=1e-4, device="cpu", save_every=0, sample_every=0,
                  num_minibatches=2, ppo_epochs=1)
    values.update(overrides)
    return PPOConfig(**values)


def one_batch(env, model_dir, name, **overrides):
    """One rollout batch and its update; (policy weights, metrics, layer calls)."""
    with layer_calls() as calls:
        result = run(config(env, model_dir, name, **overrides), reward_fn=length_reward)
    return weights(result.output_path), result.metrics, calls


@pytest.fixture
def plain_pass(monkeypatch):
    """Every forward in one call (no prompt sharing, tether.models.forward): these tests count
    layer calls and their rows, which sharing splits into a prompt call and a response call."""
    monkeypatch.setattr(shared_prompt, "can_share", lambda model: False)


def grad_rows(calls):
    return [rows for rows, grad in calls if grad]


UPDATE_STATS = ("policy/loss", "value/loss", "policy/clip_frac", "policy/approx_kl",
                "policy/ratio_mean", "value/clip_frac", "policy/grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("epochs", [1, 2])
def test_micro_batches_give_the_minibatch_update(env, model, epochs, request, plain_pass):
    model_dir = request.getfixturevalue(model)
    tag = f"{model}_{epochs}"
    plain_w, plain_m, plain_calls = one_batch(env, model_dir, f"plain_{tag}", ppo_epochs=epochs)
    micro_w, micro_m, micro_calls = one_batch(env, model_dir, f"micro_{tag}", ppo_epochs=epochs,
                                              micro_batch_size=2)
    # Same rollout (same seeds), same shuffles (same generator), same gradients: the policy moved
    # ~lr per entry and lands on the same weights, and the stats are the minibatch's.
    assert max_change(weights(load_causal_lm(str(model_dir), load_tokenizer(str(model_dir)))),
                      plain_w) > 5e-5
    assert_same_weights(plain_w, micro_w, rtol=1e-5, atol=5e-6)
    for key in UPDATE_STATS:
        assert micro_m[key] == pytest.approx(plain_m[key], rel=1e-4, abs=1e-6), key
    # The knob acted: trained forwards see 2 rows (policy and critic), never the minibatch's 4.
    assert set(grad_rows(plain_calls)) == {4} and set(grad_rows(micro_calls)) == {2}
    assert len(grad_rows(micro_calls)) == 2 * len(grad_rows(plain_calls))


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_gradient_checkpointing_gives_the_plain_update_and_recomputes(env, model, request,
                                                                      plain_pass):
    model_dir = request.getfixturevalue(model)
    plain_w, plain_m, plain_calls = one_batch(env, model_dir, f"gc_off_{model}")
    ckpt_w, ckpt_m, ckpt_calls = one_batch(env, model_dir, f"gc_on_{model}",
                                           gradient_checkpointing=True)
    assert_same_weights(plain_w, ckpt_w, rtol=1e-6, atol=1e-8)
    for key in UPDATE_STATS:
        assert ckpt_m[key] == pytest.approx(plain_m[key], rel=1e-6, abs=1e-9), key
    # Every trained layer call (policy and separate critic trunk) runs again in the backward.
    assert len(ckpt_calls) == len(plain_calls) + len(grad_rows(plain_calls))


def fresh_setup(env, model_dir, name, **overrides):
    cfg = config(env, model_dir, name, num_minibatches=1, **overrides)
    setup = build(cfg, reward_fn=length_reward)
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = sample_responses(setup.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_ids=setup.eos_token_ids,
                               pad_token_id=setup.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    return cfg, setup, rollout


def score_and_update(cfg, setup, rollout):
    """Steps 2-4 of the PPO loop on a given rollout, as `tether.rl.update` runs them."""
    with autocast(cfg.mixed_precision, setup.dist.device):
        old = score_rollout(setup.policy, setup.reference, setup.critic, rollout,
                            cfg.temperature, cfg.micro_batch_rows)
    mask = rollout.response_mask
    scores = torch.tensor(length_reward(None, ["x" * int(n) for n in mask.sum(1)]))
    rewards, kl = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, mask, cfg.beta)
    advantages, returns = gae(rewards, old.values, mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, mask)
    stats = update_on(setup, rollout, old, advantages, returns, 0.0,
                      torch.Generator().manual_seed(0))
    return old, kl, advantages, stats


@pytest.mark.parametrize("knobs", [{"micro_batch_size": 2},
                                   {"micro_batch_size": 4, "gradient_checkpointing": True},
                                   {"mixed_precision": "bf16"}],
                         ids=["micro", "checkpointing", "bf16"])
def test_first_epoch_is_exactly_on_policy(env, tiny_model_dir, knobs):
    # One minibatch, one epoch: the stats are measured before the only step, on the rows
    # score_rollout scored in the same chunks, so ratio 1 and KL 0 hold exactly, not nearly.
    cfg, setup, rollout = fresh_setup(env, tiny_model_dir, "on_policy", **knobs)
    old, kl, advantages, stats = score_and_update(cfg, setup, rollout)
    assert old.logprobs.equal(old.ref_logprobs) and kl.abs().max() == 0.0
    assert stats["policy/ratio_mean"] == 1.0
    assert stats["policy/approx_kl"] == 0.0 and stats["policy/clip_frac"] == 0.0
    assert stats["policy/updates"] == 1.0
    # Checkpointing trains in train mode; the next rollout must again run in eval mode.
    assert not setup.policy.training and not setup.critic.training


def test_bf16_update_is_fp32_maths_and_close_to_the_fp32_update(env, tiny_model_dir):
    runs = {}
    for precision in ("no", "bf16"):
        cfg, setup, rollout = fresh_setup(env, tiny_model_dir, f"prec_{precision}",
                                          mixed_precision=precision)
        before = weights(setup.policy)
        for model in (setup.policy, setup.reference):  # the chunked head's one-time fp32 check
            trunk_and_head(model)
        with layer_output_dtypes() as dtypes:
            old, _, advantages, _ = score_and_update(cfg, setup, rollout)
        after = weights(setup.policy)
        runs[precision] = {k: after[k] - before[k] for k in before}, rollout, set(dtypes)
        # Log-probs, values, KL-shaped advantages: float32 whatever the autocast dtype.
        for tensor in (old.logprobs, old.ref_logprobs, old.values, old.entropy, advantages):
            assert tensor.dtype == torch.float32
    (delta32, rollout32, dtypes32), (delta16, rollout16, dtypes16) = runs["no"], runs["bf16"]
    assert rollout32.input_ids.equal(rollout16.input_ids)  # both updates see the same tokens
    assert dtypes32 == {torch.float32} and dtypes16 == {torch.bfloat16}  # autocast really on
    flat32 = torch.cat([d.flatten() for d in delta32.values()])
    flat16 = torch.cat([d.flatten() for d in delta16.values()])
    assert not flat16.equal(flat32)
    # Adam's first step is ~lr * sign(g): bf16 rounding flips the sign of a few near-zero
    # gradient entries only, so the two updates point the same way.
    cosine = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0).item()
    assert cosine > 0.95, cosine


@pytest.mark.slow
def test_bf16_end_to_end_with_reward_model_and_critic(env, tiny_llama_dir, monkeypatch):
    # Every model forward of a batch (sampling, reward model, policy, reference, critic, update)
    # runs under autocast, and the batch is still exactly on-policy at its first epoch.
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    RewardModel.from_causal_lm(str(tiny_llama_dir), tokenizer).save_pretrained(env / "rm", tokenizer)
    cfg = config(env, tiny_llama_dir, "bf16_e2e", reward_model=str(env / "rm"), num_minibatches=1,
                 micro_batch_size=4, mixed_precision="bf16", gradient_checkpointing=True)
    chunk_sizes = []

    def recording_score_rollout(*args):
        chunk_sizes.append(args[5])  # (policy, reference, critic, rollout, T, chunk_size, ...)
        return score_rollout(*args)

    # The loop scores in the first epoch's micro-batch rows (on a GPU, batch shape can change
    # the last bits of a forward, so other chunks would break the exact ratio of 1).
    monkeypatch.setattr(scoring, "score_rollout", recording_score_rollout)
    # The chunked head checks each model's split once in fp32 (tether.trunk_head._logits_match);
    # that check is not part of the batch and would show up as fp32 layer outputs here.
    monkeypatch.setattr(trunk_head, "_logits_match", lambda model, trunk, head: True)
    with layer_output_dtypes() as dtypes:
        metrics = run(cfg).metrics
    # one call per micro-batch of the first epoch's update (8 rows, micro-batches of 4), as
    # the update cuts them (tether.rl.scoring.micro_batches_of)
    assert chunk_sizes == [4, 4]
    assert set(dtypes) == {torch.bfloat16} and len(dtypes) > 0
    assert metrics["objective/kl"] == 0.0 and metrics["policy/ratio_mean"] == 1.0
    assert metrics["policy/approx_kl"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("flags, message", [
    (["--micro-batch-size", "3"], "--micro-batch-size 3 must divide the minibatch of 4 rows"),
    (["--micro-batch-size", "8"], "--micro-batch-size 8 must divide the minibatch of 4 rows"),
    (["--micro-batch-size", "-2"], "--micro-batch-size -2 must divide"),
    (["--mixed-precision", "bf16", "--dtype", "float16"], "would recast float16 weights"),
])
def test_bad_knob_values_exit_2_with_one_line(env, tiny_model_dir, capsys, flags, message):
    capsys.readouterr()
    code = main(["ppo", "--policy", str(tiny_model_dir), "--prompts", str(env / "prompts.jsonl"),
                 "--reward-fn", "x.py:f", "--run-name", "bad_knob", "--output-dir",
                 str(env / "bad_runs"), "--batch-size", "8", "--num-minibatches", "2", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error:") and "\n" not in err and message in err, err
    assert not (env / "bad_runs").exists()
