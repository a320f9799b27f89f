"""Property tests for the maths layer over random small shapes, ragged masks, dtypes and
temperatures. Tensors come from a seeded torch generator (the seed is drawn by hypothesis), so
each example is cheap and any failure is reproducible from the printed seed."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether import kl
from tether.advantages import gae, kl_shaped_rewards, whiten
from tether.logprobs import token_logprobs

FAST = settings(max_examples=40, deadline=None)

seeds = st.integers(0, 2**31 - 1)
batch_sizes = st.integers(1, 3)
lengths = st.integers(1, 6)
vocab_sizes = st.integers(2, 20)
temperatures = st.floats(0.3, 2.0)
logit_scales = st.floats(0.1, 10.0)
logit_dtypes = st.sampled_from([torch.float32, torch.bfloat16])


def ragged_mask(gen, batch, width):
    """Right-padded [B, T] mask with every row length in 1..T (EOS anywhere, or truncated)."""
    row_lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    return torch.arange(width)[None, :] < row_lengths[:, None]


@FAST
@given(seeds, batch_sizes, lengths, vocab_sizes, temperatures, logit_scales, logit_dtypes)
def test_token_logprobs_non_positive_and_match_naive(seed, batch, width, vocab, temperature,
                                                     scale, dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(batch, width, vocab, generator=gen)).to(dtype)
    tokens = torch.randint(0, vocab, (batch, width), generator=gen)
    got = token_logprobs(logits, tokens, temperature)
    assert (got <= 0).all()  # x_y - logsumexp(x) with logsumexp >= max(x), even in rounding
    # float64 reference on the same (possibly bf16) values: fp32-level agreement
    want = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None])
    torch.testing.assert_close(got.double(), want.squeeze(-1), rtol=1e-5, atol=1e-4)


@FAST
@given(seeds, batch_sizes, vocab_sizes, temperatures, logit_scales, logit_dtypes)
def test_exact_kl_non_negative(seed, batch, vocab, temperature, scale, dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(batch, 3, vocab, generator=gen)).to(dtype)
    ref_logits = (scale * torch.randn(batch, 3, vocab, generator=gen)).to(dtype)
    # Gibbs' inequality: KL >= 0; fp32 cancellation may leave a tiny negative
    assert (kl.exact(logits, ref_logits, temperature) >= -1e-5).all()
    assert (kl.exact(logits, logits, temperature).abs() <= 1e-5).all()


log_ratio_values = st.floats(-1000.0, 1000.0, allow_nan=False, width=32)


@FAST
@given(st.lists(log_ratio_values, min_size=1, max_size=16))
def test_k2_k3_non_negative(values):
    d = torch.tensor(values, dtype=torch.float32)
    zeros = torch.zeros_like(d)
    k3 = kl.estimate(d, zeros, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()  # log r <= r - 1, and the clamp
    assert (kl.estimate(d, zeros, "k2") >= 0).all()


@FAST
@given(seeds, batch_sizes, lengths, st.floats(0.0, 1.0), st.sampled_from(kl.ESTIMATORS))
def test_shaped_rewards_row_sums(seed, batch, width, beta, estimator):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, batch, width)
    logprobs = -4 * torch.rand(batch, width, generator=gen)
    ref_logprobs = -4 * torch.rand(batch, width, generator=gen)
    scores = torch.randn(batch, generator=gen)
    rewards, kl_per_token = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, beta,
                                              estimator)
    # R_total = score - beta * KL(sequence), summed over the real tokens of each row
    torch.testing.assert_close(rewards.sum(-1), scores - beta * kl_per_token.sum(-1),
                               rtol=1e-5, atol=1e-5)
    assert (rewards[~mask] == 0).all() and (kl_per_token[~mask] == 0).all()


@FAST
@given(seeds, batch_sizes, lengths, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_zero_on_padding(seed, batch, width, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, batch, width)
    rewards = torch.randn(batch, width, generator=gen)
    values = torch.randn(batch, width, generator=gen)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()
    # returns - advantages recovers the values on real tokens
    torch.testing.assert_close((returns - advantages)[mask], values[mask])


@FAST
@given(seeds, batch_sizes, lengths, st.floats(-5.0, 5.0), st.floats(0.5, 10.0), st.booleans())
def test_whiten_invariants(seed, batch, width, shift, scale, shift_mean):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, batch, width)
    x = shift + scale * torch.randn(batch, width, generator=gen)
    out = whiten(x, mask, shift_mean=shift_mean)
    assert (out[~mask] == 0).all()
    real, original = out[mask].double(), x[mask].double()
    if original.numel() < 2 or float(original.std(unbiased=False)) < 1e-2:
        return  # one real token, or (near) constant: nothing to standardise
    expected_mean = 0.0 if shift_mean else float(original.mean())
    assert math.isclose(float(real.mean()), expected_mean, abs_tol=1e-4)
    assert math.isclose(float(real.std(unbiased=False)), 1.0, rel_tol=1e-3)
