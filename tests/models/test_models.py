import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.errors import TetherError
from tether.models.prepare import disable_dropout, frozen_copy
from tether.models.pretrained import PAD_TOKEN, load_causal_lm, load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.saving import save_model
from tether.run.launch import resolve_device


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_pad_token_added_distinct_from_eos(tiny_model_dir):
    raw = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert raw.pad_token is None  # the fixture mimics GPT-2: no pad token
    tok = load_tokenizer(str(tiny_model_dir))
    assert tok.pad_token == PAD_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(raw) + 1


def test_causal_lm_resized_and_saved_loads_with_transformers(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), tok)
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    # the new pad row starts at the mean of the old rows
    torch.testing.assert_close(emb[-1], emb[:-1].mean(0))
    out = save_model(model, tok, tmp_path / "m")
    assert (out / "model.safetensors").exists()
    assert not list(tmp_path.glob(".m.tmp-*"))  # temp dir renamed away
    again = AutoModelForCausalLM.from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_missing_local_model_is_tether_error(tmp_path):
    with pytest.raises(TetherError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_disable_dropout_and_frozen_copy(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), tok)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    disable_dropout(model)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.resid_pdrop == 0 and model.config.attn_pdrop == 0
    model.train()
    ids = torch.tensor([[5, 6, 7, 8]])
    # with dropout off, two train-mode passes agree exactly
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)
    ref = frozen_copy(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert not ptrs & {p.data_ptr() for p in ref.parameters()}


def test_reward_model_last_token_padding_and_roundtrip(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    rm = RewardModel.from_causal_lm(str(tiny_model_dir), tok)
    disable_dropout(rm)
    rm.eval()
    seq = [5, 9, 12, 30, 7]
    pad = tok.pad_token_id
    right = torch.tensor([seq + [pad, pad], seq[:3] + [pad] * 4])
    right_mask = (torch.arange(7) < torch.tensor([[5], [3]])).long()
    left = torch.tensor([[pad, pad] + seq, [pad] * 4 + seq[:3]])
    left_mask = right_mask.flip(-1)
    with torch.no_grad():
        r, lft = rm(right, right_mask), rm(left, left_mask)
        alone = torch.stack([rm(torch.tensor([seq]), torch.ones(1, 5, dtype=torch.long))[0],
                             rm(torch.tensor([seq[:3]]), torch.ones(1, 3, dtype=torch.long))[0]])
    # the score of a text does not depend on padding side or amount
    torch.testing.assert_close(r, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lft, alone, atol=1e-5, rtol=1e-5)
    assert r.shape == (2,)
    rm.set_normalization(mean=0.5, std=2.0)
    rm.save_pretrained(tmp_path / "rm")
    loaded = RewardModel.from_pretrained(tmp_path / "rm")
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(right, right_mask), r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded.score(right, right_mask), (r - 0.5) / 2.0, atol=1e-5, rtol=1e-5)
    assert loaded.tokenizer.pad_token_id == pad
    assert loaded.hidden_states(right, right_mask).shape == (2, 7, rm.head.in_features)


def test_reward_loader_rejects_plain_lm(tiny_model_dir):
    with pytest.raises(TetherError, match="not a tether reward model"):
        RewardModel.from_pretrained(tiny_model_dir)
