"""The online update on packed rows and under token-budget micro-batches (--pack,
--micro-batch-tokens): any cut of a batch into micro-batches, packed or padded, gives the same
optimizer step, because every loss term divides by the minibatch's counts, never a micro-batch's.

The truth is the update as it runs today: one forward per minibatch, padded (`plain`). Models run
in float64 so the comparison can be tight; the log-probs and losses go through tether's fp32 maths
after the LM head (tether.lm_head), so per-token quantities agree where fp64 inputs round to the
same fp32, and the weights, updated in fp64 from gradients summed in fp64, to 1e-12.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from refusals import refused
from update_helpers import prompt_batch

from tether.cli import main
from tether.rl.engines.native import sample_responses
from tether.rl.update import update_batch
from tether.train.ppo import PPOConfig
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music",
           "a scene", "the actor and the music were quite", "fun"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_update")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text("def length_reward(prompts, responses):\n"
                                     "    return [len(r) / 10.0 for r in responses]\n")
    return root


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def fp64_setup(env, model_dir, advantage, double: bool = True):
    cfg = PPOConfig(run_name=f"pk_{advantage}", output_dir=str(env / "runs"),
                    policy=str(model_dir), prompts=str(env / "prompts.jsonl"), batch_size=8,
                    total_episodes=8, max_new_tokens=10, lr=1e-3, device="cpu", save_every=0,
                    sample_every=0, num_minibatches=2, ppo_epochs=2, advantage=advantage,
                    samples_per_prompt=2 if advantage == "grpo" else 1, beta=0.05,
                    temperature=1.3)
    setup = build(cfg, reward_fn=length_reward)
    for model in {id(m): m for m in (setup.policy, setup.reference, setup.critic)
                  if m is not None and double}.values():
        model.double()  # parameters converted in place: the optimizer still holds them
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = sample_responses(setup.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_ids=setup.eos_token_ids,
                               pad_token_id=setup.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    return setup, rollout


def trained(setup, rollout, spec):
    """Weights after one batch's update under `spec`, from the same start; and its stats."""
    models = [m for m in (setup.policy, setup.critic) if m is not None]
    start = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    setup.optimizer.state.clear()
    scores = torch.tensor(length_reward(None, ["x" * int(n) for n in rollout.action_mask.sum(1)]))
    out = update_batch(setup.roles, setup.reference, setup.optimizer, rollout, scores, 0.05, spec,
                       torch.Generator().manual_seed(0))
    after = torch.cat([p.detach().reshape(-1).clone() for m in models for p in m.parameters()])
    for model, state in zip(models, start, strict=True):
        model.load_state_dict(state)
    return after, out


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("model, advantage", [("tiny_model_dir", "gae"),
                                              ("tiny_llama_dir", "grpo")])
def test_every_cut_packed_or_padded_gives_the_same_step(env, model, advantage, chunked, request,
                                                        monkeypatch):
    """Two epochs of two minibatches (AdamW), cut by rows (1, 2, 4), by token budgets (a few
    rows each; 1 token, so every row runs alone over it), packed or padded: the same weights.

    With the full-logits head (chunked False) every gradient is summed in fp64: all cuts agree
    to 1e-12. The chunked head (tether.lm_head) sums its weight gradient G^T h in fp32 within a
    micro-batch, so cuts of other rows agree to fp32 rounding (~1e-10 in the gradient, amplified
    by Adam's first step to ~1e-8 in the weights), while packing the same rows still agrees to
    1e-12. Prompt sharing is off: it is its own path (tether.models.forward) whose fp64
    rounding differs at ~1e-11, and packing runs without it."""
    from tether.models import forward as shared_prompt

    monkeypatch.setattr(shared_prompt, "can_share", lambda model: False)
    setup, rollout = fp64_setup(env, request.getfixturevalue(model), advantage)
    lengths = rollout.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # uneven rows, else packing changes nothing
    plain = replace(setup.spec, micro_rows=4, chunked_lm_head=chunked)  # one padded forward
    base, base_out = trained(setup, rollout, plain)
    start = torch.cat([p.detach().reshape(-1) for m in (setup.policy, setup.critic)
                       if m is not None for p in m.parameters()])
    assert float((base - start).abs().max()) > 1e-4  # the step moved the weights
    budget = int(lengths.max()) + 3  # a few rows per micro-batch
    cuts = {"packed": dict(pack=True), "rows_1": dict(micro_rows=1),
            "rows_2": dict(micro_rows=2), "packed_rows_1": dict(pack=True, micro_rows=1),
            "tokens": dict(micro_batch_tokens=budget),
            "tokens_packed": dict(micro_batch_tokens=budget, pack=True),
            "tokens_1": dict(micro_batch_tokens=1, pack=True)}
    for name, change in cuts.items():
        after, out = trained(setup, rollout, replace(plain, **change))
        same_rows = name == "packed"
        tolerance = 1e-12 if not chunked or same_rows else 1e-6
        torch.testing.assert_close(after, base, rtol=0, atol=tolerance, msg=name)
        # pi_old and the advantages do not depend on the cut (fp32 after the head)
        torch.testing.assert_close(out.old.logprobs, base_out.old.logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(out.advantages, base_out.advantages, rtol=0, atol=1e-5)
        for key in ("policy/loss", "policy/approx_kl", "policy/grad_norm"):
            assert out.stats[key] == pytest.approx(base_out.stats[key], rel=1e-5, abs=1e-9), name
        assert out.stats["policy/updates"] == 4.0


@pytest.mark.parametrize("pack", [False, True])
def test_first_step_is_exactly_on_policy_under_a_token_budget(env, tiny_model_dir, pack):
    """The scoring pass cuts each minibatch as the first epoch's update does (same rows, same
    order, same packing), so before the first step the ratio is exactly 1 and approx KL 0. In
    float32, where another grouping of the rows would round differently."""
    setup, rollout = fp64_setup(env, tiny_model_dir, "gae", double=False)
    budget = int(rollout.attention_mask.sum(1).max()) + 5
    spec = replace(setup.spec, ppo_epochs=1, num_minibatches=1, minibatch_size=8, micro_rows=8,
                   micro_batch_tokens=budget, pack=pack)
    _, out = trained(setup, rollout, spec)
    assert out.stats["policy/ratio_mean"] == 1.0 and out.stats["policy/approx_kl"] == 0.0
    assert out.stats["policy/updates"] == 1.0


def test_token_budget_micro_batches_are_the_forwards(env, tiny_model_dir, monkeypatch):
    """The knob acts: with --micro-batch-tokens each trained forward holds at most the budget's
    tokens (or one longer row), and with --pack it is one row of exactly those tokens."""
    from tether.rl import scoring

    setup, rollout = fp64_setup(env, tiny_model_dir, "gae")
    seen = []
    original = scoring.policy_and_values

    def recording(policy, critic, rollout, *args, **kwargs):
        seen.append((int(rollout.attention_mask.sum()), len(rollout), kwargs.get("packed")))
        return original(policy, critic, rollout, *args, **kwargs)
    monkeypatch.setattr(scoring, "policy_and_values", recording)
    budget = 30
    trained(setup, rollout, replace(setup.spec, micro_rows=4, micro_batch_tokens=budget, pack=True))
    longest = int(rollout.attention_mask.sum(1).max())
    assert seen and all(packed for _, _, packed in seen)
    assert all(tokens <= max(budget, longest) for tokens, _, _ in seen)
    assert any(rows > 1 for _, rows, _ in seen)  # rows were grouped, not one per forward


# ----------------------------------------------------------------------------- the CLI

def test_grpo_cli_with_pack_and_token_budget(env, tiny_llama_dir, capsys, monkeypatch):
    """Both options reach the update through the config: every update forward is packed, and a
    minibatch of 2 prompts x 2 samples runs as more than one micro-batch (a budget of 24 tokens
    holds at most a row or two of ~10-token prompts and 6-token responses)."""
    from tether.rl import scoring

    calls = []
    original = scoring.update_forward

    def recording(policy, critic, reference, sub, chunked, exact, keep_hidden, packed=False):
        calls.append((len(sub), packed))
        return original(policy, critic, reference, sub, chunked, exact, keep_hidden, packed)
    monkeypatch.setattr(scoring, "update_forward", recording)
    code = main(["grpo", "--policy", str(tiny_llama_dir), "--prompts", str(env / "prompts.jsonl"),
                 "--output-dir", str(env / "runs"), "--run-name", "cli_pack",
                 "--reward-fn", f"{env / 'rewards.py'}:length_reward", "--batch-size", "4",
                 "--samples-per-prompt", "2", "--total-episodes", "8", "--max-new-tokens", "6",
                 "--device", "cpu", "--save-every", "0", "--sample-every", "0", "--pack",
                 "--micro-batch-tokens", "24", "--ppo-epochs", "2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    metrics = [json.loads(line) for line in
               (env / "runs" / "cli_pack" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all("policy/loss" in m for m in metrics)
    assert calls and all(packed for _, packed in calls)
    # 2 batches x 2 epochs x 1 minibatch: more forwards than that, none of all 4 rows
    assert len(calls) > 4 and max(rows for rows, _ in calls) < 4


@pytest.mark.parametrize("flags, pattern", [
    (["--micro-batch-tokens", "-5"], "micro_batch_tokens' must be >= 0"),
    (["--micro-batch-tokens", "64", "--micro-batch-size", "2"], "pass one of them"),
])
def test_bad_packing_options_are_refused(env, tiny_model_dir, flags, pattern, capsys):
    refused(env, ["grpo", "--policy", str(tiny_model_dir), "--prompts",
                  str(env / "prompts.jsonl"), "--output-dir", str(env / "runs"),
                  "--run-name", "bad", "--batch-size", "4", "--samples-per-prompt", "2",
                  *flags], pattern, capsys)


def test_lora_roles_and_the_exact_kl_run_packed(env, tiny_llama_dir):
    """With LoRA every role is a view of one shared model (no parameters of its own, a fresh
    trunk module per call) and the exact KL scores the reference packed too: the first batch's
    losses and KL equal the padded run's (float32: to rounding)."""
    metrics = {}
    for name, pack in (("lora_padded", []), ("lora_packed", ["--pack"])):
        code = main(["grpo", "--policy", str(tiny_llama_dir), "--prompts",
                     str(env / "prompts.jsonl"), "--output-dir", str(env / "runs"),
                     "--run-name", name, "--reward-fn", f"{env / 'rewards.py'}:length_reward",
                     "--batch-size", "4", "--samples-per-prompt", "2", "--total-episodes", "4",
                     "--max-new-tokens", "6", "--device", "cpu", "--save-every", "0",
                     "--sample-every", "0", "--lora-r", "4", "--kl-in", "loss",
                     "--kl-estimator", "exact", "--beta", "0.5", "--ppo-epochs", "2", *pack])
        assert code == 0
        lines = (env / "runs" / name / "metrics.jsonl").read_text().splitlines()
        metrics[name] = json.loads(lines[0])
    padded, packed = metrics["lora_padded"], metrics["lora_packed"]
    for key in ("policy/loss", "objective/kl_loss", "policy/grad_norm", "objective/kl_k1"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("model, advantage", [("tiny_model_dir", "gae"),
                                              ("tiny_llama_dir", "grpo")])
def test_one_pass_packed_equals_one_pass_padded(env, model, advantage, request, monkeypatch):
    """One epoch, one minibatch, one micro-batch: the update's own forward also scores pi_old
    (`one_pass`), packed as padded; the same weights to 1e-12 (float64, full-logits head) and the
    same pi_old."""
    from tether.models import forward as shared_prompt
    from tether.rl import update

    monkeypatch.setattr(shared_prompt, "can_share", lambda model: False)
    setup, rollout = fp64_setup(env, request.getfixturevalue(model), advantage)
    spec = replace(setup.spec, ppo_epochs=1, num_minibatches=1, minibatch_size=8, micro_rows=8,
                   chunked_lm_head=False)
    assert update.one_pass(spec, len(rollout), setup.roles.dist)
    base, base_out = trained(setup, rollout, spec)
    after, out = trained(setup, rollout, replace(spec, pack=True))
    torch.testing.assert_close(after, base, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.old.logprobs, base_out.old.logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.old.entropy, base_out.old.entropy, rtol=0, atol=1e-6)
    assert out.stats["policy/ratio_mean"] == 1.0


def test_token_budget_cut_over_two_ranks_by_hand():
    """The cut each rank of 2 runs (`micro_batches_of`): rows dealt for even token sums, as many
    micro-batches on both ranks, an empty turn a borrowed row marked not real. Lengths 10 3 3 3,
    budget 1 (every row alone): LPT gives rank 0 row 0 (10) and rank 1 rows 1-3 (3 + 3 + 3 = 9),
    so rank 0 runs its row and then the borrowed row twice."""
    from tether.rl.rollout import Rollout
    from tether.rl.scoring import micro_batches_of
    from tether.rl.update import UpdateSpec
    from tether.run.distributed import Dist

    attention = torch.zeros(4, 12, dtype=torch.long)
    for row, length in enumerate([10, 3, 3, 3]):
        attention[row, 12 - length:] = 1
    rollout = Rollout(torch.zeros(4, 12, dtype=torch.long), attention,
                      torch.ones(4, 2, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 10)
    index = torch.tensor([4, 5, 6, 7]) - 4  # the minibatch's global rows
    spec = UpdateSpec(micro_batch_tokens=1)
    cuts = [[(rows.tolist(), real) for rows, real in
             micro_batches_of(rollout, index, spec, Dist(rank=r, world_size=2))] for r in (0, 1)]
    assert cuts == [[([0], True), ([0], False), ([0], False)],
                    [([1], True), ([2], True), ([3], True)]]
    # a budget of 6 lets rank 1 take rows 1 and 2 together: 2 micro-batches; rank 0 borrows one
    spec = UpdateSpec(micro_batch_tokens=6)
    cuts = [[(rows.tolist(), real) for rows, real in
             micro_batches_of(rollout, index, spec, Dist(rank=r, world_size=2))] for r in (0, 1)]
    assert cuts == [[([0], True), ([0], False)], [([1, 2], True), ([3], True)]]


def test_uneven_shares_of_rows_over_two_ranks_by_hand():
    """A minibatch of 5 rows (episodes split into segments) over 2 ranks in micro-batches of 1
    row: rank 0 takes rows 0-1, rank 1 rows 2-4, and rank 0 runs a borrowed row marked not real,
    so both call the model 3 times (FSDP2 hangs otherwise)."""
    from tether.rl.rollout import Rollout
    from tether.rl.scoring import micro_batches_of
    from tether.rl.update import UpdateSpec
    from tether.run.distributed import Dist

    rollout = Rollout(torch.zeros(5, 4, dtype=torch.long), torch.ones(5, 4, dtype=torch.long),
                      torch.ones(5, 2, dtype=torch.bool), torch.ones(5, dtype=torch.bool), 2)
    spec = UpdateSpec(micro_rows=1)
    cuts = [[(rows.tolist(), real) for rows, real in
             micro_batches_of(rollout, torch.arange(5), spec, Dist(rank=r, world_size=2))]
            for r in (0, 1)]
    assert cuts == [[([0], True), ([1], True), ([0], False)],
                    [([2], True), ([3], True), ([4], True)]]
