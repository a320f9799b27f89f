"""The prompt-shared pass gives the same log-probs and gradients as the concatenated pass, on
every model family, including sliding-window attention (Mistral, Qwen2 with use_sliding_window)."""

import pytest
import torch
from offline_fixtures import preference_rows

from tether.data.batches import collate_pairs
from tether.data.encoding import encode_preferences
from tether.models import pair_row
from tether.models.pair_row import attention_layout, can_share, collate_shared
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.train.dpo import pair_logprobs

FAMILIES = ["tiny_model_dir", "tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir"]


def _load(model_dir, attention):
    tok = load_tokenizer(str(model_dir))
    model = disable_dropout(load_causal_lm(str(model_dir), tok))
    model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    return tok, model


def _pass(model, batch):
    """(chosen, rejected, chosen_len, rejected_len, flat gradient of chosen - 2 rejected)."""
    model.zero_grad()
    chosen, rejected, chosen_len, rejected_len = pair_logprobs(model, batch)
    (chosen.sum() - 2 * rejected.sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return chosen.detach(), rejected.detach(), chosen_len, rejected_len, grad


def _assert_same(concat, shared):
    for a, b in zip(concat[:4], shared[:4], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(concat[4], shared[4], atol=1e-5, rtol=1e-3)


def _rows():
    rows = preference_rows(6, seed=4)
    rows[1]["chosen"] = " it"  # ragged lengths on both sides of the pad
    rows[2]["prompt"] = "the movie was fine and the plot was long"
    # pairs longer than a window of 8: the window cuts into both the prompt and the responses
    rows[3]["chosen"] = " the film was long and the music was dull but the ending was fun great."
    return rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_matches_concatenated(family, attention, request):
    tok, model = _load(request.getfixturevalue(family), attention)
    examples, _ = encode_preferences(tok, _rows(), max_length=64)
    assert can_share(model, examples)
    concat = _pass(model, collate_pairs(examples, tok.pad_token_id))
    shared = _pass(model, collate_shared(examples, tok.pad_token_id))
    _assert_same(concat, shared)
    # lengths are the response tokens incl. EOS: " it" + EOS, tokenised after its prompt
    prompt = _rows()[1]["prompt"]
    it_ids = tok(prompt + " it")["input_ids"][len(tok(prompt)["input_ids"]):]
    assert shared[2][1].item() == len(it_ids) + 1
    assert not can_share(model, [examples[0].__class__([], examples[0].responses)])


@pytest.mark.parametrize("family", ["tiny_mistral_dir", "tiny_qwen2_dir"])
def test_window_matters_and_an_unwindowed_mask_would_be_wrong(family, request, monkeypatch):
    # The check above can fail: the same shared pass without the window (what a custom mask
    # silently did before) differs from the concatenated pass on these long pairs.
    tok, model = _load(request.getfixturevalue(family), "sdpa")
    kinds, window = attention_layout(model.config)
    assert window == 8 and "sliding_attention" in kinds
    examples, _ = encode_preferences(tok, _rows(), max_length=64)
    assert max(len(e.prompt) + len(r) for e in examples for r in e.responses) > 2 * window
    concat = _pass(model, collate_pairs(examples, tok.pad_token_id))
    monkeypatch.setattr(pair_row, "attention_layout", lambda config: ({"full_attention"}, None))
    unwindowed = _pass(model, collate_shared(examples, tok.pad_token_id))
    assert (concat[0] - unwindowed[0]).abs().max() > 1e-2
    assert (concat[4] - unwindowed[4]).norm() > 1e-2 * concat[4].norm()


def test_layouts_read_like_transformers(tiny_llama_dir):
    from transformers import AutoConfig, MistralConfig, Qwen2Config

    assert attention_layout(AutoConfig.from_pretrained(tiny_llama_dir)) == ({"full_attention"}, None)
    assert attention_layout(MistralConfig(sliding_window=8)) == ({"sliding_attention"}, 8)
    assert attention_layout(MistralConfig(sliding_window=None)) == ({"full_attention"}, None)
    # Qwen2 ignores sliding_window unless use_sliding_window, and only from max_window_layers up
    assert attention_layout(Qwen2Config(sliding_window=8, num_hidden_layers=2)) == ({"full_attention"}, None)
    mixed = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                        num_hidden_layers=2)
    assert attention_layout(mixed) == ({"full_attention", "sliding_attention"}, 8)
