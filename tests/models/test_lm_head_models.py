"""Splitting models into trunk and head (logit transforms, unknown ones, duck-typed views), and
the stages really using the chunked head: no tensor of [positions, V] logits in PPO, SFT or DPO,
on GPT-2 and the Llama-style model."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from offline_fixtures import preference_rows, sft_rows
from torch.utils._python_dispatch import TorchDispatchMode
from update_helpers import loss_on, prompt_batch

from tether import lm_head
from tether.data.batches import collate_pairs, collate_sft
from tether.data.encoding import encode_preferences, encode_sft
from tether.models.pair_row import collate_shared
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.trunk_head import (
    LogitTransformHead,
    chunked_split,
    final_hidden,
    score_responses,
    trunk_and_head,
)
from tether.rl.engines.native import sample_responses
from tether.rl.scoring import score_rollout
from tether.train.dpo import pair_logprobs
from tether.train.ppo import PPOConfig
from tether.train.ppo_setup import build
from tether.train.sft import sft_loss

TINY = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def tiny_model(config_class, model_class, **extra):
    torch.manual_seed(0)
    return model_class(config_class(**TINY, **extra)).eval()


def split_logits(model, ids):
    trunk, head = trunk_and_head(model)
    return head(final_hidden(trunk, ids, torch.ones_like(ids)))


# the tiny models' logits are ~0.1: a cap of 0.02 and scales far from 1 change them visibly
TRANSFORMS = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"final_logit_softcapping": 0.02}, "softcap"),
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM,
               {"logit_scale": 3.0}, "multiply"),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                {"logits_scaling": 4.0}, "divide"),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_logit_transforms_are_applied_inside_the_chunk(name):
    config_class, model_class, extra, kind = TRANSFORMS[name]
    model = tiny_model(config_class, model_class, **extra)
    ids = torch.randint(0, 97, (2, 6))
    trunk, head = trunk_and_head(model)
    assert isinstance(head, LogitTransformHead) and head.kind == kind
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(split_logits(model, ids), expected, rtol=1e-5, atol=1e-6)
        bare = head.head(final_hidden(trunk, ids, torch.ones_like(ids)))
    # the transform matters: a head that skipped it would be caught
    assert (bare - expected).abs().max() > 0.3 * expected.abs().max()
    tokens = ids[:, 1:]
    hidden = final_hidden(trunk, ids, torch.ones_like(ids))[:, :-1]
    torch.testing.assert_close(lm_head.head_token_logprobs(hidden, head, tokens),
                               torch.log_softmax(expected[:, :-1], -1).gather(
                                   -1, tokens[..., None]).squeeze(-1), rtol=1e-5, atol=1e-5)


class DoubledLogitsLM(transformers.GPT2LMHeadModel):
    """A model that rescales its logits in forward, which no config field announces."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_unknown_logit_transform_falls_back_to_the_plain_path():
    torch.manual_seed(0)
    model = DoubledLogitsLM(transformers.GPT2Config(vocab_size=97, n_embd=16, n_layer=1,
                                                    n_head=2)).eval()
    with pytest.raises(ValueError, match="differs from its logits"):
        trunk_and_head(model)
    with pytest.warns(UserWarning, match="chunked LM head off"):
        assert chunked_split(model, True) is None
    ids = torch.randint(0, 97, (2, 7))
    mask = torch.ones_like(ids)
    with pytest.warns(UserWarning):
        chunked = score_responses(model, ids, mask, 3, 1.0, chunked=True).logprobs
    plain = score_responses(model, ids, mask, 3, 1.0, chunked=False).logprobs
    torch.testing.assert_close(chunked, plain, rtol=0, atol=0)  # the same plain computation


def test_duck_typed_view_is_asked_for_its_split():
    model = tiny_model(transformers.LlamaConfig, transformers.LlamaForCausalLM)

    class View:  # what an adapter view provides: its own trunk and head
        calls = 0

        def tether_trunk_and_head(self):
            View.calls += 1
            return model.model, model.lm_head

    trunk, head = trunk_and_head(View())
    assert View.calls == 1 and trunk is model.model and head is model.lm_head


def test_chunked_off_is_the_plain_path(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    model = load_causal_lm(str(tiny_llama_dir), tok).eval()
    assert chunked_split(model, False) is None
    ids = torch.randint(0, len(tok), (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: positions come from the mask on both paths
    plain = score_responses(model, ids, mask, 4, 0.9, chunked=False, entropy=True, hidden=True)
    chunked = score_responses(model, ids, mask, 4, 0.9, chunked=True, entropy=True, hidden=True)
    for name in ("logprobs", "entropy", "hidden"):
        torch.testing.assert_close(getattr(chunked, name), getattr(plain, name),
                                   rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the stages

class LogitsSpy(TorchDispatchMode):
    """Records the largest number of rows of any tensor whose last dim is the vocabulary,
    forward and backward, leaving out [d, V] (a transposed head weight)."""

    def __init__(self, vocab: int, hidden_size: int):
        super().__init__()
        self.vocab, self.hidden_size, self.max_rows = vocab, hidden_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                rows = t.numel() // self.vocab
                if rows != self.hidden_size:
                    self.max_rows = max(self.max_rows, rows)
        return out


CHUNK_ROWS = 4  # CHUNK_ELEMENTS = 4 * V below: at most 4 positions of logits at a time


def spy_for(model, monkeypatch):
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", CHUNK_ROWS * vocab)
    return LogitsSpy(vocab, model.config.hidden_size)


@pytest.fixture(params=["gpt2", "llama"])
def model_dir(request, tiny_model_dir, tiny_llama_dir):
    return tiny_model_dir if request.param == "gpt2" else tiny_llama_dir


@pytest.mark.parametrize("chunked", [True, False])
def test_ppo_scoring_and_update_never_hold_full_logits(model_dir, tmp_path, monkeypatch, chunked):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["the movie was", "it", "a film and", "music"]))
    cfg = PPOConfig(run_name="spy", output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                    prompts=str(prompts), batch_size=4, total_episodes=4, max_new_tokens=6,
                    device="cpu", save_every=0, sample_every=0, critic="shared",
                    temperature=0.7, chunked_lm_head=chunked)
    setup = build(cfg, reward_fn=lambda p, r: [float(len(x)) for x in r])
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = sample_responses(setup.policy, ids, mask, max_new_tokens=6, temperature=0.7,
                               eos_token_ids=setup.eos_token_ids,
                               pad_token_id=setup.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    positions = rollout.responses.numel()  # B * R
    assert positions > CHUNK_ROWS and positions != setup.policy.config.hidden_size
    adv = torch.randn(rollout.response_mask.shape) * rollout.response_mask
    with spy_for(setup.policy, monkeypatch) as spy:
        old = score_rollout(setup.policy, setup.reference, setup.critic, rollout, 0.7, 4, chunked)
        loss, stats = loss_on(setup, rollout, old, adv, adv, 0.0)
        loss.backward()
    assert stats["policy/ratio_mean"] == 1.0  # the invariant holds on either path
    if chunked:
        assert 0 < spy.max_rows <= CHUNK_ROWS  # it saw the chunks, never more
    else:  # the plain path does hold them: the spy can see them
        assert spy.max_rows >= positions
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("chunked", [True, False])
def test_sft_and_dpo_never_hold_full_logits(model_dir, monkeypatch, chunked):
    tok = load_tokenizer(str(model_dir))
    model = disable_dropout(load_causal_lm(str(model_dir), tok))
    sft_examples, _ = encode_sft(tok, sft_rows(4), max_length=64)
    pairs, _ = encode_preferences(tok, preference_rows(3), max_length=64)
    sft_batch = collate_sft(sft_examples, tok.pad_token_id)
    results = []
    with spy_for(model, monkeypatch) as spy:
        loss, _ = sft_loss(model, sft_batch, chunked)
        loss.backward()
        results.append(loss.detach())
        for batch in (collate_pairs(pairs, tok.pad_token_id),
                      collate_shared(pairs, tok.pad_token_id)):
            chosen, rejected, _, _ = pair_logprobs(model, batch, chunked)
            (chosen - rejected).sum().backward()
            results.append(torch.stack([chosen, rejected]).detach())
    if chunked:
        assert 0 < spy.max_rows <= CHUNK_ROWS  # it saw the chunks, never more
    else:
        assert spy.max_rows >= sft_batch["input_ids"].numel() - len(sft_examples)
    # prefix-shared and concatenated DPO passes agree on either path
    torch.testing.assert_close(results[1], results[2], rtol=1e-5, atol=1e-4)


def test_stage_values_and_gradients_equal_on_both_paths(model_dir):
    tok = load_tokenizer(str(model_dir))
    model = disable_dropout(load_causal_lm(str(model_dir), tok))
    sft_batch = collate_sft(encode_sft(tok, sft_rows(4), max_length=64)[0], tok.pad_token_id)
    pair_batch = collate_shared(encode_preferences(tok, preference_rows(3), max_length=64)[0],
                                tok.pad_token_id)
    outs = {}
    for chunked in (True, False):
        model.zero_grad()
        loss, _ = sft_loss(model, sft_batch, chunked)
        chosen, rejected, _, _ = pair_logprobs(model, pair_batch, chunked)
        (loss + (chosen - 2 * rejected).sum()).backward()
        outs[chunked] = [loss.detach(), chosen.detach(), rejected.detach()] + [
            p.grad.clone() for p in model.parameters()]
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
