"""PPO stage: on-policy invariants, the KL-as-loss term, the trust-region guard, resume, the CLI,
the reward-model path, and bad input. (The KL-regularised optimum is in test_ppo_optimum.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from update_helpers import loss_on, prompt_batch, update_on

from tether.advantages import ScoreNormalizer, kl_shaped_rewards
from tether.cli import main
from tether.data.prompts import prompt_indices
from tether.errors import TetherError
from tether.models import pretrained
from tether.models.critic import ValueModel
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.tiny import save_tiny
from tether.rl.engines.native import sample_responses
from tether.rl.scoring import score_rollout
from tether.run.parse import parse_config
from tether.train.ppo import PPOConfig, run
from tether.train.ppo_setup import build

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music"]

REWARD_MODULE = '''
def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]

def gold(prompts, responses):
    return [float(r.count("good")) for r in responses]
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARD_MODULE)
    return root


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def config(env, model_dir, name, **overrides) -> PPOConfig:
    values = dict(run_name=name, output_dir=str(env / "runs"), policy=str(model_dir),
                  prompts=str(env / "prompts.jsonl"), batch_size=8, total_episodes=16,
                  max_new_tokens=6, lr=1e-3, device="cpu", save_every=0, sample_every=0)
    values.update(overrides)
    return PPOConfig(**values)


def fresh_rollout(setup, cfg):
    _, ids, mask = prompt_batch(setup, cfg, 0)
    return sample_responses(setup.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, eos_token_ids=setup.eos_token_ids,
                            pad_token_id=setup.tokenizer.pad_token_id,
                            generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_fresh_rollout_ratio_exactly_one_and_kl_zero(env, family, critic, request):
    cfg = config(env, request.getfixturevalue(family), f"fresh_{critic}_{family}", critic=critic,
                 num_minibatches=2, temperature=0.7)
    setup = build(cfg, reward_fn=length_reward)
    # The reference is a frozen copy: no shared tensor, no gradient, dropout off.
    policy_ptrs = {p.data_ptr() for p in setup.policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in setup.reference.parameters()}
    assert not any(p.requires_grad for p in setup.reference.parameters())
    rollout = fresh_rollout(setup, cfg)
    old = score_rollout(setup.policy, setup.reference, setup.critic, rollout, cfg.temperature, 4)
    # Before any update policy and reference are the same function: equal log-probs, KL 0.
    assert old.logprobs.equal(old.ref_logprobs)
    _, kl = kl_shaped_rewards(torch.zeros(8), old.logprobs, old.ref_logprobs,
                              rollout.response_mask, 0.1)
    assert kl.abs().max() == 0.0
    advantages = torch.randn(rollout.response_mask.shape) * rollout.response_mask
    for rows in (slice(0, 4), slice(4, 8)):  # each first-epoch minibatch, before any step
        _, stats = loss_on(setup, rollout.select(rows), old._make(t[rows] for t in old),
                           advantages[rows], advantages[rows], 0.0)
        assert stats["policy/ratio_mean"] == 1.0  # exactly, not approximately
        assert stats["policy/approx_kl"] == 0.0
        assert stats["policy/clip_frac"] == 0.0
    ref_before = [p.clone() for p in setup.reference.parameters()]
    update_on(setup, rollout, old, advantages, advantages, 0.0, torch.Generator().manual_seed(0))
    assert all(a.equal(b) for a, b in zip(ref_before, setup.reference.parameters(), strict=True))
    assert not all(a.equal(b) for a, b in zip(ref_before, setup.policy.parameters(), strict=True))


@pytest.mark.parametrize("estimator, per_token_mean", [("k3", True), ("auto", False)])
def test_kl_as_loss_adds_beta_times_the_kl_term(env, tiny_model_dir, estimator, per_token_mean):
    cfg = config(env, tiny_model_dir, f"kl_loss_{estimator}", kl_in="loss",
                 kl_estimator=estimator, kl_per_token_mean=per_token_mean)
    assert cfg.resolved_kl_estimator == ("k3" if estimator == "k3" else "k3_ratio")
    setup = build(cfg, reward_fn=length_reward)
    rollout = fresh_rollout(setup, cfg)
    old = score_rollout(setup.policy, setup.reference, setup.critic, rollout, cfg.temperature, 8)
    # Pretend the reference gives every real token 0.3 nats less: d = log pi - log ref = 0.3 on
    # every real token, so k3 = exp(-0.3) - 1 + 0.3 = 0.0408182 on each; on-policy the ratio is
    # exactly 1, so k3 x ratio is the same number.
    old = old._replace(ref_logprobs=old.logprobs - 0.3 * rollout.response_mask)
    advantages = torch.randn(rollout.response_mask.shape) * rollout.response_mask
    args = (setup, rollout, old, advantages, advantages)
    loss_without, _ = loss_on(*args, 0.0)
    loss_with, stats = loss_on(*args, 2.0)
    k3 = math.exp(-0.3) - 1 + 0.3
    # Token mean: k3 itself. Per-sequence sums averaged over sequences: k3 times the mean length.
    length = float(rollout.response_mask.sum()) / len(rollout)
    expected = k3 if per_token_mean else k3 * length
    assert stats["objective/kl_loss"] == pytest.approx(expected, rel=1e-5)
    assert (loss_with - loss_without).item() == pytest.approx(2.0 * expected, rel=1e-4)


def test_trust_region_guard_stops_epochs(env, tiny_model_dir):
    results = {}
    for target in (0.0, 1e-12):
        cfg = config(env, tiny_model_dir, f"guard_{target}", ppo_epochs=4, lr=1e-2,
                     target_kl=target)
        setup = build(cfg, reward_fn=length_reward)
        rollout = fresh_rollout(setup, cfg)
        old = score_rollout(setup.policy, setup.reference, setup.critic, rollout, 1.0, 8)
        adv = torch.randn(rollout.response_mask.shape) * rollout.response_mask
        stats = update_on(setup, rollout, old, adv, adv, 0.0, torch.Generator().manual_seed(0))
        results[target] = (stats["policy/updates"], stats["policy/early_stopped"])
    # One minibatch per epoch. Epoch 1 is on-policy (approx KL exactly 0), so its step is taken;
    # at epoch 2 the KL to the rollout policy is positive, past 1e-12: no further step.
    assert results == {0.0: (4.0, 0.0), 1e-12: (1.0, 1.0)}


def test_resume_matches_uninterrupted_run(env, tiny_model_dir):
    # Adaptive beta with a short horizon, running score normalisation and 2 minibatches: every
    # piece of state must come back for the resumed run to be bit-identical.
    common = dict(total_episodes=32, save_every=1, kl_ctl="adaptive", kl_target=0.01,
                  kl_horizon=16, beta=0.1, score_norm="running", num_minibatches=2)
    full = run(config(env, tiny_model_dir, "uninterrupted", **common), reward_fn=length_reward)

    calls = {"n": 0}

    def crashes_on_third_batch(prompts, responses):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("reward server went away")
        return length_reward(prompts, responses)

    with pytest.raises(TetherError, match="reward server went away"):
        run(config(env, tiny_model_dir, "resumed", **common), reward_fn=crashes_on_third_batch)
    ckpts = sorted(p.name for p in (env / "runs" / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step_1", "step_2"]  # nothing lost
    resumed = run(config(env, tiny_model_dir, "resumed", resume=True, **common),
                  reward_fn=length_reward)
    a = load_file(str(full.output_path / "model.safetensors"))
    b = load_file(str(resumed.output_path / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert resumed.metrics["objective/beta_final"] == full.metrics["objective/beta_final"]
    assert full.metrics["objective/beta_final"] != 0.1  # the controller did move beta
    lines = (env / "runs" / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_cli_end_to_end_with_eval_and_gold(env, tiny_model_dir, capsys):
    code = main(["ppo", "--policy", str(tiny_model_dir), "--prompts", str(env / "prompts.jsonl"),
                 "--eval-prompts", str(env / "prompts.jsonl"),
                 "--reward-fn", f"{env / 'rewards.py'}:length_reward",
                 "--gold-fn", f"{env / 'rewards.py'}:gold", "--run-name", "cli",
                 "--output-dir", str(env / "runs"), "--total-episodes", "16", "--batch-size", "8",
                 "--max-new-tokens", "5", "--device", "cpu", "--eval-every", "1",
                 "--sample-every", "1", "--kl-ctl", "annealed", "--beta-end", "0.01",
                 "--critic", "shared", "--stop-strings", ".", "--missing-eos-penalty", "0.5"])
    assert code == 0, capsys.readouterr().err
    run_dir = env / "runs" / "cli"
    evals, *lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 0 is the evaluation of the untouched policy, where every curve starts: KL exactly 0.
    assert evals["step"] == 0 and evals["eval/kl"] == 0.0 and "eval/gold_score" in evals
    assert [x["step"] for x in lines] == [1, 2]
    for key in ("objective/score", "objective/kl", "objective/beta", "objective/rlhf_reward",
                "policy/entropy", "rollout/response_len", "rollout/eos_rate", "policy/clip_frac",
                "policy/approx_kl", "value/loss", "value/explained_var", "perf/tokens_per_s",
                "eval/score", "eval/gold_score", "eval/kl", "eval/distinct_2"):
        assert all(key in x for x in lines), key
    # Annealed over 2 batches from 0.05: beta 0.05 for batch 1, then 0.03 (halfway to 0.01).
    assert [x["objective/beta"] for x in [evals, *lines]] == pytest.approx([0.05, 0.05, 0.03])
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    n_prompts = len((env / "prompts.jsonl").read_text().splitlines())
    assert [x["step"] for x in samples] == [0, 1, 2]
    assert all(len(x["samples"]) == n_prompts for x in samples)
    assert {"prompt", "response", "score", "gold_score"} <= set(samples[0]["samples"][0])
    assert (env / "runs" / "cli" / "final" / "config.json").is_file()
    assert any((env / "runs" / "cli" / "tb").iterdir())


def test_reward_model_path_and_value_model_from_it(env, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rm = RewardModel.from_causal_lm(str(tiny_model_dir), tokenizer)
    rm.save_pretrained(env / "rm", tokenizer)
    critic = ValueModel.from_reward_model(rm)
    rm_ptrs = {p.data_ptr() for p in rm.parameters()}
    assert not rm_ptrs & {p.data_ptr() for p in critic.parameters()}
    ids = torch.tensor([tokenizer("the movie was good")["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        # The critic starts as the RM. Its value for the last token is read at the position before
        # it (the state the token is chosen in), so it equals the RM's score of that prefix.
        value = critic(ids, mask, 1)[0, -1].item()
        assert value == pytest.approx(rm(ids[:, :-1], mask[:, :-1]).item(), abs=1e-5)
    result = run(config(env, tiny_model_dir, "with_rm", reward_model=str(env / "rm")))
    assert math.isfinite(result.metrics["objective/score"])


def _always_emits(loader, token_id: int):
    """A `loader` whose model puts +100 on `token_id`'s logit: every sample is that token."""
    def load(*args, **kwargs):
        model = loader(*args, **kwargs)
        def push(module, inputs, logits):
            logits[..., token_id] += 100.0
            return logits
        model.lm_head.register_forward_hook(push)
        return model
    return load


def test_two_eos_model_stops_on_either_eos(env, tiny_qwen2_dir, monkeypatch):
    # Qwen2.5-Instruct style: generation_config lists <|im_end|> and <|endoftext|>, and the
    # tokenizer ships <|endoftext|> as its pad. A response that emits <|endoftext|> has ended.
    tok = load_tokenizer(str(tiny_qwen2_dir))
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    chat = env / "chat_prompts.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                            for p in PROMPTS))
    cfg = config(env, tiny_qwen2_dir, "two_eos", prompts=str(chat), total_episodes=8)
    setup = build(cfg, reward_fn=length_reward)
    assert setup.eos_token_ids == sorted([endoftext, im_end])
    assert setup.tokenizer.pad_token_id not in setup.eos_token_ids
    # ChatML writes no BOS and the tokenizer adds none: the prompt is the rendered text's ids
    rendered = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                       add_generation_prompt=True)
    assert setup.source.prompt_ids[0] == tok(rendered)["input_ids"]

    monkeypatch.setattr(pretrained, "load_causal_lm",
                        _always_emits(pretrained.load_causal_lm, endoftext))
    seen = []

    def reward(prompts, responses):
        seen.extend(responses)
        return [0.0] * len(responses)
    result = run(cfg, reward_fn=reward)
    # every response is the one EOS token: ended (no missing-EOS penalty), length 1, and the
    # reward sees nothing after it
    assert result.metrics["rollout/eos_rate"] == 1.0
    assert result.metrics["rollout/response_len"] == 1.0
    assert seen == [""] * 8


def test_score_normalizer_running_uses_all_scores_so_far():
    norm = ScoreNormalizer("running")
    first, second = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 0.0])
    norm(first)
    out = norm(second)
    everything = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0])  # mean 3.2, population std 3.487
    expected = (second - everything.mean()) / everything.std(unbiased=False)
    torch.testing.assert_close(out, expected)


def test_prompt_order_is_a_seeded_shuffle_per_epoch():
    # 5 prompts, batches of 3: batches 0..4 cover 15 slots = 3 epochs, each a permutation.
    stream = [i for b in range(5) for i in prompt_indices(5, 3, seed=1, batch=b)]
    for epoch in range(3):
        assert sorted(stream[epoch * 5:(epoch + 1) * 5]) == list(range(5))
    assert stream == [i for b in range(5) for i in prompt_indices(5, 3, seed=1, batch=b)]
    assert prompt_indices(2, 5, seed=0, batch=0).count(0) >= 2  # a batch larger than the set


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad_fn, message", [
    (lambda p, r: 1 / 0, "raised ZeroDivisionError"),
    (lambda p, r: [float("nan")] * len(r), "non-finite score"),
    (lambda p, r: [0.0] * (len(r) - 1), "returned 7 scores for 8 responses"),
    (lambda p, r: ["good"] * len(r), "not a list of numbers"),
])
def test_bad_reward_function_is_one_clear_line(env, tiny_model_dir, bad_fn, message):
    with pytest.raises(TetherError, match=message) as info:
        run(config(env, tiny_model_dir, "bad_reward"), reward_fn=bad_fn)
    assert "\n" not in str(info.value)
    assert not (env / "runs" / "bad_reward" / "final").exists()


def test_different_vocabularies_are_rejected(env, tiny_model_dir):
    other = save_tiny(env / "other_vocab", ["completely different words here"] * 50,
                      vocab_size=270)
    with pytest.raises(TetherError, match="reference model's tokenizer has a different vocab"):
        build(config(env, tiny_model_dir, "vocab_ref", ref_model=str(other)),
              reward_fn=length_reward)
    # A reward model on another vocabulary is no error: it reads the decoded text with its own
    # tokenizer (tests/models/test_hub_reward.py), and the critic starts from the policy's trunk.
    other_tok = load_tokenizer(str(other))
    RewardModel.from_causal_lm(str(other), other_tok).save_pretrained(env / "other_rm", other_tok)
    setup = build(config(env, tiny_model_dir, "vocab_rm", reward_model=str(env / "other_rm")))
    texts, responses = setup.source.prompts[:2], [" the movie was good.", " it"]
    expected = RewardModel.from_pretrained(env / "other_rm").score_texts(texts, responses)
    torch.testing.assert_close(setup.source.reward(texts, responses, None).scores, expected)
    if setup.critic is not None:
        assert setup.critic.head.weight.abs().max() == 0  # not the other vocabulary's trunk


def test_config_errors(env, tiny_model_dir, capsys):
    base = ["--policy", str(tiny_model_dir), "--prompts", str(env / "prompts.jsonl")]
    with pytest.raises(TetherError, match="'kl_in' must be one of: reward, loss"):
        parse_config(PPOConfig, base + ["--kl-in", "reward,loss"])
    with pytest.raises(TetherError, match="--samples-per-prompt 3 must be >= 1 and divide"):
        parse_config(PPOConfig, base + ["--batch-size", "8", "--samples-per-prompt", "3"])
    with pytest.raises(TetherError, match="--advantage rloo compares .* --samples-per-prompt 2"):
        parse_config(PPOConfig, base + ["--advantage", "rloo"])
    with pytest.raises(TetherError, match="k3_ratio is a loss term"):
        parse_config(PPOConfig, base + ["--kl-estimator", "k3_ratio"])
    with pytest.raises(TetherError, match="k1 has no useful gradient"):
        parse_config(PPOConfig, base + ["--kl-in", "loss", "--kl-estimator", "k1"])
    with pytest.raises(TetherError, match="must divide"):
        parse_config(PPOConfig, base + ["--batch-size", "8", "--num-minibatches", "3"])
    with pytest.raises(TetherError, match="exactly one reward"):
        build(config(env, tiny_model_dir, "two_rewards", reward_fn="rewards:length"),
              reward_fn=length_reward)
    capsys.readouterr()
    code = main(["ppo", *base, "--kl-in", "both", "--run-name", "both"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error:") and "must be one of: reward, loss" in err
    assert "\n" not in err
    assert not (env / "runs" / "both").exists()


def test_ppo_uses_the_optimizer_and_schedule_of_every_stage(env, tiny_model_dir):
    """One optimizer rule (AdamW, decay on matrices only) and one schedule ((k+1)/w warm-up, then
    linear decay) for SFT, RM, DPO and PPO; a PPO step is one rollout batch."""
    from tether.run.optim import lr_factor

    cfg = config(env, tiny_model_dir, "optim", weight_decay=0.1, warmup_batches=2,
                 total_episodes=48, lr=1e-3)
    setup = build(cfg, reward_fn=length_reward)
    decayed, plain = setup.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    trainable = [p for m in (setup.policy, setup.critic) for p in m.parameters() if p.requires_grad]
    assert len(decayed["params"]) + len(plain["params"]) == len({id(p) for p in trainable})
    lrs = []
    for _ in range(cfg.n_batches):
        lrs.append(setup.scheduler.get_last_lr()[0])
        setup.optimizer.step()
        setup.scheduler.step()
    assert lrs == pytest.approx([1e-3 * lr_factor(k, 6, 2, "linear") for k in range(6)])
    assert lrs[:3] == pytest.approx([0.5e-3, 1e-3, 1e-3])  # (k + 1) / 2, then decay from the peak


@pytest.mark.parametrize("stage, advantage", [("rloo", "rloo"), ("grpo", "grpo")])
def test_critic_free_stages_run_without_a_critic(env, tiny_llama_dir, stage, advantage, capsys):
    """`tether rloo` / `tether grpo`: k samples per prompt, no critic anywhere (no value head,
    no critic optimizer state, no critic checkpoint, no value metrics)."""
    out = env / "runs"
    argv = [stage, "--policy", str(tiny_llama_dir), "--prompts", str(env / "prompts.jsonl"),
            "--reward-fn", f"{env / 'rewards.py'}:length_reward", "--run-name", f"cf_{stage}",
            "--output-dir", str(out), "--batch-size", "8", "--total-episodes", "16",
            "--max-new-tokens", "4", "--save-every", "1", "--device", "cpu"]
    assert main(argv) == 0, capsys.readouterr().err
    run_dir = out / f"cf_{stage}"
    saved = yaml_load(run_dir / "config.yaml")
    assert saved["advantage"] == advantage and saved["samples_per_prompt"] == 4
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert (ckpt / "policy.safetensors").exists() and not (ckpt / "critic.safetensors").exists()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("value/") for line in lines for key in line)
    first = lines[0]
    assert first["objective/kl"] == 0.0 and first["objective/kl_exact"] == 0.0
    if stage == "grpo":  # the KL is in the loss, so the loss term is logged
        assert first["objective/kl_loss"] == 0.0


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_batch_holds_each_prompt_k_times_in_consecutive_rows(env, tiny_model_dir):
    cfg = config(env, tiny_model_dir, "groups", batch_size=8, samples_per_prompt=4,
                 advantage="rloo")
    setup = build(cfg, reward_fn=length_reward)
    assert setup.critic is None
    prompts, ids, _ = prompt_batch(setup, cfg, 0)
    assert len(prompts) == 8 and prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4
    assert prompts[0] != prompts[4] and ids[:4].eq(ids[0]).all()


def test_rollout_carries_its_temperature_and_other_ones_are_refused(env, tiny_model_dir):
    cfg = config(env, tiny_model_dir, "temperature", temperature=0.7)
    setup = build(cfg, reward_fn=length_reward)
    rollout = fresh_rollout(setup, cfg)
    assert rollout.temperature == 0.7 and rollout.select(slice(0, 2)).temperature == 0.7
    scored = score_rollout(setup.policy, setup.reference, setup.critic, rollout, None, 8)
    again = score_rollout(setup.policy, setup.reference, setup.critic, rollout, 0.7, 8)
    assert scored.logprobs.equal(again.logprobs)
    with pytest.raises(ValueError, match="temperature 1.0 for responses sampled at 0.7"):
        score_rollout(setup.policy, setup.reference, setup.critic, rollout, 1.0, 8)


@pytest.mark.parametrize("estimator, shown", [("k1", "kl_exact"), ("exact", "kl_exact")])
def test_the_progress_line_shows_a_kl_that_cannot_be_negative(env, tiny_model_dir, capsys,
                                                               estimator, shown):
    # issue 47: grpo's line showed k1 (`kl=-0.023`), which can be negative on a batch. It shows
    # the exact KL where the batch computed it (else k3), named so, and equal to the metric.
    from tether.cli import main

    kl_in = "reward" if estimator == "k1" else "loss"
    argv = ["grpo", "--policy", str(tiny_model_dir), "--prompts", str(env / "prompts.jsonl"),
            "--reward-fn", f"{env / 'rewards.py'}:length_reward", "--run-name",
            f"progress-{estimator}", "--output-dir", str(env / "runs"), "--batch-size", "8",
            "--total-episodes", "16", "--max-new-tokens", "6", "--device", "cpu",
            "--save-every", "0", "--kl-in", kl_in, "--kl-estimator", estimator]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if ": step " in line]
    metrics = [json.loads(x) for x in (env / "runs" / f"progress-{estimator}" /
                                      "metrics.jsonl").read_text().splitlines()]
    assert lines and " kl=" not in lines[-1]
    value = float(lines[-1].split(f" {shown}=")[1].split()[0])
    assert value >= 0 and value == pytest.approx(metrics[-1][f"objective/{shown}"], abs=1e-3)
