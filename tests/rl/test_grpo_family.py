"""The GRPO family's batch-level options on real tiny models: --mask-truncated (DAPO's overlong
filtering) checked against the loss on the batch without the truncated rows, --loss-aggregation
through the update path, and --dynamic-sampling (DAPO) both in `collect` on hand-made rounds and
end to end. The formulas themselves are in tests/test_losses.py and tests/test_critic_free.py."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from update_helpers import loss_batch, loss_on, prompt_batch, update_on

from tether.rl.dynamic_sampling import Drawn, collect
from tether.rl.engines.native import sample_responses
from tether.rl.rollout import Rollout, concat_rollouts
from tether.rl.scoring import score_rollout
from tether.train import ppo
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_family") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def config(model_dir, prompts_file, name="family", **overrides) -> PPOConfig:
    values = dict(run_name=name, output_dir=str(prompts_file.parent / "runs"),
                  policy=str(model_dir), prompts=str(prompts_file), batch_size=8,
                  samples_per_prompt=2, total_episodes=8, max_new_tokens=5, lr=1e-3,
                  ppo_epochs=1, advantage="grpo", kl_in="loss", beta=0.5, device="cpu",
                  save_every=0, sample_every=0, report_to="none")
    values.update(overrides)
    return PPOConfig(**values)


def scored_batch(setup, cfg):
    """A sampled batch with rows 1, 4 and 5 marked truncated, its pi_old scores with a reference
    0.3 nats below on every real token (so the KL term is not 0), and seeded advantages."""
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = sample_responses(setup.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=1.0, eos_token_ids=setup.eos_token_ids,
                               pad_token_id=setup.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    ended = torch.ones(len(rollout), dtype=torch.bool)
    ended[[1, 4, 5]] = False
    rollout = replace(rollout, ended=ended)
    old = score_rollout(setup.policy, setup.reference, setup.critic, rollout, 1.0, len(rollout))
    old = old._replace(ref_logprobs=old.logprobs - 0.3 * rollout.response_mask)
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(rollout.response_mask.shape, generator=gen) * rollout.response_mask
    return rollout, old, advantages


def loss_and_grads(setup, rollout, old, advantages, spec):
    setup.policy.zero_grad(set_to_none=True)
    loss, stats = loss_on(setup, rollout, old, advantages, advantages, 0.5, spec)
    loss.backward()
    grads = [p.grad.clone() for p in setup.policy.parameters() if p.grad is not None]
    return loss.detach(), stats, grads


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("aggregation", ["token", "sequence", "sum"])
def test_mask_truncated_equals_the_batch_without_the_truncated_rows(family, aggregation,
                                                                     prompts_file, request):
    # Independent truth: the same loss on only the rows that ended, with nothing masked. The
    # truncated rows must be out of the surrogate, the KL term and every denominator.
    cfg = config(request.getfixturevalue(family), prompts_file, loss_aggregation=aggregation)
    setup = build(cfg, reward_fn=length_reward)
    rollout, old, advantages = scored_batch(setup, cfg)
    masked = replace(setup.spec, mask_truncated=True)
    loss, stats, grads = loss_and_grads(setup, rollout, old, advantages, masked)
    kept = rollout.ended.nonzero().flatten()
    expected, expected_stats, expected_grads = loss_and_grads(
        setup, rollout.select(kept), old._make(t[kept] for t in old), advantages[kept], setup.spec)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    assert stats["objective/kl_loss"] == pytest.approx(expected_stats["objective/kl_loss"],
                                                       rel=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # and it is not the unmasked loss
    unmasked, _, _ = loss_and_grads(setup, rollout, old, advantages, setup.spec)
    assert abs(float(unmasked) - float(loss)) > 1e-4


def test_mask_truncated_keeps_the_value_loss_on_every_row(tiny_model_dir, prompts_file):
    cfg = config(tiny_model_dir, prompts_file, advantage="gae", samples_per_prompt=1,
                 kl_in="reward", beta=0.05)
    setup = build(cfg, reward_fn=length_reward)
    rollout, old, advantages = scored_batch(setup, cfg)
    returns = torch.randn(advantages.shape, generator=torch.Generator().manual_seed(3))
    args = (setup, rollout, old, advantages, returns, 0.0)
    _, masked = loss_on(*args, replace(setup.spec, mask_truncated=True))
    _, plain = loss_on(*args, setup.spec)
    assert masked["value/loss"] == pytest.approx(plain["value/loss"], rel=1e-6)
    assert masked["policy/loss"] != pytest.approx(plain["policy/loss"], rel=1e-3)


def test_a_minibatch_of_only_truncated_rows_takes_no_step(tiny_model_dir, prompts_file):
    # No loss, and an AdamW step on a zero gradient would still move the weights.
    cfg = config(tiny_model_dir, prompts_file, num_minibatches=2)
    setup = build(cfg, reward_fn=length_reward)
    rollout, old, advantages = scored_batch(setup, cfg)
    rollout = replace(rollout, ended=torch.tensor([False] * 4 + [True] * 4))
    spec = replace(setup.spec, mask_truncated=True)
    before = [p.detach().clone() for p in setup.policy.parameters()]
    # a step on the second minibatch alone moves the weights; the first is skipped
    stats = update_on(setup, rollout, old, advantages, advantages, 0.5,
                      torch.Generator().manual_seed(0), spec)
    assert stats["policy/updates"] == 1.0 and stats["policy/skipped_minibatches"] == 1.0
    moved = [not a.equal(b) for a, b in zip(before, setup.policy.parameters(), strict=True)]
    assert any(moved)
    everything_cut = replace(rollout, ended=torch.zeros(8, dtype=torch.bool))
    before = [p.detach().clone() for p in setup.policy.parameters()]
    stats = update_on(setup, everything_cut, old, advantages, advantages, 0.5,
                      torch.Generator().manual_seed(0), spec)
    assert stats["policy/updates"] == 0.0 and stats["policy/skipped_minibatches"] == 2.0
    assert all(a.equal(b) for a, b in zip(before, setup.policy.parameters(), strict=True))


# ----------------------------------------------------------------------------- dynamic sampling

def hand_rollout(context: int, width: int, rows: int, fill: int) -> Rollout:
    ids = torch.full((rows, context + width), fill, dtype=torch.long)
    return Rollout(ids, torch.ones_like(ids), torch.ones(rows, width, dtype=torch.bool),
                   torch.ones(rows, dtype=torch.bool), context)


def hand_round(number: int, scores: list[float], context: int, width: int) -> Drawn:
    prompts = [f"r{number}g{i // 2}" for i in range(len(scores))]
    s = torch.tensor(scores)
    return Drawn(prompts, hand_rollout(context, width, len(scores), 10 + number), s * 10, s)


def test_collect_keeps_varied_groups_and_refills_in_order():
    # Groups of 2. Round 0: g0 equal, g1 varied, g2 equal. Round 1: g0 varied, g1 varied.
    rounds = {0: hand_round(0, [1, 1, 0, 1, 0, 0], 3, 2), 1: hand_round(1, [0, 1, 1, 0, 1, 1], 5, 4)}
    calls = []

    def draw(j):
        calls.append(j)
        return rounds[j]
    batch, stats = collect(draw, 2, 3, pad_token_id=0)
    assert calls == [0, 1]  # round 1 filled the batch: no round 2
    assert batch.prompts == ["r0g1", "r0g1", "r1g0", "r1g0", "r1g1", "r1g1"]
    assert batch.scores.tolist() == [0, 1, 0, 1, 1, 0]
    assert batch.raw_scores.tolist() == [0, 10, 0, 10, 10, 0]
    assert stats == {"rollout/dynamic_rounds": 1.0, "rollout/varied_groups": 1.0,
                     "rollout/equal_groups_first": pytest.approx(2 / 3)}
    # round 0's rows were padded to round 1's widths: 2 more prompt columns on the left, 2 more
    # response columns on the right, all masked
    r = batch.rollout
    assert r.context_length == 5 and r.responses.shape[1] == 4
    assert r.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert r.response_mask[0].tolist() == [True, True, False, False]
    assert r.input_ids[0].tolist() == [0, 0, 10, 10, 10, 10, 10, 0, 0]


def test_collect_tops_a_short_batch_up_with_dropped_groups():
    # Every round all-equal but one group: after the last allowed round the batch is short and
    # takes round 0's dropped groups, in order.
    rounds = {0: hand_round(0, [1, 1, 0, 0, 2, 3], 3, 2), 1: hand_round(1, [1, 1, 1, 1, 0, 0], 3, 2)}
    batch, stats = collect(lambda j: rounds[j], 2, 1, pad_token_id=0)
    assert batch.prompts == ["r0g2", "r0g2", "r0g0", "r0g0", "r0g1", "r0g1"]
    assert stats["rollout/dynamic_rounds"] == 1.0
    assert stats["rollout/varied_groups"] == pytest.approx(1 / 3)


def test_concatenated_rollouts_score_as_they_did_alone(tiny_llama_dir, prompts_file):
    # Rotary positions count real tokens only, so the extra left padding changes nothing.
    cfg = config(tiny_llama_dir, prompts_file)
    setup = build(cfg, reward_fn=length_reward)
    parts = []
    for batch, new_tokens in ((0, 3), (1, 5)):
        _, ids, mask = prompt_batch(setup, cfg, batch)
        parts.append(sample_responses(setup.policy, ids[:4], mask[:4], max_new_tokens=new_tokens,
                                      temperature=1.0, eos_token_ids=setup.eos_token_ids,
                                      pad_token_id=setup.tokenizer.pad_token_id,
                                      generator=torch.Generator().manual_seed(batch)))
    joined = concat_rollouts(parts, setup.tokenizer.pad_token_id)
    alone = [score_rollout(setup.policy, setup.reference, None, r, 1.0, 4) for r in parts]
    together = score_rollout(setup.policy, setup.reference, None, joined, 1.0, 8)
    for i, (part, scored) in enumerate(zip(parts, alone, strict=True)):
        width = part.responses.shape[1]
        rows = slice(4 * i, 4 * i + 4)
        torch.testing.assert_close(together.logprobs[rows, :width] * part.response_mask,
                                   scored.logprobs * part.response_mask, rtol=1e-5, atol=1e-6)
        assert not together.logprobs[rows, width:].any()


def prompt_keyed_reward(prompts, responses):
    """0 for every response to "it" (an all-equal group), a spread of values otherwise."""
    return [0.0 if p == "it" else float(sum(map(ord, r)) % 97) for p, r in zip(prompts, responses)]


def test_dynamic_sampling_end_to_end(tiny_model_dir, prompts_file):
    def metrics(name, **overrides):
        cfg = config(tiny_model_dir, prompts_file, name=name, total_episodes=16, **overrides)
        ppo.run(cfg, reward_fn=prompt_keyed_reward)
        path = prompts_file.parent / "runs" / name / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]
    on = metrics("dynamic", dynamic_sampling=3)
    again = metrics("dynamic_again", dynamic_sampling=3)
    off = metrics("static")
    # Each batch of 4 prompts x 2 holds "it" (all four prompts are drawn per epoch): its group is
    # all-equal, so round 0 always has one equal group of 4, and the refill replaces it.
    assert [m["rollout/equal_groups_first"] for m in on] == [0.25, 0.25]
    assert all(m["rollout/varied_groups"] == 1.0 and m["rollout/dynamic_rounds"] >= 1 for m in on)
    assert [m["objective/score"] for m in on] == [m["objective/score"] for m in again]
    assert "rollout/varied_groups" not in off[0]
    assert on[0]["objective/score"] != off[0]["objective/score"]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_mask_truncated_against_trls_documented_formula(aggregation):
    # TRL 1.16, mask_truncated_completions=True: completion_mask *= ~is_truncated, then
    #   loss_type="dapo": sum(per_token_loss * mask) / sum(mask) (num_items_in_batch is counted
    #   after the masking): tether's "token", equal;
    #   loss_type="grpo": mean over ALL rows of sum_t(per_token_loss * mask) / clamp(sum_t mask, 1):
    #   a truncated row adds 0 but still counts; tether leaves it out of the count, so TRL's loss
    #   is tether's times (kept rows / rows) (docs/from_trl.md).
    from tether.losses import ppo_policy_loss
    from tether.rl.update import counts_of

    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    ended = torch.tensor([True, False, True, False])  # rows 1 and 3 ran to the limit
    rollout = Rollout(torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long), mask,
                      ended, 2)
    logprobs = (-torch.rand(4, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.2 * torch.randn(4, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 4)
    zeros = torch.zeros(4, 4)
    batch = loss_batch(rollout, SimpleNamespace(logprobs=zeros, ref_logprobs=zeros,
                                                values=zeros), zeros, zeros, mask_truncated=True)
    carrying, counts = batch.loss_mask, counts_of(batch, mask_truncated=True)
    assert counts.tokens == 3 + 2 and counts.rows == 2 and counts.value_tokens == 3 + 4 + 2 + 4
    ours, _ = ppo_policy_loss(logprobs, old, adv, carrying, 0.2, aggregation=aggregation,
                              denominator=counts.tokens if aggregation == "token" else counts.rows)
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    trl_mask = mask * ended[:, None]  # completion_mask * (~is_truncated)
    if aggregation == "token":
        theirs = (per_token * trl_mask).sum() / trl_mask.sum()
        factor = 1.0
    else:
        theirs = ((per_token * trl_mask).sum(-1) / trl_mask.sum(-1).clamp(min=1.0)).mean()
        factor = 2 / 4  # kept rows / rows
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    assert theirs.item() == pytest.approx(factor * ours.item(), rel=1e-12)
    torch.testing.assert_close(grad_theirs, factor * grad_ours, rtol=1e-12, atol=1e-15)
