"""Every option of the online loop (tether ppo, rloo, grpo: one loop, `PPOConfig`) takes effect;
each test fails when the loop silently ignores the options it names (see test_options_effect.py
for the offline stages, tests/audit/mutate_options.py for the check).

A recording reward function sees every prompt and response; `ModelCalls` sees every forward; the
scores reach `objective/rlhf_reward` = mean(shaped score) - beta * KL, so with beta = 0 the
shaping (penalty, clip, normalisation) can be read off it exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_options_effect import ModelCalls, trunk_moves

from tether.errors import TetherError
from tether.rl import update
from tether.train import ppo
from tether.train.ppo_config import PPOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music"]


class Recorder:
    """A reward function that keeps what it was asked to score; `value(prompt, response)`."""

    def __init__(self, value=lambda p, r: len(r) / 10.0):
        self.prompts, self.responses, self.value = [], [], value

    def __call__(self, prompts, responses):
        self.prompts += list(prompts)
        self.responses += list(responses)
        return [self.value(p, r) for p, r in zip(prompts, responses, strict=True)]


def online_run(model_dir, tmp_path, name="r", reward=None, prompts=PROMPTS, **overrides):
    """One in-process run of the online loop on 4-response batches; returns (result, run dir,
    the recording reward, the metric lines)."""
    data = tmp_path / f"prompts-{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                  prompts=str(data), batch_size=4, total_episodes=4, max_new_tokens=4, lr=1e-3,
                  ppo_epochs=1, device="cpu", save_every=0, sample_every=0, report_to="none")
    values.update(overrides)
    reward = reward or Recorder()
    result = ppo.run(PPOConfig(**values), reward_fn=reward)
    run_dir = tmp_path / "runs" / values["run_name"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, run_dir, reward, lines


# ----------------------------------------------------------------------------- bookkeeping

def test_where_when_and_what_the_online_loop_writes(tiny_model_dir, tmp_path):
    # total_episodes 12 / batch_size 4 = 3 batches of 4 responses; log lines at 2 and the last;
    # checkpoints every 2 batches (and at the last); TensorBoard events only when asked
    with ModelCalls() as calls:
        _, run_dir, reward, _ = online_run(tiny_model_dir, tmp_path, name="named", total_episodes=12,
                                           batch_size=4, log_every=2, save_every=2, sample_every=1,
                                           report_to="tensorboard")
    assert run_dir == tmp_path / "runs" / "named"
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3] and len(reward.responses) == 12
    assert "step_2" in {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert max(shape[0] for shape in calls.token_inputs) == 4
    events = b"".join(p.read_bytes() for p in (run_dir / "tb").rglob("*") if p.is_file())
    assert b"samples" in events  # sample_every 1: the table of samples is written
    _, quiet, _, _ = online_run(tiny_model_dir, tmp_path, name="quiet", sample_every=1)
    assert not (quiet / "tb").exists()  # report_to none


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_online_seed_reproduces_samples_and_another_seed_differs(family, request, tmp_path):
    model_dir = request.getfixturevalue(family)
    runs = {name: online_run(model_dir, tmp_path, name=name, seed=seed, max_new_tokens=8)[2].responses
            for name, seed in (("a", 5), ("b", 5), ("c", 6))}
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


# ----------------------------------------------------------------------------- rollout

@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_rollout_options_shape_the_samples(family, request, tmp_path):
    model_dir = request.getfixturevalue(family)
    long_prompts = [" ".join(["the movie was fine and"] * 8)] * 2
    # near-greedy sampling: the 2 samples of each prompt (consecutive rows) are identical
    with ModelCalls() as calls:
        _, _, reward, lines = online_run(model_dir, tmp_path, name="greedy", prompts=long_prompts,
                                         samples_per_prompt=2, temperature=1e-4,
                                         max_new_tokens=3, max_prompt_len=6)
    assert reward.prompts[0] == reward.prompts[1] and reward.prompts[2] == reward.prompts[3]
    assert reward.responses[0] == reward.responses[1] and reward.responses[2] == reward.responses[3]
    assert lines[-1]["rollout/response_len"] <= 3
    # no forward sees more than the cut prompt (<= 6 tokens, + BOS kept) and 3 response tokens
    assert max(shape[1] for shape in calls.token_inputs) <= 6 + 1 + 3
    # at temperature 1 the samples of a prompt differ
    _, _, reward, _ = online_run(model_dir, tmp_path, name="hot", samples_per_prompt=2,
                                 max_new_tokens=8)
    assert reward.responses[0] != reward.responses[1] or reward.responses[2] != reward.responses[3]


def test_stop_strings_end_each_response(tiny_model_dir, tmp_path):
    _, _, reward, _ = online_run(tiny_model_dir, tmp_path, name="free", max_new_tokens=24, seed=1)
    assert any("e" in r[:-3] for r in reward.responses)  # unstopped, "e" occurs mid-response
    _, _, reward, _ = online_run(tiny_model_dir, tmp_path, name="stop", max_new_tokens=24, seed=1,
                                 stop_strings=["e"])
    # cut after the token that completes the stop string: at most that token follows the "e"
    assert all("e" not in r or len(r) - r.index("e") <= 4 for r in reward.responses)


# ----------------------------------------------------------------------------- shaping the score

@pytest.mark.parametrize("options, expected", [
    # rlhf_reward = mean(shaped score) with beta 0; a constant raw score of 3
    ({"missing_eos_penalty": 1.0}, lambda eos_rate: 3.0 - (1.0 - eos_rate)),
    ({"reward_clip": 0.5}, lambda eos_rate: 0.5),
    ({"score_norm": "batch"}, lambda eos_rate: 0.0),  # standardised over the batch: mean 0
])
def test_score_shaping_options(options, expected, tiny_model_dir, tmp_path):
    value = (lambda p, r: 3.0) if "score_norm" not in options else (lambda p, r: 3.0 + len(r))
    _, _, _, lines = online_run(tiny_model_dir, tmp_path, reward=Recorder(value), beta=0.0,
                                max_new_tokens=3, **options)
    assert lines[-1]["objective/rlhf_reward"] == pytest.approx(expected(lines[-1]["rollout/eos_rate"]),
                                                               abs=1e-5)


# ----------------------------------------------------------------------------- beta controllers

def test_adaptive_controller_by_hand(tiny_model_dir, tmp_path):
    # Ziegler et al. 2019: beta <- beta * (1 + clip(kl/target - 1, -e, e) * n / horizon); a KL
    # far below the target 1000 puts the error at -e = -0.5; n = 4 responses, horizon 8
    _, _, _, lines = online_run(tiny_model_dir, tmp_path, total_episodes=12, kl_ctl="adaptive",
                                beta=0.2, kl_target=1000.0, kl_horizon=8, kl_max_error=0.5)
    betas = [m["objective/beta"] for m in lines]
    for before, after, kl in zip(betas, betas[1:], [m["objective/kl"] for m in lines], strict=False):
        error = min(max(kl / 1000.0 - 1, -0.5), 0.5)
        assert after == pytest.approx(before * (1 + error * 4 / 8), rel=1e-9)
    assert betas[1] < 0.2 * 0.8  # the clip at 0.5, not the default 0.2, set the step


def test_annealed_controller_by_hand(tiny_model_dir, tmp_path):
    # cosine from 0.1 to 0.02 over 3 batches: beta_k = 0.1 + (0.02 - 0.1) * (1 - cos(pi k/3)) / 2
    _, _, _, lines = online_run(tiny_model_dir, tmp_path, total_episodes=16, kl_ctl="annealed",
                                beta=0.1, beta_end=0.02, anneal_batches=3, anneal_shape="cosine")
    expected = [0.1 + (0.02 - 0.1) * (1 - math.cos(math.pi * min(k, 3) / 3)) / 2 for k in range(4)]
    assert [m["objective/beta"] for m in lines] == pytest.approx(expected, abs=1e-12)


def test_max_kl_stops_the_run(tiny_model_dir, tmp_path):
    # batch 1 starts at the reference (KL 0); after a large step the next batches' KL (k2 >= 0,
    # 0 only where the policy equals the reference) passes 1e-6
    with pytest.raises(TetherError, match="max-kl"):
        online_run(tiny_model_dir, tmp_path, total_episodes=12, lr=1e-2, ppo_epochs=2,
                   kl_estimator="k2", max_kl=1e-6)


# ----------------------------------------------------------------------------- advantages, losses

def _spy(monkeypatch, module, name, record):
    original = getattr(module, name)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        record.append((args, kwargs, out))
        return out
    monkeypatch.setattr(module, name, spy)


def _gae_by_hand(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al. 2016), a second implementation: one sequence at a time, over its
    real tokens only, value 0 past the last one."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        real = mask[i].nonzero().flatten().tolist()
        running = 0.0
        for j, t in reversed(list(enumerate(real))):
            next_value = values[i, real[j + 1]] if j + 1 < len(real) else 0.0
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam * running
            advantages[i, t] = running
    return advantages


def test_gamma_lam_and_whitening_reach_the_advantages(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    _spy(monkeypatch, update, "estimate_advantages", calls)  # either path (one_pass or not)
    online_run(tiny_model_dir, tmp_path, name="raw", gamma=0.5, lam=0.7, whiten_advantages="off")
    (_, rewards, values, mask, _), _, (advantages, _) = calls[-1]
    torch.testing.assert_close(advantages, _gae_by_hand(rewards, values, mask, 0.5, 0.7))
    online_run(tiny_model_dir, tmp_path, name="white", whiten_advantages="on", kl_in="loss")
    (_, _, _, mask, _), _, (advantages, _) = calls[-1]
    real = advantages[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert real.std(correction=0).item() == pytest.approx(1.0, rel=1e-3)


def test_clip_ranges_and_vf_coef_reach_the_losses(tiny_model_dir, tmp_path, monkeypatch):
    policy_calls, value_calls, losses = [], [], []
    _spy(monkeypatch, update, "policy_loss", policy_calls)
    _spy(monkeypatch, update, "value_loss", value_calls)
    _spy(monkeypatch, update, "update_loss", losses)
    online_run(tiny_model_dir, tmp_path, clip_range=0.05, value_clip_range=0.3, vf_coef=0.7,
               clip_high=0.4, importance_level="sequence", policy_loss="cispo")
    # the clip, clip-higher, GSPO's sequence-level ratio, CISPO
    assert {(s.clip_range, s.clip_high, s.importance_level, s.policy_loss)
            for (*_, s), _, _ in policy_calls} == {(0.05, 0.4, "sequence", "cispo")}
    assert {args[4] for args, _, _ in value_calls} == {0.3}
    for _, _, (loss, stats) in losses:  # loss = surrogate + vf_coef * value loss (KL in reward)
        assert loss.item() == pytest.approx(stats["policy/loss"] + 0.7 * stats["value/loss"], rel=1e-5)


def test_overlong_penalty_reaches_the_scores(tiny_model_dir, tmp_path, monkeypatch):
    # DAPO's soft penalty with a window of 2 before max_new_tokens 4: a response of 3 tokens
    # loses 0.5, one of 4 loses 1; the same seed samples the same batch with and without it
    from tether.advantages import overlong_penalty

    runs = {}
    for name, window in (("plain", 0), ("penalised", 2)):
        calls = []
        _spy(monkeypatch, ppo, "update_batch", calls)
        online_run(tiny_model_dir, tmp_path, name=name, overlong_penalty=window)
        monkeypatch.undo()
        (_, _, _, rollout, scores, *_), _, _ = calls[0]
        runs[name] = (rollout.response_mask.sum(1), scores)
    lengths, plain = runs["plain"]
    assert torch.equal(lengths, runs["penalised"][0]) and int(lengths.max()) > 2
    torch.testing.assert_close(runs["penalised"][1], plain + overlong_penalty(lengths, 4, 2))


def test_loss_aggregation_and_mask_truncated_reach_the_update(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    # The surrogate is reduced as asked, over the tokens of the responses that ended only. Some
    # responses end at a stop string, the rest run out (with every response truncated the mask
    # was all False, and such a run now fails: issue 33).
    calls = []
    _spy(monkeypatch, update, "policy_loss", calls)
    online_run(tiny_model_dir, tmp_path, name="masked", loss_aggregation="sequence",
               mask_truncated=True, max_new_tokens=3, stop_strings=["e", "a"])
    (logprobs, _, _, mask, spec), _, _ = calls[0]
    assert spec.loss_aggregation == "sequence"
    update_calls = []
    monkeypatch.undo()
    _spy(monkeypatch, ppo, "update_batch", update_calls)
    online_run(tiny_model_dir, tmp_path, name="masked_again", loss_aggregation="sequence",
               mask_truncated=True, max_new_tokens=3, stop_strings=["e", "a"])
    rollout = update_calls[0][0][3]
    assert rollout.ended.any() and not rollout.ended.all()  # some ended, some ran to the limit
    torch.testing.assert_close(mask, rollout.response_mask & rollout.ended[:, None])


def test_dynamic_sampling_refills_the_batch(tiny_model_dir, tmp_path):
    # "it" scores 0 for every response: its group is all-equal, dropped and refilled.
    def reward(prompts, responses):
        return [0.0 if p == "it" else float(sum(map(ord, r)) % 97)
                for p, r in zip(prompts, responses, strict=True)]
    _, _, _, lines = online_run(tiny_model_dir, tmp_path, name="dynamic", reward=reward,
                                prompts=["it", "the movie was"], advantage="grpo",
                                samples_per_prompt=2, dynamic_sampling=2)
    assert lines[-1]["rollout/equal_groups_first"] == 0.5
    assert lines[-1]["rollout/varied_groups"] == 1.0 and lines[-1]["rollout/dynamic_rounds"] >= 1


def test_epochs_minibatches_and_micro_batches(tiny_model_dir, tmp_path):
    # 2 epochs x 2 minibatches of 2 rows = 4 optimizer steps; micro-batches of 1 row
    with ModelCalls() as calls:
        _, _, _, lines = online_run(tiny_model_dir, tmp_path, ppo_epochs=2, num_minibatches=2,
                                    micro_batch_size=1)
    assert lines[-1]["policy/updates"] == 4
    assert 1 in {shape[0] for shape in calls.token_inputs}  # the update's forwards: one row each


# ----------------------------------------------------------------------------- the demo

@pytest.mark.parametrize("quick", [False, True])
def test_demo_options_reach_the_stages_it_runs(quick, tmp_path, monkeypatch):
    """The demo's knobs become the stage configs it builds; the stages themselves are stubbed
    (each has its own tests), so this runs in a second, not minutes."""
    from tether.demo import pipeline
    from tether.run.rundir import RunResult
    from tether.train import dpo, reward, sft
    from tether.train import ppo as ppo_stage

    seen = {"sft": [], "rm": [], "ppo": [], "dpo": [], "report": []}

    def stage(name):
        def run(cfg, **_):
            seen[name].append(cfg)
            return RunResult(tmp_path / cfg.run_name)
        return run
    for module, name in ((sft, "sft"), (reward, "rm"), (dpo, "dpo"), (ppo_stage, "ppo")):
        monkeypatch.setattr(module, "run", stage(name))
    monkeypatch.setattr(pipeline, "prepare_data", lambda root, cfg: {
        k: str(tmp_path / k) for k in ("base", "sft", "pairs", "prompts", "eval_prompts")})
    monkeypatch.setattr(pipeline, "read_curve", lambda *a: None)
    monkeypatch.setattr(pipeline, "evaluate_model", lambda *a, **_: None)
    from tether.demo import report

    # (the report module's: the pipeline imports it only once its stages are done)
    monkeypatch.setattr(report, "write_report", lambda curves, root, kl_target, settings, *_: (
        seen["report"].append((root, kl_target)) or (root / "report.html", "")))
    monkeypatch.setattr(pipeline, "demo_settings", lambda *a: {})
    monkeypatch.setattr(pipeline, "plan_sweep", lambda root, c, *a: (
        seen.setdefault("sweep", []).append((c.sweep_betas, c.sweep_batches)) or None))
    from tether.demo.config import DemoConfig

    cfg = DemoConfig(output_dir=str(tmp_path / "out"), run_name="d", quick=quick, seed=11, seeds=2,
                     ppo_batches=60, ppo_lr=3e-4, fixed_beta=0.07, adaptive_start_beta=0.3,
                     kl_target=2.5, kl_horizon=99, device="cuda:1", sweep_betas=[0.0, 0.2, 0.5],
                     sweep_batches=30, jobs=1)  # in this process, where the stubs are
    pipeline.run(cfg)
    root = tmp_path / "out" / "d"
    stages = seen["sft"] + seen["rm"] + seen["dpo"] + seen["ppo"]
    assert {c.output_dir for c in stages} == {str(root)} and seen["report"] == [(root, 2.5)]
    assert {c.device for c in stages} == {"cuda:1"}
    assert seen["sft"][0].seed == 11
    seeds, batches = (1, 40) if quick else (2, 60)  # --quick: one seed, at most 40 batches
    assert sorted({c.seed for c in seen["ppo"]}) == list(range(11, 11 + seeds))
    assert len(seen["ppo"]) == 3 * seeds
    assert {c.total_episodes for c in seen["ppo"]} == {32 * batches}
    assert {c.lr for c in seen["ppo"]} == {3e-4}
    by_name = {c.run_name.split("-seed")[0]: c for c in seen["ppo"]}
    assert by_name["ppo-fixed"].beta == 0.07
    adaptive = by_name["ppo-adaptive"]
    assert (adaptive.beta, adaptive.kl_target, adaptive.kl_horizon) == (0.3, 2.5, 99)
    # --quick sweeps the two extreme betas for at most 12 batches
    assert seen["sweep"] == ([([0.0, 0.5], 12)] if quick else [([0.0, 0.2, 0.5], 30)])


# ----------------------------------------------------------------------------- critic, reward, optimiser

def test_critic_shared_is_a_head_on_the_policy(tiny_model_dir, tmp_path):
    # separate: a third trunk (policy, reference, critic) runs; shared: two
    for critic, trunks in (("separate", 3), ("shared", 2)):
        with ModelCalls() as calls:
            online_run(tiny_model_dir, tmp_path, name=critic, critic=critic)
        assert len(calls.layers) == 2 * trunks  # two layers per trunk


def test_reward_fn_given_as_file_and_function(tiny_model_dir, tmp_path):
    module = tmp_path / "constant_reward.py"
    module.write_text("def score(prompts, responses):\n    return [2.5 for _ in responses]\n")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = ppo.run(PPOConfig(run_name="fn", output_dir=str(tmp_path / "runs"), policy=str(tiny_model_dir),
                               prompts=str(data), batch_size=4, total_episodes=4, max_new_tokens=3,
                               ppo_epochs=1, device="cpu", save_every=0, sample_every=0,
                               report_to="none", reward_fn=f"{module}:score"))
    assert result.metrics["objective/score"] == 2.5


@pytest.mark.parametrize("scale", ["none", "batch"])
def test_grpo_scale_rewards_none_leaves_the_centred_rewards(scale, tiny_model_dir, tmp_path,
                                                            monkeypatch):
    # Dr. GRPO (Liu et al. 2025): A_i = R_i - mean of its group of k = 2, on its real tokens;
    # "batch": the same over the std of every reward of the batch (TRL's scale_rewards="batch")
    calls = []
    _spy(monkeypatch, update, "estimate_advantages", calls)  # either path (one_pass or not)
    online_run(tiny_model_dir, tmp_path, advantage="grpo", samples_per_prompt=2, kl_in="loss",
               scale_rewards=scale, max_new_tokens=8)
    (_, rewards, _, mask, _), _, (advantages, _) = calls[-1]
    totals = rewards.sum(dim=1).view(-1, 2)  # [prompts, k]: the score, on the last token
    expected = (totals - totals.mean(dim=1, keepdim=True)).flatten()
    if scale == "batch":
        expected = expected / (totals.std() + 1e-4)
    assert expected.abs().max() > 0
    torch.testing.assert_close(advantages, expected[:, None] * mask.float())


def _policy_moves(model_dir, run_dir):
    return trunk_moves(model_dir, run_dir / "final")  # the resized embedding (pad added) left out


def test_online_first_adamw_step_lr_warmup_decay_and_clip(tiny_model_dir, tmp_path):
    # one batch, one epoch, one minibatch: exactly one AdamW step, whose size per weight is
    # lr * |g| / (|g| + eps) ~ lr (see test_options_effect.py); warm-up 4 batches: lr / 4 on the first
    lr = 2e-3
    _, run_dir, _, _ = online_run(tiny_model_dir, tmp_path, name="plain", lr=lr, warmup_batches=4,
                                  max_grad_norm=0.0)
    moves = _policy_moves(tiny_model_dir, run_dir)
    assert max((a - b).abs().max().item() for b, a in moves.values()) == pytest.approx(lr / 4, rel=1e-2)
    # decoupled decay: the same step minus lr_t * wd * p0 on matrices, 0 on the rest
    _, decayed_dir, _, _ = online_run(tiny_model_dir, tmp_path, name="decayed", lr=lr, warmup_batches=4,
                                      max_grad_norm=0.0, weight_decay=0.5)
    for name, (before, plain) in moves.items():
        decayed = _policy_moves(tiny_model_dir, decayed_dir)[name][1]
        expected = -(lr / 4) * 0.5 * before if before.dim() >= 2 else torch.zeros_like(before)
        torch.testing.assert_close(decayed - plain, expected, atol=1e-6, rtol=0)
    # a gradient clipped to norm 1e-12 is far below Adam's eps: the step all but vanishes
    _, clipped_dir, _, _ = online_run(tiny_model_dir, tmp_path, name="clipped", lr=lr, max_grad_norm=1e-12)
    clipped = _policy_moves(tiny_model_dir, clipped_dir)
    assert max((a - b).abs().max().item() for b, a in clipped.values()) < lr * 1e-3


def test_online_lr_schedule_by_hand(tiny_model_dir, tmp_path):
    # 3 batches, cosine from the peak: lr * 0.5 * (1 + cos(pi * k / 3)) for batch k = 0, 1, 2
    _, _, _, lines = online_run(tiny_model_dir, tmp_path, lr=3e-3, lr_schedule="cosine",
                                total_episodes=12)
    expected = [3e-3 * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]
    assert [m["optim/lr"] for m in lines] == pytest.approx(expected, abs=1e-12)
