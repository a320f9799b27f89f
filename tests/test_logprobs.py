"""tether.logprobs against the textbook log_softmax + gather, float64 references and
torch.distributions.Categorical, including many-chunk runs and bf16 inputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from tether import logprobs as logprobs_mod
from tether.logprobs import entropy, token_logprobs


def _naive(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


def _inputs(shape=(3, 5), vocab=17, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(*shape, vocab, generator=gen)).to(dtype)
    tokens = torch.randint(0, vocab, shape, generator=gen)
    return logits, tokens


def _value_and_grad(fn, logits, tokens, temperature, weights):
    x = logits.clone().requires_grad_()
    out = fn(x, tokens, temperature)
    (out * weights).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_matches_log_softmax_gather(temperature):
    logits, tokens = _inputs()
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(9))
    got, got_grad = _value_and_grad(token_logprobs, logits, tokens, temperature, weights)
    want, want_grad = _value_and_grad(_naive, logits, tokens, temperature, weights)
    assert got.shape == tokens.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_across_many_chunks(monkeypatch, temperature):
    # 3*5 = 15 rows at 4 rows per chunk: 4 chunks, the last one ragged, in forward and backward.
    logits, tokens = _inputs()
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(9))
    want, want_grad = _value_and_grad(_naive, logits, tokens, temperature, weights)
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 4 * 17)
    assert logprobs_mod.chunk_slices(15, 17) == [slice(0, 4), slice(4, 8), slice(8, 12),
                                                 slice(12, 15)]
    got, got_grad = _value_and_grad(token_logprobs, logits, tokens, temperature, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    # a chunk smaller than one row still means one row at a time
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_logits_give_fp32_accurate_logprobs(temperature):
    # The reference is the float64 computation on the *same* bf16 values upcast, so the only
    # error left is the implementation's own arithmetic: fp32-level (~1e-6), not bf16's ~1e-2.
    logits, tokens = _inputs(shape=(4, 8), vocab=1000, seed=1, dtype=torch.bfloat16)
    got = token_logprobs(logits, tokens, temperature)
    assert got.dtype == torch.float32
    reference = _naive(logits.double(), tokens, temperature)
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-5)
    # the check can fail: the textbook code run in bf16 is far off the same reference
    in_bf16 = _naive(logits, tokens, temperature).double()
    assert (in_bf16 - reference).abs().max() > 1e-3


def test_bf16_gradient_has_input_dtype_and_matches():
    logits, tokens = _inputs(shape=(2, 3), vocab=50, seed=2, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    token_logprobs(x, tokens).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    y = logits.double().requires_grad_()
    _naive(y, tokens).sum().backward()
    # gradient entries lie in [-1, 1]; bf16 keeps ~3 significant digits
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-2, atol=4e-3)


def test_token_logprobs_rejects_bad_input():
    logits, tokens = _inputs()
    with pytest.raises(ValueError, match="shape mismatch"):
        token_logprobs(logits, tokens[:, :4])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, -1.0)
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logits, torch.full_like(tokens, 17))  # vocabulary is 0..16
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logits, torch.full_like(tokens, -1))
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, tokens.float())


def test_token_logprobs_empty_batch():
    logits = torch.zeros(0, 4, 9)
    assert token_logprobs(logits, torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.4])
@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_entropy_matches_categorical(monkeypatch, temperature, chunk_rows):
    logits, _ = _inputs(seed=4)
    if chunk_rows:  # 15 rows at 2 per chunk: 8 chunks
        monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", chunk_rows * 17)
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    x = logits.clone().requires_grad_()
    got = entropy(x, temperature)
    (got * weights).sum().backward()
    y = logits.double().requires_grad_()
    want = Categorical(logits=y / temperature).entropy()
    (want * weights.double()).sum().backward()
    assert got.shape == (3, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-4, atol=1e-5)


def test_entropy_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        entropy(torch.zeros(2, 3), 0.0)
