"""tether.kl against independent truth: the estimator formulas, exact expectations under a
categorical policy, torch.distributions.kl_divergence, and hand-computed controller sequences."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributions import Categorical, Normal, kl_divergence

from tether import kl
from tether import logprobs as logprobs_mod

ESTIMATOR_FORMULAS = {
    "k1": lambda d: d,
    "k2": lambda d: d**2 / 2,
    "k3": lambda d: torch.exp(-d) - 1 + d,
    "abs": lambda d: d.abs(),
}


# ---------------------------------------------------------------- per-token estimators


@pytest.mark.parametrize("name", sorted(ESTIMATOR_FORMULAS))
def test_estimators_equal_their_formulas(name):
    gen = torch.Generator().manual_seed(0)
    logprobs = -5 * torch.rand(4, 7, generator=gen, dtype=torch.float64)
    ref_logprobs = -5 * torch.rand(4, 7, generator=gen, dtype=torch.float64)
    d = logprobs - ref_logprobs  # |d| < 5, far inside the +-20 clamp
    got = kl.estimate(logprobs, ref_logprobs, name)
    assert got.shape == d.shape
    torch.testing.assert_close(got, ESTIMATOR_FORMULAS[name](d), rtol=1e-12, atol=1e-12)


def _categorical_pair(vocab=10, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    pi_logits = scale * torch.randn(vocab, generator=gen, dtype=torch.float64)
    ref_logits = scale * torch.randn(vocab, generator=gen, dtype=torch.float64)
    true_kl = float(kl_divergence(Categorical(logits=pi_logits), Categorical(logits=ref_logits)))
    return pi_logits.log_softmax(-1), ref_logits.log_softmax(-1), true_kl


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_k1_k3_unbiased_exact_expectation(name):
    # E_{y~pi}[k] = sum_y pi(y) k(d_y) can be summed exactly over a small vocabulary; for k1 it is
    # the KL's definition, for k3 it is sum(ref) - 1 + KL = KL. No sampling noise, so tight.
    log_pi, log_ref, true_kl = _categorical_pair()
    per_token = kl.estimate(log_pi, log_ref, name)
    assert float((log_pi.exp() * per_token).sum()) == pytest.approx(true_kl, rel=1e-10)


def test_k1_k3_sample_means_match_exact_kl():
    # Sample many tokens from pi with a fixed seed: the sample means of the unbiased estimators
    # must lie within a few standard errors of the exact KL; k3 also has the smaller spread.
    log_pi, log_ref, true_kl = _categorical_pair(seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=gen)
    stds = {}
    for name in ("k1", "k3"):
        samples = kl.estimate(log_pi[tokens], log_ref[tokens], name)
        stderr = float(samples.std()) / math.sqrt(samples.numel())
        assert abs(float(samples.mean()) - true_kl) < 4 * stderr, name
        stds[name] = float(samples.std())
    assert stds["k3"] < stds["k1"]


def test_k2_bias_grows_with_divergence_gaussian():
    # Schulman (2020)'s table: pi = N(0,1), ref = N(mu,1). Then d = mu^2/2 - mu*x, KL = mu^2/2
    # and E[k2] = (Var d + (E d)^2)/2 = (mu^2 + mu^4/4)/2, so k2's relative bias is exactly
    # mu^2/4: 0.0025 at mu = 0.1 (KL 0.005) and 0.25 at mu = 1 (KL 0.5), as in his table.
    # k1 and k3 stay unbiased at both.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, generator=gen, dtype=torch.float64)
    pi = Normal(0.0, 1.0)
    rel_bias = {}
    for mu in (0.1, 1.0):
        ref = Normal(mu, 1.0)
        true_kl = float(kl_divergence(pi, ref))
        assert true_kl == pytest.approx(mu**2 / 2)
        log_pi, log_ref = pi.log_prob(x), ref.log_prob(x)
        for name in ("k1", "k3"):
            samples = kl.estimate(log_pi, log_ref, name)
            stderr = float(samples.std()) / math.sqrt(x.numel())
            assert abs(float(samples.mean()) - true_kl) < 4 * stderr, (mu, name)
        rel_bias[mu] = float(kl.estimate(log_pi, log_ref, "k2").mean()) / true_kl - 1
    assert abs(rel_bias[0.1]) < 0.01  # closed form 0.0025; sampling noise ~0.0014
    assert rel_bias[1.0] == pytest.approx(0.25, abs=0.02)


def test_k2_bias_grows_with_divergence_categorical():
    # Categorical analogue, with exact expectations: for near distributions k2 ~ k1 (the second
    # order term of the KL), far apart k2 departs from the KL by a large fraction.
    biases = []
    for scale in (0.05, 2.0):
        log_pi, log_ref, true_kl = _categorical_pair(scale=scale, seed=3)
        expected_k2 = float((log_pi.exp() * kl.estimate(log_pi, log_ref, "k2")).sum())
        biases.append(abs(expected_k2 / true_kl - 1))
    assert biases[0] < 0.05
    assert biases[1] > 0.2


def test_k3_non_negative_and_finite_at_extreme_log_ratios():
    d = torch.tensor([-1000.0, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-6, 1.0, 20.0, 100.0, 1000.0])
    k3 = kl.estimate(d, torch.zeros_like(d), "k3")  # fp32: exp(1000) would overflow unclamped
    assert torch.isfinite(k3).all()
    assert (k3 >= 0).all()
    assert float(k3[5]) == 0.0
    # inside the clamp the value is the formula; d = -20 gives e^20 - 21
    assert float(k3[3]) == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_k3_clamps_only_its_exponent():
    # Past d = 20 the exponential term is e^-20 - 1 (clamped), and d itself is kept, so k3 grows
    # like d - 1 with gradient 1 - e^-20: a large divergence is still penalised and still pushes.
    d = torch.tensor([50.0, 1000.0], requires_grad=True)
    k3 = kl.estimate(d, torch.zeros(2), "k3")
    expected = torch.tensor([math.expm1(-20.0) + 50.0, math.expm1(-20.0) + 1000.0])
    torch.testing.assert_close(k3.detach(), expected)
    (grad,) = torch.autograd.grad(k3.sum(), d)
    torch.testing.assert_close(grad, torch.ones(2))


def test_estimate_rejects_bad_input():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match="estimator"):
        kl.estimate(a, a, "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl.estimate(a, torch.zeros(4), "k1")


# ---------------------------------------------------------------- exact KL


def _naive_exact(logits, ref_logits, temperature=1.0):
    log_p = torch.log_softmax(logits / temperature, -1)
    log_q = torch.log_softmax(ref_logits / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_exact_matches_torch_distributions(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 5, 11, generator=gen)
    ref_logits = 3 * torch.randn(3, 5, 11, generator=gen)
    expected = kl_divergence(Categorical(logits=logits.double() / temperature),
                             Categorical(logits=ref_logits.double() / temperature))
    got = kl.exact(logits, ref_logits, temperature)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_exact_zero_for_identical_and_shift_invariant():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=gen)
    ref_logits = torch.randn(4, 9, generator=gen)
    torch.testing.assert_close(kl.exact(logits, logits.clone()), torch.zeros(4), atol=1e-6, rtol=0)
    # softmax is unchanged by adding a constant per row, so the KL must be too
    torch.testing.assert_close(kl.exact(logits + 7.0, ref_logits - 3.0),
                               kl.exact(logits, ref_logits), atol=1e-5, rtol=1e-5)


def test_exact_gradient_matches_naive_autograd():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64)
    ref_logits = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64)
    weights = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (kl.exact, _naive_exact):
        a = logits.clone().requires_grad_()
        b = ref_logits.clone().requires_grad_()
        (fn(a, b, 0.8) * weights).sum().backward()
        grads.append((a.grad, b.grad))
    # exact() computes in fp32, so fp32-level agreement with the fp64 naive gradient
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


def test_exact_runs_in_chunks_without_full_copy(monkeypatch):
    # 15 rows of V=11 at 2 rows per chunk: 8 chunks, the last one ragged. Spy on log_softmax to
    # prove no call ever sees more than one chunk, and compare with the unchunked result.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen)
    ref_logits = torch.randn(3, 5, 11, generator=gen)
    expected = kl.exact(logits, ref_logits, 1.3)
    a = logits.clone().requires_grad_()
    kl.exact(a, ref_logits, 1.3).sum().backward()
    expected_grad = a.grad

    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 2 * 11)
    rows_seen = []
    real_log_softmax = torch.log_softmax

    def spy(x, *args, **kwargs):
        rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    with torch.no_grad():
        got = kl.exact(logits, ref_logits, 1.3)
    assert len(rows_seen) == 2 * 8 and max(rows_seen) == 2
    torch.testing.assert_close(got, expected)
    a = logits.clone().requires_grad_()
    kl.exact(a, ref_logits, 1.3).sum().backward()
    torch.testing.assert_close(a.grad, expected_grad)


# ---------------------------------------------------------------- divergences over the vocabulary

def _dense(name, logits, ref_logits, temperature, jsd_beta=0.5):
    """The divergence written out over a whole [..., V] tensor in float64, from the definitions:
    p the policy (student), q the reference (teacher), M = beta q + (1 - beta) p (GKD, eq. 1)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    q = torch.softmax(ref_logits.double() / temperature, dim=-1)

    def kl_of(a, b):  # sum_v a_v log(a_v / b_v)
        return (a * (a.log() - b.log())).sum(-1)
    if name == "exact":
        return kl_of(p, q)
    if name == "forward":
        return kl_of(q, p)
    m = jsd_beta * q + (1 - jsd_beta) * p
    return jsd_beta * kl_of(q, m) + (1 - jsd_beta) * kl_of(p, m)


DIVERGENCES = [("exact", {}), ("forward", {}), ("jsd", {"jsd_beta": 0.5}),
               ("jsd", {"jsd_beta": 0.1}), ("jsd", {"jsd_beta": 0.9})]


@pytest.mark.parametrize(("name", "extra"), DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergences_equal_a_dense_float64_computation(name, extra, temperature, monkeypatch):
    # 4 x 5 positions over V = 13, in chunks of 3 rows (7 chunks, the last ragged): the values
    # to 1e-6 and the gradients with respect to the policy's logits to 1e-5 of the float64 truth.
    from functools import partial

    from tether.choices import KL_ESTIMATORS
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 3 * 13)
    gen = torch.Generator().manual_seed(11)
    logits, ref_logits = torch.randn(4, 5, 13, generator=gen), torch.randn(4, 5, 13, generator=gen)
    rows = partial(KL_ESTIMATORS[name].rows.resolve(), **extra)
    a = logits.clone().requires_grad_()
    got = kl.exact(a, ref_logits, temperature, rows=rows)
    weights = torch.rand(4, 5, generator=gen)
    (got * weights).sum().backward()
    b = logits.double().clone().requires_grad_()
    truth = _dense(name, b, ref_logits, temperature, **extra)
    (truth * weights.double()).sum().backward()
    assert got.shape == (4, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), truth.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=0)
    assert (got >= -1e-6).all()  # every one of them is a divergence
    if name == "jsd":  # bounded: JSD_beta <= H(beta) = -beta log beta - (1 - beta) log(1 - beta)
        beta = extra["jsd_beta"]
        assert (got <= -beta * math.log(beta) - (1 - beta) * math.log(1 - beta) + 1e-6).all()


def test_jsd_ends_are_the_two_kls_and_its_middle_is_symmetric():
    gen = torch.Generator().manual_seed(5)
    p, q = torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen)
    assert torch.equal(kl.jsd_rows(p, q, 1.0, jsd_beta=0.0), kl.forward_rows(p, q, 1.0))
    assert torch.equal(kl.jsd_rows(p, q, 1.0, jsd_beta=1.0), kl.exact_rows(p, q, 1.0))
    # beta = 0.5 is the symmetric JSD: swapping student and teacher leaves it unchanged
    torch.testing.assert_close(kl.jsd_rows(p, q, 1.0), kl.jsd_rows(q, p, 1.0))
    # forward and reverse swap with the arguments
    torch.testing.assert_close(kl.forward_rows(p, q, 1.0), kl.exact_rows(q, p, 1.0))
    torch.testing.assert_close(kl.jsd_rows(p, p, 1.0, jsd_beta=0.3), torch.zeros(6), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        kl.jsd_rows(p, q, 1.0, jsd_beta=1.5)


def test_exact_rejects_bad_input():
    a = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="temperature"):
        kl.exact(a, a, 0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        kl.exact(a, torch.zeros(2, 6))


# ---------------------------------------------------------------- controllers


def test_adaptive_kl_hand_computed_ziegler_sequence():
    # beta 0.15, target 6, horizon 10000, batch 512, so n_steps / horizon = 0.0512.
    ctl = kl.AdaptiveKL(0.15, target=6.0, horizon=10000)
    # KL 12: e = 12/6 - 1 = 1, clipped to 0.2; beta = 0.15 * (1 + 0.2 * 0.0512) = 0.15 * 1.01024
    assert ctl.update(12.0, 512) == pytest.approx(0.151536, rel=1e-12)
    # KL 6.6: e = 0.1; beta = 0.151536 * 1.00512 = 0.151536 + 0.00077586432
    assert ctl.update(6.6, 512) == pytest.approx(0.15231186432, rel=1e-12)
    # KL 3: e = -0.5, clipped to -0.2; beta = 0.15231186432 * 0.98976
    #       = 0.15231186432 - 0.0015596734906... = 0.1507521908294
    assert ctl.update(3.0, 512) == pytest.approx(0.1507521908294, rel=1e-12)
    # KL 5.7 as a tensor of per-sequence KLs with that mean: e = -0.05, factor 0.99744
    assert ctl.update(torch.tensor([5.2, 6.2]), 512) == pytest.approx(
        0.1507521908294 * 0.99744, rel=1e-6)
    assert ctl.beta == ctl.update(6.0, 512)  # on target: e = 0, beta unchanged


@pytest.mark.parametrize("kl_value, error", [(100.0, 0.2), (0.0, -0.2), (7.2, 0.2), (4.8, -0.2)])
def test_adaptive_kl_error_clip(kl_value, error):
    # |KL/target - 1| >= 0.2 in every case (7.2 and 4.8 sit exactly on the clip), so e = +-0.2
    ctl = kl.AdaptiveKL(1.0, target=6.0, horizon=100)
    assert ctl.update(kl_value, 10) == pytest.approx(1.0 + error * 10 / 100, rel=1e-12)


def test_fixed_kl_never_moves():
    ctl = kl.FixedKL(0.05)
    for value in (0.0, 1e6, -3.0, torch.tensor([1.0, 2.0])):
        assert ctl.update(value, 512) == 0.05
    assert ctl.beta == 0.05


def test_annealed_kl_linear_end_points_and_midpoint():
    ctl = kl.AnnealedKL(1.0, 0.2, steps=4, shape="linear")
    assert ctl.beta == 1.0  # before any update
    got = [ctl.update(0.0, 1) for _ in range(6)]
    # beta_k = 1 - 0.8 * k / 4: 0.8, 0.6 (midpoint), 0.4, 0.2, then it stays at 0.2
    assert got == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.2, 0.2], abs=1e-12)


def test_annealed_kl_cosine_end_points_and_midpoint():
    ctl = kl.AnnealedKL(1.0, 0.2, steps=4, shape="cosine")
    assert ctl.beta == 1.0
    got = [ctl.update(0.0, 1) for _ in range(5)]
    # k=1: frac = (1 - cos(pi/4)) / 2 = (1 - 0.70710678) / 2 = 0.14644661; 1 - 0.8 * that
    # k=2 (midpoint): frac = 1/2 -> 0.6; k=3: frac = 0.85355339 -> 0.31715729; k=4: 0.2
    assert got == pytest.approx([0.88284271, 0.6, 0.31715729, 0.2, 0.2], abs=1e-8)


def _controllers():
    return [kl.FixedKL(0.1), kl.AdaptiveKL(0.15, 6.0, 10000), kl.AnnealedKL(1.0, 0.0, 10, "cosine"),
            kl.AnnealedKL(0.5, 1.0, 3, "linear")]


@pytest.mark.parametrize("index", range(4))
def test_controller_state_round_trips_mid_run(index):
    ctl = _controllers()[index]
    for value in (12.0, 3.0):
        ctl.update(value, 512)
    state = json.loads(json.dumps(ctl.state_dict()))  # JSON-safe, as a checkpoint stores it
    fresh = type(ctl)(**_fresh_args(ctl))
    fresh.load_state_dict(state)
    assert fresh.beta == ctl.beta
    for value in (8.0, 1.0, 6.0, 20.0):  # the restored controller continues the same sequence
        assert fresh.update(value, 512) == ctl.update(value, 512)


def _fresh_args(ctl):
    # deliberately different settings, so only load_state_dict can make them agree
    if isinstance(ctl, kl.FixedKL):
        return {"beta": 9.0}
    if isinstance(ctl, kl.AdaptiveKL):
        return {"beta": 9.0, "target": 1.0, "horizon": 7}
    return {"start": 9.0, "end": 8.0, "steps": 100}


@pytest.mark.parametrize("make", [
    lambda: kl.FixedKL(-0.1),
    lambda: kl.AdaptiveKL(-0.1, 6.0),
    lambda: kl.AdaptiveKL(0.1, 0.0),
    lambda: kl.AdaptiveKL(0.1, -1.0),
    lambda: kl.AdaptiveKL(0.1, 6.0, horizon=0),
    lambda: kl.AnnealedKL(-1.0, 0.0, 10),
    lambda: kl.AnnealedKL(1.0, 0.0, 0),
    lambda: kl.AnnealedKL(1.0, 0.0, 10, shape="exponential"),
])
def test_controllers_reject_bad_arguments(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor([1.0, float("nan")])])
def test_controllers_reject_non_finite_kl(index, bad):
    ctl = _controllers()[index]
    beta = ctl.beta
    with pytest.raises(ValueError, match="KL"):
        ctl.update(bad, 512)
    assert ctl.beta == beta  # a bad KL leaves beta where it was
