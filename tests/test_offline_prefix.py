"""The prompt-shared pass gives the same log-probs and gradients as the concatenated pass."""

import pytest
import torch
from offline_fixtures import preference_rows

from tether.data import collate_pairs, encode_preferences
from tether.models import disable_dropout, load_causal_lm, load_tokenizer
from tether.train.dpo import pair_logprobs
from tether.train.prefix import can_share, collate_shared


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_matches_concatenated(tiny_model_dir, attention):
    tok = load_tokenizer(str(tiny_model_dir))
    model = disable_dropout(load_causal_lm(str(tiny_model_dir), tok))
    model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    rows = preference_rows(6, seed=4)
    rows[1]["chosen"] = " it"  # ragged lengths on both sides of the pad
    rows[2]["prompt"] = "the movie was fine and the plot was long"
    examples, _ = encode_preferences(tok, rows, max_length=64)
    assert can_share(model, examples)
    results = []
    for batch in (collate_pairs(examples, tok.pad_token_id), collate_shared(examples, tok.pad_token_id)):
        model.zero_grad()
        chosen, rejected, chosen_len, rejected_len = pair_logprobs(model, batch)
        (chosen.sum() - 2 * rejected.sum()).backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((chosen.detach(), rejected.detach(), chosen_len, rejected_len, grad))
    concat, shared = results
    for a, b in zip(concat[:4], shared[:4], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(concat[4], shared[4], atol=1e-5, rtol=1e-3)
    # lengths are the response tokens incl. EOS, e.g. " it" + EOS = 2 tokens
    assert shared[2][1].item() == len(tok(" it", add_special_tokens=False)["input_ids"]) + 1
    assert not can_share(model, [examples[0].__class__([], examples[0].responses)])
