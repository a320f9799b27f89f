"""Asynchronous generation with bounded staleness (--max-staleness, `tether.rl.engines.ahead`)
and the decoupled PPO loss it trains with, checked against independent truths:

- the behaviour policy is the right one: each batch's recorded log-probs equal those of the
  weights the trainer held L batches earlier (recomputed here from saved copies), not those of
  the weights that train it, and every token's version gap is within S;
- --max-staleness 0 is the synchronous loop bit for bit, and the decoupled weights of tokens
  sampled by pi_old are exactly 1 (the loss is then the plain clipped loss, bit for bit);
- the decoupled gradient is unbiased on a bandit whose behaviour, proximal and current policies
  are known (Monte Carlo, within 3 standard errors of the exact gradient);
- a schedule of random generation and update times on a simulated clock never trains a token
  more than S steps stale, trains every batch once, in order (none dropped);
- a LoRA adapter reaches the generator: after each sync the log-probs it records of what it
  samples equal the trainer's and are not the initial adapter's;
- the settings that cannot work are refused with one line, before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from async_helpers import check_behaviour_policy, policy_as_loaded, recorded_run
from refusals import refused

from tether.losses import PolicyLoss, policy_loss
from tether.rl import update as update_module
from tether.rl.engines import ahead
from tether.rl.engines.generator import next_message
from tether.rl.engines.mismatch import (
    Correction,
    correction_weights,
    effective_sample_size,
    staleness_metrics,
)
from tether.run.optim import StepCounter
from tether.train import ppo
from tether.train.ppo_config import GRPOConfig, PPOConfig

NATIVE = SimpleNamespace(engine="native")  # the settings a generator of the native engine reads
PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very",
           "music and", "the actor", "a scene", "very quite"]


@torch.no_grad()
def sequence_logprobs(model, ids, mask):
    """[B, L - 1] log p(ids[:, t + 1] | ids[:, :t + 1]) under `model`: the trainer's, recomputed."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ahead") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def grpo(model_dir, prompts_file, name, **overrides) -> GRPOConfig:
    values = dict(run_name=name, output_dir=str(prompts_file.parent / "runs"),
                  policy=str(model_dir), prompts=str(prompts_file), batch_size=4,
                  samples_per_prompt=2, total_episodes=16, max_new_tokens=6, lr=3e-2,
                  beta=0.1, device="cpu", save_every=0, sample_every=0, report_to="none",
                  generator_threads=1, threads=1)
    values.update(overrides)
    return GRPOConfig(**values)


def final_weights(result) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(result.output_path.glob("*.safetensors"))))


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_llama_dir"])
def test_each_batch_is_sampled_by_the_weights_of_l_batches_before(model, request, prompts_file,
                                                                  monkeypatch):
    """S = 2 with 2 steps a batch (2 minibatches): one batch ahead. Batch b's behaviour
    log-probs are those of the weights batch b - 1 started from (batch 0's: the start), to
    float rounding, and differ from the weights that train it: the decoupled loss has the right
    mu. Every token's gap is within S and the metrics say so."""
    cfg = grpo(request.getfixturevalue(model), prompts_file, f"ahead-{model}",
               max_staleness=2, num_minibatches=2, generator_threads=2)
    assert cfg.batches_ahead == 1
    seen, threads = recorded_run(cfg, monkeypatch, length_reward)
    assert threads == 2  # --generator-threads reached the generator process
    assert len(seen) == cfg.n_batches == 4
    check_behaviour_policy(seen, cfg, policy_as_loaded(cfg), tolerance=1e-4)
    for b, (rollout, _state, version, done) in enumerate(seen):
        mask = rollout.action_mask
        assert torch.equal(rollout.versions[mask],
                           torch.full_like(rollout.versions[mask], seen[max(b - 1, 0)][2]))
        stats = done.stats
        assert stats["async/overrun_tokens"] == 0.0
        expected_gap = version - seen[max(b - 1, 0)][2]
        assert stats["async/staleness_max"] == expected_gap
        assert stats[f"async/staleness_{expected_gap}"] == 1.0
        assert 0 < stats["rollout/engine_is_ess"] <= 1.0
        # the engines' mismatch is measured on rows of the current version alone: batch 0's
        assert ("rollout/engine_kl" in stats) == (expected_gap == 0)
        assert ("async/version_kl" in stats) == (expected_gap > 0)
    assert [v for _, _, v, _ in seen] == [0, 2, 4, 6]  # versions count optimizer steps


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tiny_model_dir, prompts_file):
    """--max-staleness 0 given explicitly trains what the default does, to the bit."""
    base = ppo.run(grpo(tiny_model_dir, prompts_file, "sync-default", total_episodes=8),
                   reward_fn=length_reward)
    given = ppo.run(grpo(tiny_model_dir, prompts_file, "sync-zero", total_episodes=8,
                         max_staleness=0), reward_fn=length_reward)
    a, b = final_weights(base), final_weights(given)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weights_of_tokens_sampled_by_pi_old_are_exactly_one_and_the_loss_is_plain():
    """mu = pi_old (the native engine, S = 0): every weight min(exp(0), C) is exactly 1, and the
    clipped loss with the advantages so weighted equals the plain one bit for bit."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    new = (old + 0.3 * torch.randn(3, 7, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) > 0.2
    weights, stats = correction_weights(old, old.clone(), mask, Correction(engine_is_cap=2.0))
    assert bool((weights[mask] == 1).all()) and stats["rollout/engine_is_ess"] == 1.0
    plain, _ = policy_loss(new, old, adv, mask, PolicyLoss())
    weighted, _ = policy_loss(new, old, adv * weights.double(), mask, PolicyLoss())
    assert plain.item() == weighted.item()


def test_the_decoupled_gradient_is_unbiased_on_a_bandit():
    """A 5-armed bandit, softmax policies: behaviour mu (the stale copy), proximal pi_prox,
    current pi_theta. The decoupled objective E_{a~mu}[w(a) min(r A, clip(r) A)], w = pi_prox / mu
    (cap above every ratio), r = pi_theta / pi_prox, has the gradient of
    E_{a~pi_prox}[min(r A, clip(r) A)], computed exactly over the arms. Monte Carlo through
    tether's own weight and loss functions agrees within 3 standard errors in every coordinate,
    and the gradient without the weight (the bug of recomputing mu as pi_prox) does not."""
    torch.manual_seed(0)
    arms, n = 5, 20000
    mu = torch.softmax(torch.tensor([0.5, -0.2, 0.1, 0.9, -0.6], dtype=torch.float64), 0)
    prox_logits = torch.tensor([0.2, 0.3, -0.4, 0.6, 0.0], dtype=torch.float64)
    theta = (prox_logits + torch.tensor([0.15, -0.1, 0.05, -0.2, 0.1],
                                        dtype=torch.float64)).requires_grad_()
    reward = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2], dtype=torch.float64)
    prox = torch.softmax(prox_logits, 0)
    advantage = reward - (prox * reward).sum()  # an advantage under pi_prox
    spec = PolicyLoss(clip_range=0.2)

    # exact: sum over arms of pi_prox(a) * per-arm clipped objective
    logp = torch.log_softmax(theta, 0)
    exact = torch.zeros(arms, dtype=torch.float64)
    for a in range(arms):
        one = torch.tensor([[True]])
        loss, _ = policy_loss(logp[a].view(1, 1), prox.log()[a].view(1, 1),
                              advantage[a].view(1, 1), one, spec, denominator=1.0)
        exact = exact + prox[a] * torch.autograd.grad(loss, theta, retain_graph=True)[0]

    # Monte Carlo: samples from mu, one loss per sample, weighted by tether's decoupled weight
    actions = torch.multinomial(mu, n, replacement=True, generator=torch.Generator().manual_seed(1))
    behaviour = mu.log()[actions].view(n, 1)
    proximal = prox.log()[actions].view(n, 1)
    mask = torch.ones(n, 1, dtype=torch.bool)
    weights, _ = correction_weights(proximal, behaviour, mask, Correction(engine_is_cap=100.0))
    per_sample, unweighted = [], []
    jac = torch.autograd.functional.jacobian(
        lambda t: torch.log_softmax(t, 0)[actions], theta.detach())  # [n, arms]
    for w_on, out in ((True, per_sample), (False, unweighted)):
        current = torch.log_softmax(theta, 0)[actions].view(n, 1).detach().requires_grad_()
        adv = advantage[actions].view(n, 1) * (weights.double() if w_on else 1.0)
        loss, _ = policy_loss(current, proximal, adv, mask, spec, denominator=1.0)  # the sum
        (g_logp,) = torch.autograd.grad(loss, current)  # d loss_i / d log pi(a_i)
        out.append(g_logp.view(n, 1) * jac)  # [n, arms]: each sample's gradient
    grads = per_sample[0]
    mean, se = grads.mean(0), grads.std(0) / n ** 0.5
    assert bool(((mean - exact).abs() < 3 * se).all()), (mean, exact, se)
    biased = unweighted[0].mean(0)
    assert bool(((biased - exact).abs() > 3 * se).any())


class ClockGenerator:
    """The generator's contract on an event clock: its inbox served in order, each request
    taking a random time from when it is both asked for and reached; weights load at their
    place in the inbox. Each batch gets a random number of tokens when sampled."""

    def __init__(self, rng: random.Random):
        self.rng, self.inbox, self.version, self.free_at = rng, [], 0, 0.0
        self.sampled: dict[int, tuple[int, float, int]] = {}  # batch -> (version, ready, tokens)
        self.asked: set[int] = set()

    def prefetch(self, rows, mine, noise_seed) -> None:  # the RolloutSource call sample_ahead makes
        self.ask(rows[0], self.now)

    def ask(self, batch: int, now: float) -> None:
        if batch not in self.asked:
            self.asked.add(batch)
            self.inbox.append(("sample", batch, now))

    def sync(self, version: int, now: float) -> None:
        self.inbox.append(("weights", version, now))

    def take(self, batch: int, now: float) -> tuple[int, float, int]:
        self.ask(batch, now)
        while batch not in self.sampled:
            kind, value, asked_at = self.inbox.pop(0)
            if kind == "weights":
                self.version = value
                continue
            self.free_at = max(self.free_at, asked_at) + self.rng.expovariate(1.0)
            self.sampled[value] = (self.version, self.free_at, self.rng.randint(1, 64))
        return self.sampled.pop(batch)


def test_a_simulated_clock_never_trains_a_token_more_than_s_steps_stale(monkeypatch):
    """The loop's calls (`ppo.sample_ahead` asks for the batches after b, with the real
    `batches_ahead`; b trains for a random number of optimizer steps, up to --ppo-epochs x
    --num-minibatches, as --target-kl stopping early would; then the sync) against a generator
    with random sampling and update times: every batch is trained once, in order, none dropped;
    no token is more than S steps stale; the trained token counts are the generated ones."""
    from tether.run.distributed import Dist

    rng = random.Random(0)
    monkeypatch.setattr(ppo, "batch_rows", lambda setup, cfg, batch, round_=0: [batch])
    for trial in range(300):
        epochs, minibatches = rng.randint(1, 3), rng.choice([1, 2, 4])
        steps = epochs * minibatches
        cfg = GRPOConfig(policy="p", prompts="x.jsonl", batch_size=4, ppo_epochs=epochs,
                         num_minibatches=minibatches, total_episodes=4 * rng.randint(1, 10),
                         max_staleness=steps * rng.randint(0, 3) + rng.randint(0, steps - 1))
        generator = ClockGenerator(rng)
        setup = SimpleNamespace(source=generator, dist=Dist())
        version, now, trained, generated = 0, 0.0, [], []
        for b in range(cfg.n_batches):
            sampled_by, ready, tokens = generator.take(b, now)
            now = max(now, ready)  # the trainer waits for its batch
            generated.append(tokens)
            generator.now = now
            ppo.sample_ahead(setup, cfg, b)  # before the update: sampled by the weights b starts from
            trained.append((b, version - sampled_by, tokens))
            version += rng.randint(1, steps)
            now += rng.expovariate(1.0)
            generator.sync(version, now)
        assert [b for b, _, _ in trained] == list(range(cfg.n_batches)), trial
        assert all(0 <= gap <= cfg.max_staleness for _, gap, _ in trained), (trial, trained)
        assert sorted(t for _, _, t in trained) == sorted(generated)
        if cfg.batches_ahead and cfg.n_batches > 1:  # batch 1 really was sampled ahead
            assert trained[1][1] > 0, trial


def test_the_staleness_metrics_keep_mismatch_and_versions_apart():
    """Hand-made: row 0 sampled by the current version (its k3 is the mismatch), row 1 two
    steps back (its k3 is the versions' KL), row 2 one step back; shares per gap."""
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0]])
    engine = torch.tensor([[-1.1, -2.0, 0.0], [-1.5, -0.5, -1.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    versions = torch.tensor([[5, 5, 0], [3, 3, 3], [4, 0, 0]])
    out = staleness_metrics(trainer, engine, versions, mask, current=5, max_staleness=2)

    def k3(d):
        return sum(torch.expm1(torch.tensor(x)).item() - x for x in d)
    assert out["rollout/engine_kl"] == pytest.approx(k3([0.1, 0.0]), rel=1e-5)
    assert out["async/version_kl"] == pytest.approx((k3([0.5, -0.5, 0.0]) + k3([0.0])) / 2,
                                                    rel=1e-5)
    assert out["async/staleness_0"] == pytest.approx(2 / 6)
    assert out["async/staleness_1"] == pytest.approx(1 / 6)
    assert out["async/staleness_2"] == pytest.approx(3 / 6)
    assert out["async/staleness_max"] == 2 and out["async/overrun_tokens"] == 0
    assert out["async/staleness_mean"] == pytest.approx((0 + 0 + 2 * 3 + 1) / 6)
    late = staleness_metrics(trainer, engine, versions, mask, current=6, max_staleness=2)
    assert late["async/overrun_tokens"] == pytest.approx(3 / 6)  # flagged, not dropped
    assert "rollout/engine_kl" not in late  # no row at the current version


def test_threads_split_between_trainer_and_generator(monkeypatch):
    """Auto (0, 0) on 4 cores: 2 and 2; on 1 core 1 and 1; what is given is kept; no generator:
    the trainer's request as given."""
    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda _pid: set(range(4)))
    assert ahead.split_threads(0, 0, True) == (2, 2)
    assert ahead.split_threads(3, 0, True) == (3, 2)
    assert ahead.split_threads(0, 1, True) == (3, 1)
    assert ahead.split_threads(0, 0, False) == (0, 0)
    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda _pid: {0})
    assert ahead.split_threads(0, 0, True) == (1, 1)


def test_settings_that_do_less_than_they_say_are_warned(monkeypatch, capsys):
    """S = 5 at 2 steps a batch samples 2 batches ahead, as S = 4 does; 1000 generator threads
    on 2 cores only wait on each other. Each is one warning line (accepted before without a
    word); a multiple of the steps and threads within the cores say nothing."""
    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda _pid: {0, 1})
    cfg = GRPOConfig(policy="p", prompts="x.jsonl", batch_size=4, total_episodes=16,
                     num_minibatches=2, max_staleness=5, generator_threads=1000)
    ahead.warn(cfg)
    assert capsys.readouterr().err.splitlines() == [
        "warning: --max-staleness 5 is not a multiple of the 2 optimizer steps each batch takes, "
        "so it samples 2 batches ahead as --max-staleness 4 does; give that",
        "warning: --generator-threads 1000 is more than the 2 cores this process may use, and "
        "threads past them only wait on each other; give at most that many, or 0 (half the "
        "cores)"]
    ahead.warn(dataclasses.replace(cfg, max_staleness=4, generator_threads=2))
    assert capsys.readouterr().err == ""


def test_effective_sample_size_by_hand():
    mask = torch.tensor([[True, True, True, False]])
    assert effective_sample_size(torch.tensor([[1.0, 1.0, 1.0, 9.0]]), mask) == 1.0
    assert effective_sample_size(torch.tensor([[2.0, 0.0, 0.0, 1.0]]), mask) == pytest.approx(1 / 3)
    assert effective_sample_size(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), mask) == pytest.approx(
        36 / (3 * 14))


def test_a_lora_adapter_reaches_the_generator_at_every_sync(tiny_llama_dir):
    """The adapter alone travels (the frozen base is not sent), and after each sync the
    log-probs the generator records of what it samples are those of the trainer's current
    weights, to float rounding, not of the initial adapter's."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    initial = copy.deepcopy(model)
    sent = ahead.trainable(model)
    assert sent and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in sent) < sum(p.numel() for p in model.parameters()) / 5
    optimizer = torch.optim.AdamW(sent, lr=5e-2)
    engine = ahead.start(NATIVE, model, None, StepCounter(optimizer), 1, 0,
                         torch.device("cpu"))
    try:
        ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        uniforms = torch.rand((2, 6), generator=torch.Generator().manual_seed(1))
        for step in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            engine.sync()
            rollout = engine.sample(ids, mask, max_new_tokens=6, temperature=1.0,
                                    eos_token_ids=[0], pad_token_id=0, uniforms=uniforms)
            sampled = rollout.action_mask
            assert (rollout.versions[sampled] == step + 1).all()
            full = torch.cat([ids, rollout.responses], dim=1)
            theirs = rollout.engine_logprobs[sampled]
            mine, first = (sequence_logprobs(m, full, torch.ones_like(full))[:, ids.shape[1] - 1:]
                           for m in (model, initial))
            assert (theirs - mine[sampled]).abs().max() < 1e-5
            assert (theirs - first[sampled]).abs().max() > 1e-4, step  # not the initial adapter
    finally:
        engine.close()
    assert engine.launched.process.exitcode == 0


def test_sample_takes_the_prefetched_batch_only_for_the_same_request(tiny_model_dir):
    """A prefetched request is answered once, to the call that asks for exactly it; another
    noise is another request (sampled then, by the weights of its time)."""
    from transformers import AutoModelForCausalLM

    from tether.rl.engines.native import sample_responses
    from tether.rl.rollout import sampling_uniforms

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = ahead.start(NATIVE, model, None, StepCounter(optimizer), 1, 0,
                         torch.device("cpu"))
    try:
        ids = torch.randint(3, 250, (3, 4), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        kw = dict(max_new_tokens=5, temperature=1.0, eos_token_ids=[0], pad_token_id=1)
        first, other = sampling_uniforms(1, 3, 5), sampling_uniforms(2, 3, 5)
        engine.prefetch(ids, mask, uniforms=first, **kw)
        before = sample_responses(model, ids, mask, uniforms=first, record_logprobs=True, **kw)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        engine.sync()
        taken = engine.sample(ids, mask, uniforms=first, **kw)  # asked before the step
        assert torch.equal(taken.input_ids, before.input_ids)
        assert torch.allclose(taken.engine_logprobs, before.engine_logprobs, atol=1e-6)
        assert int(taken.versions.max()) == 0
        fresh = engine.sample(ids, mask, uniforms=other, **kw)  # asked now: version 1
        assert int(fresh.versions[fresh.action_mask].min()) == 1
        assert not engine.pending
    finally:
        engine.close()


@pytest.mark.parametrize("argv, pattern", [
    (["--max-staleness", "1", "--num-minibatches", "2"],
     r"--max-staleness 1 is less than the 2 optimizer steps each batch takes"),
    (["--max-staleness", "-1"], r"'max_staleness' must be >= 0"),
    (["--max-staleness", "1", "--generator-threads", "999999999"],  # torch took it: 1e9 threads
     r"--generator-threads 999999999 is out of range: give 0 \(auto\) or 1 to 4096 threads"),
    (["--max-staleness", "1000000"],  # it wrote 1,000,001 histogram keys in every metric line
     r"--max-staleness 1000000 is more than the 2 optimizer steps this whole run takes \(2 "
     r"batches, 1 each\), so no token could ever be that stale; give at most 2 \(or 0\)$"),
    (["--max-staleness", "1", "--engine-mask-kl", "2"],
     r"--engine-mask-kl applies with --engine vllm and --max-staleness 0, and tether grpo runs "
     r"with --max-staleness 1, whose decoupled loss corrects the staleness"),
    (["--engine-is-cap", "2"], r"--engine-is-cap applies with --engine vllm or --max-staleness "
                               r"above 0, and tether grpo runs with --engine native"),
])
def test_settings_that_cannot_work_are_refused_before_any_model_loads(
        argv, pattern, tiny_model_dir, prompts_file, tmp_path, capsys, no_loads):
    base = ["grpo", "--policy", str(tiny_model_dir), "--prompts", str(prompts_file),
            "--reward-fn", "tests/rl/test_async_generation.py:length_reward",
            "--output-dir", str(tmp_path / "runs"), "--batch-size", "4",
            "--total-episodes", "8", "--device", "cpu"]
    refused(tmp_path, base + argv, pattern, capsys)
    assert no_loads == []


def test_engine_is_cap_acts_with_staleness(tiny_model_dir, prompts_file):
    """--engine-is-cap with the native engine is accepted once --max-staleness makes it act, and
    without one given the decoupled weight is capped at 2."""
    cfg = grpo(tiny_model_dir, prompts_file, "cap", max_staleness=1, engine_is_cap=3.0)
    assert cfg.resolved_engine_is_cap == 3.0
    assert grpo(tiny_model_dir, prompts_file, "cap2", max_staleness=1).resolved_engine_is_cap == 2.0
    assert PPOConfig.resolved_engine_is_cap.fget(
        grpo(tiny_model_dir, prompts_file, "cap3")) == 0.0
    from tether.run.config import section  # what the update reads takes the resolved cap

    assert section(update_module.UpdateSpec, cfg, micro_rows=1).correction.engine_is_cap == 3.0


@pytest.mark.parametrize("staleness, minibatches", [(1, 1), (4, 2)])
def test_a_resumed_run_trains_what_the_uninterrupted_run_trains(tiny_model_dir, prompts_file,
                                                                 staleness, minibatches):
    """A run that died in its third batch, resumed: the batches in flight when it died are
    sampled again by the weights that sampled them first (the checkpoint keeps them), so the
    resumed run's final weights and metrics equal the uninterrupted run's, bit for bit. One
    batch ahead, and two (S = 4 at 2 steps a batch: batches 3 and 4 in flight, sampled by the
    weights of batches 1 and 2)."""
    from tether.errors import TetherError

    calls = {"n": 0, "crash": False}

    def flaky(prompts, responses):  # one name for every run: the metrics carry it
        calls["n"] += 1
        if calls["crash"] and calls["n"] == 3:
            raise RuntimeError("reward server went away")
        return length_reward(prompts, responses)

    kw = dict(max_staleness=staleness, num_minibatches=minibatches, save_every=1,
              total_episodes=24)
    name = f"cut-{staleness}"
    whole = ppo.run(grpo(tiny_model_dir, prompts_file, f"whole-{staleness}", **kw),
                    reward_fn=flaky)
    calls.update(n=0, crash=True)
    with pytest.raises(TetherError, match="reward server went away"):
        ppo.run(grpo(tiny_model_dir, prompts_file, name, **kw), reward_fn=flaky)
    resumed = ppo.run(grpo(tiny_model_dir, prompts_file, name, resume=True, **kw),
                      reward_fn=flaky)
    a, b = final_weights(whole), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [[json.loads(x) for x in (r.output_path.parent / "metrics.jsonl").read_text()
              .splitlines()] for r in (whole, resumed)]
    assert [x["step"] for x in lines[1]] == [x["step"] for x in lines[0]] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(*lines, strict=True):
        same = {k: v for k, v in x.items() if not k.startswith("perf/")}
        assert same == {k: v for k, v in y.items() if not k.startswith("perf/")}, x["step"]
    assert lines[0][-1]["async/staleness_max"] == staleness  # the gap was there to keep


def test_pooled_rewards_of_batches_sampled_ahead_are_scored_in_the_background(
        tiny_model_dir, prompts_file, monkeypatch):
    """With the reward pool (its calls run off the main thread anyway) a batch sampled ahead is
    scored in the background job too, while the trainer updates; what it trains is the run
    that scores it on the main thread when it is taken, bit for bit. A reward function called
    directly (no pool) is scored on the main thread, where SIGALRM works."""
    import threading

    from tether.rl import sources

    scorers: list[str] = []
    real = sources.PromptSource.work

    def answered(self, engine, rows, mine, noise_seed):
        scorers.append(threading.current_thread().name)
        return real(self, engine, rows, mine, noise_seed)
    monkeypatch.setattr(sources.PromptSource, "work", answered)
    kw = dict(max_staleness=1, reward_workers=4)
    ahead_run = ppo.run(grpo(tiny_model_dir, prompts_file, "scored-ahead", **kw),
                        reward_fn=length_reward)
    assert scorers == ["MainThread"] + ["tether-ahead"] * 3  # batch 0, then 3 sampled ahead
    scorers.clear()
    monkeypatch.setattr(sources, "PromptsScoredAhead", sources.PromptSource)
    taken = ppo.run(grpo(tiny_model_dir, prompts_file, "scored-when-taken", **kw),
                    reward_fn=length_reward)
    assert scorers == ["MainThread"] * 4
    a, b = final_weights(ahead_run), final_weights(taken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    scorers.clear()
    monkeypatch.undo()
    monkeypatch.setattr(sources.PromptSource, "work", answered)
    ppo.run(grpo(tiny_model_dir, prompts_file, "no-pool", max_staleness=1, total_episodes=8),
            reward_fn=length_reward)
    assert scorers == ["MainThread"] * 2


def test_a_build_that_fails_after_the_generator_started_ends_it(tiny_model_dir, prompts_file,
                                                               tmp_path, capsys, monkeypatch):
    """The generator process starts before the models load (its imports overlap the loading);
    a bad input found after that (a reward function that is not in its file) is still one line,
    and leaves no generator behind."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    launched, real, warned = [], ahead.launch, []
    monkeypatch.setattr(ahead, "launch", lambda threads: launched.append(real(threads)) or
                        launched[-1])
    monkeypatch.setattr(ahead, "warn", warned.append)
    refused(tmp_path, ["grpo", "--policy", str(tiny_model_dir), "--prompts", str(prompts_file),
                       "--reward-fn", "tests/rl/test_async_generation.py:no_such_function",
                       "--output-dir", str(tmp_path / "runs"), "--batch-size", "4",
                       "--total-episodes", "8", "--device", "cpu", "--max-staleness", "1"],
            r"no_such_function", capsys)
    assert len(launched) == 1  # it had started when the bad input was found
    assert len(warned) == 1  # its settings' warnings, once
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert not left and not launched[0].process.is_alive(), left


def unreadable():
    raise ValueError("not a message")


class Unreadable:
    def __reduce__(self):
        return unreadable, ()


def send_then_wait(box, sent) -> None:  # the generator's side: a rollout's tensor, then idle
    box.put((1, 0, torch.arange(3)))
    box.close()
    box.join_thread()  # in the pipe
    sent.set()
    time.sleep(600)


def test_a_message_left_by_a_killed_generator_reads_as_its_end():
    """kill -9 of the generator after it answered: torch rebuilds the answer's tensors through a
    connection to the sender, refused (or cut) once it is gone. The trainer reads that as the
    process's end, which it names in one line, not as a ConnectionRefusedError traceback; a
    live sender's failure is still raised."""
    ctx = torch.multiprocessing.get_context("spawn")
    box, sent = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=send_then_wait, args=(box, sent), daemon=True)
    child.start()
    try:
        assert sent.wait(120)
        box.put(Unreadable())  # after the child's answer: read second
        child.kill()
        child.join(10)
        assert next_message(box, child) is None
        alive = SimpleNamespace(is_alive=lambda: True, join=lambda timeout: None)
        with pytest.raises(ValueError, match="not a message"):  # a live sender's: its own error
            next_message(box, alive)
    finally:
        child.kill()
