"""Tokens outside `action_mask` (an environment's observation between turns) reach neither the
loss nor any gradient, whatever the model computes there: NaN or huge values at those positions,
in the logits (the plain path, full logits) or in the final hidden states (the chunked LM head,
which never sends those positions through the head), leave the loss and every parameter's
gradient bit for bit what they are without them, on GPT-2 and Llama."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from update_helpers import loss_on, prompt_batch

from tether.rl.scoring import score_batch
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
HOLE = [2, 3, 4]  # response positions the policy did not sample, in rows 0 and 2


def reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def setup_for(model_dir, tmp_path, chunked: bool):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = PPOConfig(run_name="holes", output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                    prompts=str(prompts), batch_size=4, total_episodes=4, max_new_tokens=8,
                    device="cpu", save_every=0, sample_every=0, kl_in="loss", beta=0.5,
                    critic="shared", chunked_lm_head=chunked)
    setup = build(cfg, reward_fn=reward)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the reference, so every term of the loss is non-zero
        for p in [*setup.policy.parameters(), *setup.critic.parameters()]:
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = setup.engine.sample(ids, mask, max_new_tokens=8, temperature=1.0,
                                  eos_token_ids=[-1], pad_token_id=setup.tokenizer.pad_token_id,
                                  generator=torch.Generator().manual_seed(0))
    action = rollout.action_mask.clone()
    action[[0, 2]] = action[[0, 2]].index_fill(1, torch.tensor(HOLE), False)
    return setup, replace(rollout, action_mask=action)


def loss_and_grads(setup, rollout, old, advantages):
    setup.policy.zero_grad(set_to_none=True)
    setup.critic.zero_grad(set_to_none=True)
    loss, _ = loss_on(setup, rollout, old, advantages, advantages, 0.5)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in [*setup.policy.named_parameters(),
                                             *setup.critic.named_parameters()]
             if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-head", "full-logits"])
@pytest.mark.parametrize("poison", [float("nan"), 1e30])
def test_masked_positions_reach_no_loss_and_no_gradient(family, chunked, poison, tmp_path,
                                                        request):
    setup, rollout = setup_for(request.getfixturevalue(family), tmp_path, chunked)
    old = score_batch(setup.roles, setup.reference, rollout, setup.spec)
    advantages = torch.randn(rollout.action_mask.shape,
                             generator=torch.Generator().manual_seed(2)) * rollout.action_mask
    clean_loss, clean = loss_and_grads(setup, rollout, old, advantages)
    P = rollout.context_length
    lm = setup.lm.model

    def poisoned_logits(module, inputs, logits):  # [B, R + 1, V]: position t predicts token t
        logits = logits.clone()
        for row in (0, 2):
            logits[row, HOLE] = poison
        return logits

    def poisoned_hidden(module, inputs, out):  # [B, P + R, d]: position P - 1 + t
        hidden = out.last_hidden_state.clone()
        for row in (0, 2):
            hidden[row, [P - 1 + t for t in HOLE]] = poison
        out.last_hidden_state = hidden
        return out
    hook = (lm.get_output_embeddings().register_forward_hook(poisoned_logits) if not chunked
            else lm.base_model.register_forward_hook(poisoned_hidden))
    try:
        loss, grads = loss_and_grads(setup, rollout, old, advantages)
    finally:
        hook.remove()
    assert torch.isfinite(clean_loss) and torch.equal(loss, clean_loss)
    assert grads.keys() == clean.keys() and len(grads) > 0
    for name in grads:
        assert torch.equal(grads[name], clean[name]), name
