"""The chunked LM head against the plain path (full logits -> tether.logprobs): values and
gradients to 1e-5 relative for every head shape the stages meet, and the model splitting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tether import kl, lm_head
from tether.lm_head import (
    head_entropy,
    head_exact_kl,
    head_token_logprobs,
    masked_head_token_logprobs,
)
from tether.logprobs import entropy, token_logprobs
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.trunk_head import final_hidden, trunk_and_head

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture
def many_chunks(monkeypatch):
    """Shrink the chunks so every test crosses several of them (and a ragged last one)."""
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 3 * 37)


def grads_of(loss_fn, *tensors):
    """Gradients of loss_fn() with respect to each tensor (None where it gets none)."""
    for t in tensors:
        t.grad = None
    loss_fn().backward()
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def assert_same(got, expected, **tol):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **(tol or TOL))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("trainable", [False, True])
def test_linear_head_matches_plain_path(many_chunks, bias, temperature, trainable):
    torch.manual_seed(0)
    head = nn.Linear(16, 37, bias=bias).requires_grad_(trainable)  # 3 rows a chunk: 5 chunks
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    tokens = torch.randint(0, 37, (2, 7))
    weights = torch.randn(2, 7)  # an arbitrary upstream gradient g, not all ones
    params = [hidden] + [p for p in head.parameters() if p.requires_grad]
    chunked = head_token_logprobs(hidden, head, tokens, temperature)
    plain = token_logprobs(head(hidden), tokens, temperature)
    assert chunked.dtype == torch.float32 and chunked.shape == (2, 7)
    torch.testing.assert_close(chunked, plain, **TOL)
    assert_same(grads_of(lambda: (head_token_logprobs(hidden, head, tokens, temperature)
                                  * weights).sum(), *params),
                grads_of(lambda: (token_logprobs(head(hidden), tokens, temperature)
                                  * weights).sum(), *params))


def test_linear_head_hand_computed():
    # W = [[1, 0], [0, 1], [0, 0]], h = [ln 2, 0], no bias: logits [ln 2, 0, 0], softmax
    # [1/2, 1/4, 1/4], so log p(token 0) = ln(1/2); d/dh = (onehot - p) W = [1/2, -1/4].
    head = nn.Linear(2, 3, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    hidden = torch.tensor([[torch.log(torch.tensor(2.0)).item(), 0.0]], requires_grad=True)
    out = head_token_logprobs(hidden, head, torch.tensor([0]))
    out.sum().backward()
    torch.testing.assert_close(out, torch.log(torch.tensor([0.5])))
    torch.testing.assert_close(hidden.grad, torch.tensor([[0.5, -0.25]]))


def test_peaked_distribution_keeps_relative_accuracy():
    # p(y) -> 1 makes d log p(y)/dh = (w_y (1 - p_y) - sum_{v != y} p_v w_v) small; forms that
    # subtract nearly equal numbers (w_y - E_p[w], or 1 - p_y from a rounded p_y, as the plain
    # path's onehot - softmax does) lose digits there. Truth: the plain path in float64.
    torch.manual_seed(1)
    head = nn.Linear(8, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(4, 8)
    tokens = head(hidden).argmax(-1)
    hidden = (hidden * 40).requires_grad_(True)  # sharpen: 1 - p(y) ~ 1e-3 on the peakiest row
    h64 = hidden.detach().double().requires_grad_(True)
    log_p64 = torch.log_softmax(h64 @ head.weight.double().T, -1).gather(-1, tokens[:, None])
    assert (1 - log_p64.exp()).min() < 3e-3
    log_p64.sum().backward()

    def worst_relative_error(grad):
        return ((grad.double() - h64.grad).norm(dim=-1) / h64.grad.norm(dim=-1)).max().item()

    chunked = grads_of(lambda: head_token_logprobs(hidden, head, tokens).sum(), hidden)[0]
    plain = grads_of(lambda: token_logprobs(head(hidden), tokens).sum(), hidden)[0]
    assert worst_relative_error(chunked) < 1e-5
    assert worst_relative_error(plain) > 1e-5  # the fp32 plain path does lose digits here


def test_tied_embeddings_gpt2(many_chunks, tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), tok)
    model.eval()
    trunk, head = trunk_and_head(model)
    assert head.weight is model.get_input_embeddings().weight  # GPT-2 ties them
    ids = torch.randint(0, len(tok), (3, 9))
    mask = torch.ones_like(ids)
    params = list(model.parameters())

    def chunked():
        hidden = final_hidden(trunk, ids, mask)
        return (head_token_logprobs(hidden[:, :-1], head, ids[:, 1:], 0.8) * 1.5).sum()

    def plain():
        logits = model(input_ids=ids, attention_mask=mask).logits
        return (token_logprobs(logits[:, :-1], ids[:, 1:], 0.8) * 1.5).sum()

    torch.testing.assert_close(chunked(), plain(), **TOL)
    got, expected = grads_of(chunked, *params), grads_of(plain, *params)
    # the tied matrix gets both gradients: the embedding lookup's and the head's
    assert_same(got, expected, rtol=1e-5, atol=1e-5)


def test_lora_wrapped_head(many_chunks, tiny_llama_dir):
    peft = pytest.importorskip("peft")
    tok = load_tokenizer(str(tiny_llama_dir))
    base = load_causal_lm(str(tiny_llama_dir), tok)
    # init_lora_weights=False: B starts random, so lora_A gets a nonzero gradient too
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["lm_head"],
                                                      init_lora_weights=False))
    model.eval()
    trunk, head = trunk_and_head(model)
    assert not lm_head.is_plain_linear(head)  # peft's lora.Linear: the checkpointed path
    ids = torch.randint(0, len(tok), (2, 11))
    mask = torch.ones_like(ids)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert len(lora) == 2

    def chunked():
        hidden = final_hidden(trunk, ids, mask)
        return head_token_logprobs(hidden[:, :-1], head, ids[:, 1:], 1.3).sum()

    def plain():
        logits = model(input_ids=ids, attention_mask=mask).logits
        return token_logprobs(logits[:, :-1], ids[:, 1:], 1.3).sum()

    torch.testing.assert_close(chunked(), plain(), **TOL)
    got = grads_of(chunked, *lora)
    assert all(g is not None and g.abs().sum() > 0 for g in got)
    assert_same(got, grads_of(plain, *lora))


def test_bf16_autocast_gives_fp32_close_to_fp32(many_chunks):
    torch.manual_seed(2)
    head = nn.Linear(32, 37)
    hidden = torch.randn(4, 5, 32, requires_grad=True)
    tokens = torch.randint(0, 37, (4, 5))
    params = [hidden, head.weight, head.bias]
    fp32 = head_token_logprobs(hidden, head, tokens)
    fp32_grads = grads_of(lambda: head_token_logprobs(hidden, head, tokens).sum(), *params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = head_token_logprobs(hidden, head, tokens)
        plain = token_logprobs(head(hidden), tokens)
        bf16_grads = grads_of(lambda: head_token_logprobs(hidden, head, tokens).sum(), *params)
        plain_grads = grads_of(lambda: token_logprobs(head(hidden), tokens).sum(), *params)
    assert bf16.dtype == torch.float32
    assert [g.dtype for g in bf16_grads] == [torch.float32] * 3
    assert not torch.equal(bf16, fp32)  # the matmul really ran in bf16
    # bf16 has an 8-bit mantissa: logits carry ~0.4% relative error
    torch.testing.assert_close(bf16, fp32, rtol=0.02, atol=0.05)
    torch.testing.assert_close(bf16, plain, rtol=0.02, atol=0.05)
    assert_same(bf16_grads, fp32_grads, rtol=0.05, atol=0.05)
    assert_same(bf16_grads, plain_grads, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("trainable", [False, True])
def test_masked_logprobs_only_score_masked_positions(many_chunks, trainable):
    torch.manual_seed(3)
    head = nn.Linear(8, 37).requires_grad_(trainable)
    hidden = torch.randn(3, 6, 8, requires_grad=True)
    tokens = torch.randint(0, 37, (3, 6))
    mask = torch.rand(3, 6) > 0.4
    got = masked_head_token_logprobs(hidden, head, tokens, mask)
    torch.testing.assert_close(got, token_logprobs(head(hidden), tokens) * mask, **TOL)
    got.sum().backward()
    assert hidden.grad[~mask].abs().max() == 0  # unmasked rows never reached the head


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_and_exact_kl_match_full_logits(many_chunks, temperature):
    torch.manual_seed(4)
    head, ref_head = nn.Linear(8, 37), nn.Linear(8, 37).requires_grad_(False)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    ref_hidden = hidden.detach() + 0.3 * torch.randn(3, 5, 8)
    params = [hidden, head.weight, head.bias]
    torch.testing.assert_close(head_entropy(hidden, head, temperature),
                               entropy(head(hidden), temperature), **TOL)
    assert_same(grads_of(lambda: head_entropy(hidden, head, temperature).sum(), *params),
                grads_of(lambda: entropy(head(hidden), temperature).sum(), *params))
    got = head_exact_kl(hidden, head, ref_hidden, ref_head, temperature)
    torch.testing.assert_close(got, kl.exact(head(hidden), ref_head(ref_hidden), temperature),
                               **TOL)
    assert (got > 0).all()
    assert_same(grads_of(lambda: head_exact_kl(hidden, head, ref_hidden, ref_head,
                                               temperature).sum(), *params),
                grads_of(lambda: kl.exact(head(hidden), ref_head(ref_hidden),
                                          temperature).sum(), *params))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_scoring_pass_is_bitwise_the_update_path(many_chunks, temperature):
    # Rollout scoring takes log-probs and entropies in one no-grad pass; the PPO update takes
    # log-probs with gradients. Its first-epoch ratio is exactly 1 only if they are bitwise equal.
    torch.manual_seed(5)
    head = nn.Linear(8, 37)
    hidden = torch.randn(3, 5, 8) * 3
    tokens = torch.randint(0, 37, (3, 5))
    with torch.no_grad():
        scored, entropies = lm_head.head_logprobs_and_entropy(hidden, head, tokens, temperature)
    for trainable in (True, False):
        head.requires_grad_(trainable)
        updated = head_token_logprobs(hidden.clone().requires_grad_(True), head, tokens,
                                      temperature)
        assert torch.equal(scored, updated.detach())
    torch.testing.assert_close(entropies, entropy(head(hidden), temperature), **TOL)
    with torch.no_grad():
        torch.testing.assert_close(head_entropy(hidden, head, temperature), entropies, **TOL)


def test_bad_input():
    head = nn.Linear(4, 5)
    with pytest.raises(ValueError, match="token ids must lie in"):
        head_token_logprobs(torch.randn(2, 4), head, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="shape mismatch"):
        head_token_logprobs(torch.randn(2, 4), head, torch.tensor([0]))
    with pytest.raises(ValueError, match="temperature"):
        head_token_logprobs(torch.randn(2, 4), head, torch.tensor([0, 1]), 0.0)
