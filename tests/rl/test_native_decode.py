"""The native engine's decoding (tether.rl.engines.native: the prefill of each distinct prompt,
then the KV-cached `ModelForward` step) against two independent truths: the model's full forward
over the whole sequence (no cache), and the samples drawn with every row's prompt run (no prompt
sharing), on GPT-2, Llama (rotary, GQA, BOS), Mistral (sliding window of 8 columns) and Qwen2
(full attention below, a window of 8 above), plain and with LoRA."""

from __future__ import annotations

import pytest
import torch
from conftest import sample_texts

from tether.models import forward as shared_prompt
from tether.models.forward import position_ids_from_mask
from tether.models.lora import LoraSpec, add_adapter
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.rl.engines.native import ModelForward, prefill, sample_responses
from tether.rl.rollout import left_pad, sampling_uniforms

TEXTS = ["the", "a good film and the plot was very long and boring but the", "the movie was",
         "it", "fun and quite loved", "the ending was short and the music was dull and"]
FIXTURES = {"gpt2": "tiny_model_dir", "llama": "tiny_llama_dir", "mistral": "tiny_mistral_dir",
            "qwen2": "tiny_qwen2_dir"}
CASES = ["gpt2", "llama", "mistral", "qwen2", "gpt2+lora", "llama+lora"]


def _model(request, case: str, dtype=torch.float32, peft_wrapper: bool = False):
    """(tokenizer, model in eval mode); "+lora": peft LoRA on every linear layer with non-zero B,
    so the adapter changes the output and the decoder must run it (the PeftModel itself with
    `peft_wrapper`, else the transformers model it injected the LoRA layers into)."""
    path = str(request.getfixturevalue(FIXTURES[case.split("+")[0]]))
    tokenizer = load_tokenizer(path)
    model = disable_dropout(load_causal_lm(path, tokenizer)).to(dtype).eval()
    if case.endswith("+lora"):
        peft = add_adapter(model, LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear"))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
        # PPO samples from the transformers model, its LoRA layers injected in place.
        model = peft if peft_wrapper else peft.get_base_model()
    return tokenizer, model


def _prompts(tokenizer, repeats: int = 1, more: int = 0):
    """TEXTS (+ `more` random ones), each `repeats` times in a row, left-padded."""
    texts = TEXTS + sample_texts(more, seed=7)
    rows = [tokenizer(t)["input_ids"] for t in texts for _ in range(repeats)]
    return left_pad(rows, tokenizer.pad_token_id, "cpu")


@pytest.mark.parametrize("case", CASES + ["llama-bf16"])
def test_decode_step_logits_match_the_full_forward(request, case):
    # Teacher-forced tokens; rows finish at different steps (then feed pads with attention 0).
    # Each step's logits on rows still alive must equal the full forward's at that column: the
    # forward without any cache, positions from the mask, transformers' own masks (padding,
    # sliding window over columns). 12 steps pass Mistral's and Qwen2's window of 8.
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    tokenizer, model = _model(request, case.removesuffix("-bf16"), dtype)
    ids, mask = _prompts(tokenizer)
    batch, width = ids.shape
    steps = 12
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, len(tokenizer), (batch, steps), generator=gen)
    finish = torch.tensor([steps, 3, steps, 7, 10, steps])  # row b is alive at step t < finish
    alive = torch.arange(steps)[None, :] < finish[:, None]  # [B, steps]
    with torch.no_grad():
        positions = position_ids_from_mask(mask)
        first, cache = prefill(model, ids, mask, positions, dedupe=False)
        decoder = ModelForward(model, cache, mask, positions[:, -1:] + 1)
        steps_logits = [first] + [decoder.step(tokens[:, t], alive[:, t]) for t in range(steps)]
        full_ids = torch.cat([ids, torch.where(alive, tokens, tokenizer.pad_token_id)], 1)
        full_mask = torch.cat([mask, alive.long()], 1)
        full = model(input_ids=full_ids, attention_mask=full_mask,
                     position_ids=position_ids_from_mask(full_mask)).logits
    # Logits are ~0.5 in size: float32 agrees to ~2e-7 (measured); bfloat16 to within 2 of its
    # ulps (2^-8 at 0.5): the forward's own rounding, not a wrong column or position.
    tol = dict(rtol=0, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for t in range(steps + 1):
        rows = alive[:, t - 1] if t > 0 else torch.ones(batch, dtype=torch.bool)
        torch.testing.assert_close(steps_logits[t][rows].float(), full[rows, width - 1 + t].float(),
                                   **tol)
    assert full[:, width:].float().abs().max() > 0.3  # not vacuous: differences would show


def _unshared(monkeypatch, fn):
    """`fn()` with prompt sharing off: every row's prompt through the model."""
    with monkeypatch.context() as patch:
        patch.setattr(shared_prompt, "prompt_groups", lambda *args: None)
        return fn()


@pytest.mark.parametrize("case", CASES)
def test_samples_equal_the_samples_of_every_row_prefilled(request, case, monkeypatch):
    # The same uniforms with and without prompt sharing in the prefill: identical tokens, masks
    # and `ended` on 72 rows, 24 prompts three times each (the prefill runs each once), a sixth
    # of the vocabulary ending a response, so rows stop at many different steps and some outlive
    # the window of 8.
    tokenizer, model = _model(request, case)
    ids, mask = _prompts(tokenizer, repeats=3, more=18)
    kw = dict(max_new_tokens=20, temperature=0.9, eos_token_ids=list(range(0, len(tokenizer), 6)),
              pad_token_id=tokenizer.pad_token_id, uniforms=sampling_uniforms(3, len(ids), 20))
    shared = sample_responses(model, ids, mask, **kw)
    every_row = _unshared(monkeypatch, lambda: sample_responses(model, ids, mask, **kw))
    assert shared.input_ids.equal(every_row.input_ids)
    assert shared.response_mask.equal(every_row.response_mask)
    assert shared.ended.equal(every_row.ended)
    lengths = shared.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 4 and (lengths > 10).any() and shared.ended.any()


def test_peft_model_and_its_disabled_adapter_sample_alike_on_both_paths(request, monkeypatch):
    # The PeftModel itself and, inside disable_adapter(), the reference it stands for: each
    # samples the same tokens with and without prompt sharing, and the two differ.
    tokenizer, peft = _model(request, "llama+lora", peft_wrapper=True)
    ids, mask = _prompts(tokenizer, repeats=2)
    kw = dict(max_new_tokens=12, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
              pad_token_id=tokenizer.pad_token_id, uniforms=sampling_uniforms(5, len(ids), 12))

    def both():
        shared = sample_responses(peft, ids, mask, **kw).input_ids
        every_row = _unshared(monkeypatch, lambda: sample_responses(peft, ids, mask, **kw))
        assert shared.equal(every_row.input_ids)
        return shared
    policy = both()
    with peft.disable_adapter():
        reference = both()
    assert not reference.equal(policy)


def test_prefill_runs_each_distinct_prompt_once(request):
    tokenizer, model = _model(request, "llama")
    ids, mask = _prompts(tokenizer, repeats=4)  # 24 rows, 6 distinct
    positions = position_ids_from_mask(mask)
    batches = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: batches.append(args[0].shape[0]))
    with torch.no_grad():
        logits, cache = prefill(model, ids, mask, positions)
        hook.remove()
        whole, whole_cache = prefill(model, ids, mask, positions, dedupe=False)
    assert batches == [6]
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-6)
    for part, full in zip(cache.layers, whole_cache.layers, strict=True):
        torch.testing.assert_close(part.keys, full.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part.values, full.values, rtol=1e-5, atol=1e-6)
