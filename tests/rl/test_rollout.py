"""Rollouts: sampling semantics, KV cache vs full forward, stop strings, and scoring the same
tokens with the right positions (batch invariance under left and right padding)."""

from __future__ import annotations

import pytest
import torch

from tether.advantages import kl_shaped_rewards
from tether.logprobs import token_logprobs
from tether.models.forward import position_ids_from_mask, response_logits
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.tiny import make_lm
from tether.rl.engines.native import inverse_cdf_sample, sample_responses
from tether.rl.rollout import Rollout, apply_stop_strings, sampling_uniforms


def _eval(model):
    return disable_dropout(model).eval()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    policy = _eval(load_causal_lm(str(tiny_model_dir), tokenizer))
    return tokenizer, policy


def sequence_logprobs(model, input_ids, attention_mask, temperature: float = 1.0):
    """log pi(x_t | x_<t) / T-scaled for every token t >= 1 of any padding layout: [B, L - 1],
    to check batch invariance under right padding."""
    logits, _ = response_logits(model, input_ids, attention_mask, context_length=1)
    return token_logprobs(logits, input_ids[:, 1:], temperature)


def _left_pad(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def test_masks_follow_sampling_and_pad_is_never_eos(tiny):
    tokenizer, policy = tiny
    pad = tokenizer.pad_token_id
    assert pad != tokenizer.eos_token_id
    prompts = [tokenizer(t)["input_ids"] for t in ("the movie", "a very long boring plot and", "it")]
    ids, mask = _left_pad(prompts * 8, pad)
    # Half the vocabulary ends a response, so rows end at many different lengths.
    eos_ids = list(range(0, len(tokenizer), 2))
    gen = torch.Generator().manual_seed(0)
    rollout = sample_responses(policy, ids, mask, max_new_tokens=6, temperature=1.0,
                               eos_token_ids=eos_ids, pad_token_id=pad, generator=gen)
    resp, rmask = rollout.responses, rollout.response_mask
    lengths = rmask.sum(1)
    assert len(set(lengths.tolist())) > 1, "want rows of different lengths"
    for row in range(len(rollout)):
        n = int(lengths[row])
        assert rmask[row, :n].all() and not rmask[row, n:].any()  # a prefix
        ends_with_eos = int(resp[row, n - 1]) in eos_ids
        assert bool(rollout.ended[row]) == ends_with_eos
        assert ends_with_eos or n == resp.shape[1]  # only truncated rows run to the end
        assert not any(int(t) in eos_ids for t in resp[row, :n - 1])  # stops at the first EOS
        assert (resp[row, n:] == pad).all()
    assert rollout.attention_mask[:, rollout.context_length:].bool().equal(rmask)


def test_sampling_frequencies_match_softmax_at_temperature():
    # A 12-token vocabulary and 20k one-token samples: the empirical distribution must match
    # softmax(logits / T) over the WHOLE vocabulary (no top-k / top-p truncation). The TV of a
    # 20k-sample empirical distribution over 12 outcomes is about 0.01 by chance.
    model = _eval(make_lm(12, n_layer=1, n_embd=16, seed=3))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # make the distribution far from uniform
    prompt = torch.tensor([[1, 2, 3]])
    temperature = 0.7
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompt).logits[0, -1] / temperature, -1)
    assert probs.max() > 0.3 and probs.min() < 0.01  # a peaked, long-tailed distribution
    n = 20000
    rollout = sample_responses(model, prompt.repeat(n, 1), torch.ones(n, 3, dtype=torch.long),
                               max_new_tokens=1, temperature=temperature, eos_token_ids=[0],
                               pad_token_id=11, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(rollout.responses[:, 0], minlength=12).double() / n
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.03
    assert (freq[probs < 0.01] > 0).any()  # the tail is sampled: nothing was cut off


def test_kv_cached_sampling_matches_full_forward_sampling(tiny):
    # Same generator seed, two implementations: the cached sampler, and a naive loop that re-runs
    # the whole (left-padded) sequence each step. Identical tokens show that the cache, the
    # attention mask and the position ids of generated tokens are right.
    tokenizer, policy = tiny
    pad = tokenizer.pad_token_id
    ids, mask = _left_pad([tokenizer(t)["input_ids"] for t in ("the", "a good film and the")], pad)
    ids, mask = ids.repeat(3, 1), mask.repeat(3, 1)
    cached = sample_responses(policy, ids, mask, max_new_tokens=8, temperature=0.9,
                              eos_token_ids=[tokenizer.eos_token_id], pad_token_id=pad,
                              generator=torch.Generator().manual_seed(5))
    # The sampler's rule, written out: row b's step-t uniform u picks the first token whose
    # cumulative probability reaches (1 - u) * total.
    uniforms = torch.rand((ids.shape[0], 8), generator=torch.Generator().manual_seed(5))
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for step in range(8):
            logits = policy(input_ids=seq, attention_mask=seq_mask,
                            position_ids=position_ids_from_mask(seq_mask)).logits[:, -1]
            cdf = torch.softmax(logits / 0.9, -1).cumsum(-1)
            token = torch.stack([(cdf[b] < (1 - uniforms[b, step]) * cdf[b, -1]).sum()
                                 for b in range(len(cdf))])[:, None]
            seq = torch.cat([seq, token], 1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(token)], 1)
    # No EOS was sampled in these rows (checked), so every row ran the full 8 tokens.
    assert cached.response_mask.all()
    assert cached.input_ids.equal(seq)


def test_stop_strings_cut_after_the_completing_token(tiny):
    tokenizer, _ = tiny
    pad = tokenizer.pad_token_id
    prompt = tokenizer("the")["input_ids"]
    first = tokenizer("good film. and more")["input_ids"]
    second = tokenizer("plot and")["input_ids"]
    width = max(len(first), len(second))
    responses = torch.full((2, width), pad)
    responses[0, :len(first)] = torch.tensor(first)
    responses[1, :len(second)] = torch.tensor(second)
    rmask = responses != pad
    rollout = Rollout(input_ids=torch.cat([torch.tensor([prompt, prompt]), responses], 1),
                      attention_mask=torch.cat([torch.ones(2, len(prompt), dtype=torch.long),
                                                rmask.long()], 1),
                      response_mask=rmask, ended=torch.tensor([False, False]),
                      context_length=len(prompt))
    cut = apply_stop_strings(rollout, tokenizer, ["."], pad)
    # Row 0 keeps exactly the tokens up to the first one whose text completes ".".
    n = int(cut.response_mask[0].sum())
    assert tokenizer.decode(first[:n]).endswith(".") or "." in tokenizer.decode(first[n - 1:n])
    assert "." not in tokenizer.decode(first[:n - 1])
    assert bool(cut.ended[0]) and (cut.responses[0, n:] == pad).all()
    # Row 1 has no stop string: unchanged.
    assert not bool(cut.ended[1]) and cut.response_mask[1].equal(rmask[1])


def test_response_logprobs_match_naive_log_softmax(tiny):
    # Independent truth: the model on the unpadded sequence with default positions, a full
    # log_softmax of logits / T, and the response token at position P - 1 + t.
    tokenizer, policy = tiny
    prompt = tokenizer("the movie was")["input_ids"]
    response = tokenizer(" very good fun")["input_ids"]
    seq = torch.tensor([prompt + response])
    temperature = 0.7
    with torch.no_grad():
        naive_logits = policy(input_ids=seq).logits[0]
        naive = torch.log_softmax(naive_logits / temperature, -1)
        expected = torch.stack([naive[len(prompt) - 1 + t, tok] for t, tok in enumerate(response)])
        logits, _ = response_logits(policy, seq, torch.ones_like(seq), len(prompt))
        got = token_logprobs(logits, seq[:, len(prompt):], temperature)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_batch_invariance_left_and_right_padding(tiny):
    # Sequences of different prompt and response lengths, scored in one batch with left-padded
    # prompts (the rollout layout) and with plain right padding, must give the per-sequence
    # log-probs, KL and shaped rewards each gives alone.
    tokenizer, policy = tiny
    torch.manual_seed(0)
    reference = _eval(make_lm(len(tokenizer), seed=11))
    pad = tokenizer.pad_token_id
    items = [("the", " good film."), ("a very long and boring plot with", " fun"),
             ("it was", " the ending was short and dull")]
    prompts = [tokenizer(p)["input_ids"] for p, _ in items]
    responses = [tokenizer(r)["input_ids"] for _, r in items]
    scores = torch.tensor([0.5, -1.0, 2.0])
    temperature, beta = 0.8, 0.3

    def shaped(lp, ref_lp, mask, score):
        rewards, kl = kl_shaped_rewards(score, lp, ref_lp, mask, beta)
        return [r[m] for r, m in zip(rewards, mask, strict=True)], kl.sum(1)

    with torch.no_grad():
        alone = []
        for p, r, s in zip(prompts, responses, scores, strict=True):
            seq = torch.tensor([p + r])
            lp = sequence_logprobs(policy, seq, torch.ones_like(seq), temperature)[:, len(p) - 1:]
            ref = sequence_logprobs(reference, seq, torch.ones_like(seq),
                                    temperature)[:, len(p) - 1:]
            mask = torch.ones_like(lp, dtype=torch.bool)
            rewards, kl = shaped(lp, ref, mask, s[None])
            alone.append((lp[0], kl[0], rewards[0]))

        # Left-padded prompts, right-padded responses: responses start at one column P.
        p_ids, p_mask = _left_pad(prompts, pad)
        width = max(len(r) for r in responses)
        r_ids = torch.full((3, width), pad)
        r_mask = torch.zeros((3, width), dtype=torch.bool)
        for i, r in enumerate(responses):
            r_ids[i, :len(r)] = torch.tensor(r)
            r_mask[i, :len(r)] = True
        ids = torch.cat([p_ids, r_ids], 1)
        attn = torch.cat([p_mask, r_mask.long()], 1)
        P = p_ids.shape[1]
        lp = token_logprobs(response_logits(policy, ids, attn, P)[0], r_ids, temperature)
        ref = token_logprobs(response_logits(reference, ids, attn, P)[0], r_ids, temperature)
        rewards_l, kl_l = shaped(lp * r_mask, ref * r_mask, r_mask, scores)
        left = list(zip(lp, kl_l, rewards_l, strict=True))

        # Plain right padding: prompt + response contiguous, pads at the end.
        full = [p + r for p, r in zip(prompts, responses, strict=True)]
        L = max(len(f) for f in full)
        ids = torch.full((3, L), pad)
        attn = torch.zeros((3, L), dtype=torch.long)
        resp_mask = torch.zeros((3, L - 1), dtype=torch.bool)  # over tokens 1..L-1
        for i, (p, f) in enumerate(zip(prompts, full, strict=True)):
            ids[i, :len(f)] = torch.tensor(f)
            attn[i, :len(f)] = 1
            resp_mask[i, len(p) - 1:len(f) - 1] = True
        lp_r = sequence_logprobs(policy, ids, attn, temperature)
        ref_r = sequence_logprobs(reference, ids, attn, temperature)
        rewards_r, kl_r = shaped(lp_r * resp_mask, ref_r * resp_mask, resp_mask, scores)

    for i, (lp_alone, kl_alone, rew_alone) in enumerate(alone):
        n = len(responses[i])
        lp_left, kl_left, rew_left = left[i]
        torch.testing.assert_close(lp_left[:n], lp_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kl_left, kl_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rew_left, rew_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp_r[i][resp_mask[i]], lp_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kl_r[i], kl_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rewards_r[i], rew_alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0][1], torch.zeros(())), "policy and reference must differ"


def test_inverse_cdf_sample_by_hand():
    # probs [0.2, 0, 0.5, 0.3]: cdf [0.2, 0.2, 0.7, 1.0]. target (1 - u) * 1.0:
    # u=0.9 -> 0.1 -> token 0; u=0.75 -> 0.25 -> token 2 (token 1 has probability 0, skipped);
    # u=0.0 -> 1.0 -> token 3; u=0.5 -> 0.5 -> token 2.
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).repeat(4, 1)
    u = torch.tensor([0.9, 0.75, 0.0, 0.5])
    assert inverse_cdf_sample(probs, u).tolist() == [0, 2, 3, 2]
    # A zero-probability first token is never chosen, even at the top end of u.
    assert inverse_cdf_sample(torch.tensor([[0.0, 1.0]]), torch.tensor([0.999999])).item() == 1


def test_inverse_cdf_sample_frequencies():
    # 20000 draws from a 5-token distribution land within 4 standard errors of it.
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(inverse_cdf_sample(probs.expand(20000, 5), u), minlength=5)
    freq = counts.double() / 20000
    se = (probs.double() * (1 - probs.double()) / 20000).sqrt()
    assert ((freq - probs.double()).abs() < 4 * se).all()


def test_samples_do_not_depend_on_the_batch_split(tiny):
    # One global batch sampled whole, and as two halves with their rows' slices of the same
    # uniforms (two ranks): the same tokens in every row.
    tokenizer, policy = tiny
    pad = tokenizer.pad_token_id
    texts = ["the", "a good film and the", "the plot", "a"]
    ids, mask = _left_pad([tokenizer(t)["input_ids"] for t in texts], pad)
    uniforms = sampling_uniforms(11, 4, 6)
    kw = dict(max_new_tokens=6, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
              pad_token_id=pad)
    whole = sample_responses(policy, ids, mask, uniforms=uniforms, **kw)
    for rows in (slice(0, 2), slice(2, 4)):
        part_ids, part_mask = _left_pad([tokenizer(t)["input_ids"] for t in texts[rows]], pad)
        part = sample_responses(policy, part_ids, part_mask, uniforms=uniforms[rows], **kw)
        width = part.responses.shape[1]
        assert part.responses.equal(whole.responses[rows, :width])
        assert not whole.response_mask[rows, width:].any()
