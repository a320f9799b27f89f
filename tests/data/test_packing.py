"""Sequence packing and token-budget micro-batches (tether.data.packing, tether.models.packed):
the pack/unpack round trip against hand-built layouts, packed forwards against padded ones on
GPT-2 (absolute positions) and a Llama-style model (rotary), in float64, and the budget cutter
and rank balance against hand-computed answers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from tether.data.packing import pack_rows
from tether.models.forward import position_ids_from_mask
from tether.models.packed import block_causal_mask, packing_mode
from tether.models.trunk_head import response_logprobs, score_responses, trunk_and_head
from tether.run.distributed import Dist
from tether.run.slicing import balance_ranks, equal_counts, token_budget_cut, token_parts

# ----------------------------------------------------------------------------- pack / unpack

# Three rows of width 5: left padding, right padding, none, and a hole (row 3's middle slot).
MASK = torch.tensor([[0, 0, 1, 1, 1],
                     [1, 1, 0, 0, 0],
                     [1, 1, 1, 1, 1],
                     [1, 0, 1, 0, 0]])


def test_pack_fills_rows_of_the_longest_length_with_restarting_positions():
    packing = pack_rows(MASK)  # lengths 3, 2, 5, 2; rows of S = 5 slots
    # FFD into rows of 5: row 2 (5) fills packed row 0; row 0 (3) opens packed row 1, row 1 (2)
    # fills it; row 3 (2) opens packed row 2, whose last 3 slots are a tail
    assert (packing.packed_rows, packing.packed_width) == (3, 5)
    # real slots row-major: row 0 cols 2-4 (flat 2, 3, 4), row 1 cols 0-1 (5, 6), row 2 all
    # (10..14), row 3 cols 0 and 2 (15, 17)
    assert packing.index.tolist() == [2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 17]
    assert packing.slot.tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 10, 11]
    assert packing.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert packing.sequence_ids.tolist() == [[2, 2, 2, 2, 2], [0, 0, 0, 1, 1], [3, 3, -3, -3, -3]]
    assert packing.lengths.tolist() == [3, 2, 5, 2]
    # each real token's packed position is what the padded forward gives it
    padded_positions = position_ids_from_mask(MASK)
    assert torch.equal(packing.pack(padded_positions).reshape(-1)[packing.slot],
                       packing.position_ids.reshape(-1)[packing.slot])


def test_one_row_of_every_token():
    packing = pack_rows(MASK, width=12)
    assert packing.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]]
    assert packing.slot.tolist() == list(range(12))
    assert pack_rows(MASK, width=2).packed_width == 5  # never narrower than a sequence


def test_unpack_inverts_pack_and_fills_the_padding():
    values = torch.arange(20.0).reshape(4, 5, 1) * torch.tensor([1.0, -1.0])  # [B, L, 2]
    packing = pack_rows(MASK)
    packed = packing.pack(values, fill=99.0)
    assert packed.shape == (3, 5, 2)
    assert packed[0, :, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]  # row 2, all of it
    assert packed[2, :, 0].tolist() == [15.0, 17.0, 99.0, 99.0, 99.0]  # row 3, then the tail
    back = packing.unpack(packed, fill=-7.0)
    real = MASK.bool()
    assert torch.equal(back[real], values[real])
    assert bool((back[~real] == -7.0).all())


def test_unpack_passes_gradients_to_the_packed_values_only():
    packing = pack_rows(MASK)
    packed = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(4, 5, dtype=torch.float64)
    (packing.unpack(packed) * weights).sum().backward()
    expected = torch.zeros(15, dtype=torch.float64)
    expected[packing.slot] = weights.reshape(-1)[packing.index]  # tails get none
    assert torch.equal(packed.grad.reshape(-1), expected)


def test_block_causal_mask_by_hand():
    packing = pack_rows(torch.tensor([[1, 1, 0], [1, 1, 1]]), width=5)  # 2 and 3 tokens
    seen = block_causal_mask(packing, torch.float64, boolean=True)[0, 0].int()
    assert seen.tolist() == [[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]]
    additive = block_causal_mask(packing, torch.float64, boolean=False)[0, 0]
    assert bool(((additive == 0) == seen.bool()).all())
    assert float(additive.min()) == torch.finfo(torch.float64).min


# ----------------------------------------------------------------------------- packed forwards

VOCAB = 40


def _gpt2(attention: str = "sdpa"):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).double().eval()


def _llama(attention: str = "sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).double().eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _rollout_batch(seed: int = 1):
    """A rollout-layout batch: prompts left-padded to P = 5, responses right-padded to R = 6,
    every row a different prompt and response length."""
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = [5, 2, 4, 3], [6, 1, 3, 5]
    ids = torch.randint(3, VOCAB, (4, 11), generator=generator)
    mask = torch.zeros(4, 11, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        mask[row, 5 - p:5 + r] = 1
    ids = torch.where(mask.bool(), ids, 0)
    return ids, mask, mask[:, 5:].bool()


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("chunked", [True, False])
def test_packed_scores_equal_padded_in_float64(family, chunked):
    """Log-probs, entropies and hidden states of the response tokens, and the gradient of a loss
    on them, packed vs padded: the same to 1e-12 (float64). The padded forward is the reference:
    it attends over the padding with a mask, the packed one never sees it."""
    model = MODELS[family]()
    ids, mask, action = _rollout_batch()
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        scores = score_responses(model, ids, mask, 5, 0.7, chunked=chunked, entropy=True,
                                 hidden=True, mask=action, packed=packed)
        weights = torch.linspace(-1, 2, action.numel(), dtype=torch.float64).reshape(action.shape)
        (scores.logprobs * weights).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results.append((scores.logprobs.detach(), scores.entropy.detach(),
                        scores.hidden.detach()[action], grads))
    for padded, packed in zip(*results, strict=True):
        assert padded.shape == packed.shape
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-12)
    assert float(results[0][0].abs().sum()) > 0  # the scores are not all zeros


@pytest.mark.parametrize("family", MODELS)
def test_sft_logprobs_packed_equal_padded_and_differ_unpacked_across_rows(family):
    """SFT's right-padded batches: packed equals padded to 1e-12; the same tokens concatenated
    WITHOUT restarting positions (one long sequence) differ, so the test can tell."""
    model = MODELS[family]()
    ids, mask, _ = _rollout_batch(2)
    # right-pad every row (SFT's layout): real tokens first
    order = torch.argsort(1 - mask, dim=1, stable=True)
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": mask}
    padded, _ = response_logprobs(model, batch, chunked=True)
    packed, _ = response_logprobs(model, batch, chunked=True, packed=True)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-12)
    flat = ids[mask.bool()][None]
    one_sequence = model(input_ids=flat, use_cache=False).logits.log_softmax(-1)
    lengths = mask.sum(1).tolist()
    second_row_first = one_sequence[0, lengths[0]].gather(-1, flat[0, lengths[0] + 1:][:1])
    assert abs(float(second_row_first.detach()) - float(packed[1, 0].detach())) > 1e-6


@pytest.mark.parametrize("family", MODELS)
def test_transformers_detects_packing_from_positions(family):
    """transformers 5 builds the block-diagonal mask itself from restarting position ids (sdpa
    and eager); a model built with the padded forward's cache switched on does not (a cache
    turns the detection off), which is why the packed call passes use_cache=False."""
    for attention in ("sdpa", "eager"):
        model = MODELS[family](attention)
        trunk, _ = trunk_and_head(model)
        assert packing_mode(trunk, hidden=True) == "positions"
        assert packing_mode(model, hidden=False) == "positions"
    # with a cache (transformers' default in eval mode) the positions are not read as boundaries:
    # the second sequence attends to the first, and its logits change
    model = MODELS[family]()
    first, second = torch.arange(3, 8)[None], torch.arange(10, 14)[None]
    alone = model(input_ids=second, use_cache=False).logits[0]
    ids, positions = torch.cat([first, second], 1), torch.cat([torch.arange(5), torch.arange(4)])
    packed = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits[0, 5:]
    cached = model(input_ids=ids, position_ids=positions[None], use_cache=True).logits[0, 5:]
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    assert float((cached - alone).detach().abs().max()) > 1e-3


def test_eager_llama_packed_has_no_fully_masked_pad_rows():
    """Llama's eager attention takes its softmax in float32 whatever the model's dtype: a
    left-padded row's pad queries see nothing but float64's lowest value, their softmax is NaN,
    and the NaN reaches the real tokens through 0 x NaN in the next layer. A packed row has no
    pad queries, so packed eager gives the padded sdpa numbers (to float32's softmax precision)."""
    ids, mask, action = _rollout_batch()
    eager = score_responses(_llama("eager"), ids, mask, 5, 1.0, chunked=True, mask=action,
                            packed=True).logprobs
    sdpa = score_responses(_llama("sdpa"), ids, mask, 5, 1.0, chunked=True, mask=action).logprobs
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- token budgets

def test_budget_cut_by_hand():
    lengths = [3, 7, 4, 5, 3, 2]  # rows 0:3 1:7 2:4 3:5 4:3 5:2, budget 10
    # FFD, longest first (ties by index): row 1 (7) opens A (room 3); row 3 (5) does not fit A,
    # opens B (room 5); row 2 (4) -> B (room 1); row 0 (3) -> A (room 0); row 4 (3) fits
    # neither, opens C (room 7); row 5 (2) -> C. Totals 10, 9, 5.
    assert token_budget_cut(lengths, 10) == [[0, 1], [2, 3], [4, 5]]
    # a row over the budget runs alone; the rest still fill theirs
    assert token_budget_cut([12, 4, 5], 10) == [[0], [1, 2]]


def test_budget_cut_never_exceeds_the_budget_but_for_a_long_row_alone():
    generator = torch.Generator().manual_seed(0)
    for budget in (8, 50, 256, 300):
        lengths = torch.randint(1, 260, (64,), generator=generator).tolist()
        parts = token_budget_cut(lengths, budget)
        assert sorted(i for part in parts for i in part) == list(range(64))  # each row once
        for part in parts:
            total = sum(lengths[i] for i in part)
            assert total <= budget or (len(part) == 1 and lengths[part[0]] > budget)
        # FFD's bins beyond the first fit nothing an earlier one had room for, so at most one
        # bin is half empty or less: the count is within 1 of twice the lower bound
        fitting = [i for i in range(64) if lengths[i] <= budget]
        lower = -(-sum(lengths[i] for i in fitting) // budget)
        assert len(parts) - (64 - len(fitting)) <= 2 * lower + 1


def test_balance_ranks_by_hand():
    # lengths 9 8 7 6 5 4 over 2 ranks, LPT: 9 -> r0; 8 -> r1; 7 -> r1 (8 < 9); 6 -> r0 (9 < 15);
    # 5 -> r0 (15 = 15, lower rank); 4 -> r1 (15 < 20). Sums 20 and 19 (the best split is 20/19).
    lengths = [4, 9, 6, 8, 5, 7]  # rows 0:4 1:9 2:6 3:8 4:5 5:7
    ranks = balance_ranks(lengths, 2)
    assert ranks == [[1, 2, 4], [0, 3, 5]]
    assert [sum(lengths[i] for i in r) for r in ranks] == [20, 19]


def test_rank_cuts_give_every_rank_as_many_micro_batches():
    lengths = [4, 9, 6, 8, 5, 7]  # LPT (above): rank 0 rows 1, 2, 4 (9 6 5), rank 1 rows 0, 3, 5
    # budget 10: rank 0's FFD 9 | 6 | 5 (6 + 5 = 11), rank 1's 8 | 7 | 4: three each
    assert [len(c) for c in token_parts(lengths, 10, Dist(world_size=2))] == [3, 3]
    # budget 15: rank 0: 9 + 6 | 5; rank 1: 8 + 7 | 4
    assert token_parts(lengths, 15, Dist(world_size=2)) == [[[1, 2], [4]], [[3, 5], [0]]]
    # a rank with fewer splits its fullest micro-batch of 2+ rows (its last row moves out) ...
    assert equal_counts([[[0, 1, 2]], [[3], [4], [5]]], [1] * 6) == [
        [[0], [2], [1]], [[3], [4], [5]]]
    # ... and one made of single rows gets an empty filler
    assert equal_counts([[[0]], [[1], [2]]], [1] * 3) == [[[0], []], [[1], [2]]]


@pytest.mark.parametrize("family", MODELS)
def test_block_mask_fallback_equals_padded(family, monkeypatch):
    """The explicit block-diagonal mask (for a model that does not read restarting positions)
    gives the padded numbers too, to 1e-12."""
    from tether.models import packed as packed_module

    masks = []
    original = packed_module.block_causal_mask

    def recording(packing, dtype, boolean):
        masks.append(boolean)
        return original(packing, dtype, boolean)
    monkeypatch.setattr(packed_module, "packing_mode", lambda model, hidden: "block_mask")
    monkeypatch.setattr(packed_module, "block_causal_mask", recording)
    model = MODELS[family]()
    ids, mask, action = _rollout_batch(3)
    padded = score_responses(model, ids, mask, 5, 1.0, chunked=True, mask=action).logprobs
    forced = score_responses(model, ids, mask, 5, 1.0, chunked=True, mask=action,
                             packed=True).logprobs
    assert masks == [True]  # sdpa's boolean form, used once
    torch.testing.assert_close(forced, padded, rtol=0, atol=1e-12)
