"""Every output loads the standard way with the same numbers, padded batches included.

tether picks a pad token that is never EOS (`choose_pad`): the tokenizer's own, a pad token the
vocabulary already holds, a new `<|pad|>` on a spare embedding row, the unknown token, and only
when none applies a new row. The tests check which rule each fixture takes (ids worked out by
hand below), then run a real `tether sft` (full and `--lora-r`) and load its outputs with plain
transformers and peft as a user would: their log-probs over the whole vocabulary, on a
right-padded and a left-padded batch, must equal those of the model tether had in memory when
it saved.

The fixtures, and the rule each takes:
    GPT-2 style   300 tokens, 300 rows, no unknown token       -> <|pad|> = 300, grows to 301
    Llama style   300 tokens, 300 rows, no unknown token       -> <|pad|> = 300, grows to 301
    Mistral style 217 tokens, 217 rows, <unk> = 0 (not EOS/BOS) -> pad = <unk> = 0, no growth
    Qwen2 spare   300 tokens, 304 rows, pad <|endoftext|> is an EOS of generation_config
                                                               -> <|pad|> = 300 on a spare row
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import sample_texts
from offline_fixtures import sft_rows, write_jsonl
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import tether.train.offline as offline
from tether.models.lora import LoraSpec
from tether.models.pretrained import (
    PAD_TOKEN,
    choose_pad,
    load_causal_lm,
    load_tokenizer,
    load_trainable_lm,
)
from tether.models.saving import embeddings_grew
from tether.models.tiny import make_llama_tokenizer, save_tiny_qwen2
from tether.train.sft import SFTConfig, run

SPARE = 4  # the Qwen2 variant's embedding rows past its tokenizer's last id
# fixture -> (raw tokenizer length, pad id tether picks, embedding rows after loading)
EXPECTED = {"tiny_model_dir": (300, 300, 301), "tiny_llama_dir": (300, 300, 301),
            "tiny_mistral_dir": (217, 0, 217), "qwen2_spare_dir": (300, 300, 304)}
FAMILIES = list(EXPECTED)
GROWN = {"tiny_model_dir", "tiny_llama_dir"}
TEXTS = ["the movie was good", "the plot", "a very long and dull film but the music was fun"]


@pytest.fixture(scope="session")
def qwen2_spare_dir(tmp_path_factory):
    """The Qwen2 fixture with 4 spare embedding rows, like real Qwen2 checkpoints."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_spare"), sample_texts(),
                           vocab_size=300, spare_rows=SPARE)


# ----------------------------------------------------------------------------- the pad rules


@pytest.mark.parametrize("family", FAMILIES)
def test_pad_rule_grows_the_vocabulary_only_without_room(family, request):
    model_dir = request.getfixturevalue(family)
    raw = AutoTokenizer.from_pretrained(model_dir)
    raw_len, pad_id, rows = EXPECTED[family]
    assert len(raw) == raw_len
    tok = load_tokenizer(str(model_dir))
    assert tok.pad_token_id == pad_id
    model = load_causal_lm(str(model_dir), tok)
    assert model.get_input_embeddings().weight.shape[0] == rows
    assert model.get_output_embeddings().weight.shape[0] == rows
    assert model.config.pad_token_id == pad_id
    if family == "tiny_mistral_dir":  # the unknown token: no token added
        assert tok.pad_token == "<unk>" == tok.unk_token and len(tok) == raw_len
    else:  # a new <|pad|> at the next id: on a spare row (Qwen2) or a new one
        assert tok.pad_token == PAD_TOKEN and len(tok) == raw_len + 1
    assert pad_id not in (tok.eos_token_id, tok.bos_token_id)
    # Where nothing grew, the loaded weights are the saved ones, every row.
    if family not in GROWN:
        plain = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.testing.assert_close(model.get_input_embeddings().weight,
                                   plain.get_input_embeddings().weight, rtol=0, atol=0)


def _llama_tokenizer():
    tok = make_llama_tokenizer(sample_texts(), vocab_size=300)
    assert len(tok) == 300
    return tok


def test_choose_pad_order_on_hand_made_tokenizers():
    eos = [1]  # make_llama_tokenizer's specials: <s> = 0, </s> = 1, then the role markers
    # 1. a pad that is no EOS is kept
    tok = _llama_tokenizer()
    tok.pad_token = "<|user|>"
    choose_pad(tok, eos, rows=300)
    assert tok.pad_token == "<|user|>" and len(tok) == 300
    # 2. a pad EOS is replaced; a known pad name in the vocabulary wins over everything else
    tok = _llama_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|finetune_right_pad_id|>"]})
    tok.pad_token = tok.eos_token
    choose_pad(tok, eos, rows=301)
    assert (tok.pad_token, tok.pad_token_id, len(tok)) == ("<|finetune_right_pad_id|>", 300, 301)
    # 3. a spare row takes a new <|pad|> (id 300 < 302 rows), even where an unk token exists
    tok = _llama_tokenizer()
    tok.unk_token = "<|system|>"
    choose_pad(tok, eos, rows=302)
    assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 300)
    # 4. no spare row: the unk token, when it is neither EOS nor BOS
    tok = _llama_tokenizer()
    tok.unk_token = "<|system|>"
    choose_pad(tok, eos, rows=300)
    assert (tok.pad_token, tok.pad_token_id, len(tok)) == ("<|system|>", 4, 300)
    # 5. an unk that is BOS (or EOS) is not used: a new <|pad|> on a new row
    for unk in ("<s>", "</s>"):
        tok = _llama_tokenizer()
        tok.unk_token = unk
        choose_pad(tok, eos, rows=300)
        assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 300)


def test_adapter_directory_reads_its_bases_config(qwen2_spare_dir, tmp_path):
    """A foreign adapter directory (no config.json) with the base's tokenizer, which pads with
    <|endoftext|>: the base's generation_config makes that an EOS and its rows leave a spare one,
    so the pad is replaced by a new <|pad|> and nothing grows."""
    base = AutoModelForCausalLM.from_pretrained(qwen2_spare_dir)
    spec = LoraSpec(r=2, alpha=4.0, dropout=0.0, target_modules="q_proj")
    get_peft_model(base, spec.peft_config(base)).save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(qwen2_spare_dir).save_pretrained(tmp_path / "adapter")
    tok = load_tokenizer(str(tmp_path / "adapter"))
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 300) and endoftext != 300
    lm = load_trainable_lm(str(tmp_path / "adapter"), tok, None)
    assert lm.model.get_input_embeddings().weight.shape[0] == 300 + SPARE


def test_embeddings_grew_compares_with_the_saved_base(tiny_model_dir, qwen2_spare_dir, tmp_path):
    spec = LoraSpec(r=2, alpha=4.0, dropout=0.0, target_modules="all-linear")
    grown = load_trainable_lm(str(tiny_model_dir), load_tokenizer(str(tiny_model_dir)), spec)
    assert embeddings_grew(grown.peft)  # 301 rows, the saved config says 300
    spare = load_trainable_lm(str(qwen2_spare_dir), load_tokenizer(str(qwen2_spare_dir)), spec)
    assert not embeddings_grew(spare.peft)  # 304 rows, as saved
    # a base whose config cannot be read: saving the layers is the safe choice
    spare.peft.peft_config["default"].base_model_name_or_path = str(tmp_path / "gone")
    assert embeddings_grew(spare.peft)


# ----------------------------------------------------------------------------- the outputs


def _batch(tokenizer, side: str) -> dict[str, torch.Tensor]:
    tokenizer.padding_side = side
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # really padded
    pad_cols = batch["input_ids"][batch["attention_mask"] == 0]
    assert (pad_cols == tokenizer.pad_token_id).all()
    return batch


def _logprobs(model, batch) -> torch.Tensor:
    """log softmax over the whole vocabulary (the pad row included) at every real position:
    [real tokens, V]. Plain `model(**batch)`, as a user calls it."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits.float(), -1)[batch["attention_mask"].bool()]


@pytest.fixture(scope="module", params=[(f, m) for f in FAMILIES for m in ("full", "lora")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def sft_output(request, tmp_path_factory):
    """A 2-step `tether sft` (with --lora-r 4 --merge-lora for "lora"), and the log-probs of the
    model tether held when it saved, on both padded batches (read before the save, which merges
    a LoRA adapter in place)."""
    family, mode = request.param
    base = request.getfixturevalue(family)
    root = tmp_path_factory.mktemp("standard")
    rows = [{"prompt": r["prompt"], "response": r["response"]} for r in sft_rows(8)]
    cfg = SFTConfig(run_name="s", output_dir=str(root / "runs"), model=str(base),
                    data=str(write_jsonl(root / "sft.jsonl", rows)), max_steps=2, batch_size=4,
                    lr=3e-2, device="cpu", lora_r=4 if mode == "lora" else 0,
                    merge_lora=mode == "lora")
    seen: dict[str, torch.Tensor] = {}
    save = offline.save_trained_lm

    def save_and_record(lm, tokenizer, final_dir, merged_dir):
        lm.model.eval()  # dropout off: the loaded models are in eval mode too
        for side in ("right", "left"):
            seen[side] = _logprobs(lm.model, _batch(tokenizer, side))
        seen["start"] = _logprobs(load_causal_lm(str(base), tokenizer).eval(),
                                  _batch(tokenizer, "right"))
        save(lm, tokenizer, final_dir, merged_dir)

    mp = pytest.MonkeyPatch()
    mp.setattr(offline, "save_trained_lm", save_and_record)
    try:
        out = run(cfg).output_path
    finally:
        mp.undo()
    return {"family": family, "mode": mode, "base": base, "final": out,
            "merged": out.parent / "merged", "tether": seen}


def _assert_same(model, output, tokenizer) -> None:
    model.eval()
    for side in ("right", "left"):
        torch.testing.assert_close(_logprobs(model, _batch(tokenizer, side)),
                                   output["tether"][side], rtol=1e-5, atol=1e-5)


def test_outputs_load_the_standard_way_with_the_same_numbers(sft_output):
    family, final = sft_output["family"], sft_output["final"]
    tokenizer = AutoTokenizer.from_pretrained(final)  # the tokenizer saved with the output
    _, pad_id, rows = EXPECTED[family]
    assert tokenizer.pad_token_id == pad_id
    # it trained: the saved model is not the starting one
    assert (sft_output["tether"]["right"] - sft_output["tether"]["start"]).abs().max() > 1e-3
    if sft_output["mode"] == "full":
        model = AutoModelForCausalLM.from_pretrained(final)
        assert model.get_input_embeddings().weight.shape[0] == rows
        _assert_same(model, sft_output, tokenizer)
        return
    _assert_same(AutoPeftModelForCausalLM.from_pretrained(final), sft_output, tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(sft_output["merged"])
    assert merged.get_input_embeddings().weight.shape[0] == rows
    _assert_same(merged, sft_output, tokenizer)
    base = AutoModelForCausalLM.from_pretrained(sft_output["base"])
    saved = load_file(str(final / "adapter_model.safetensors"))
    not_lora = {k: v.shape[0] for k, v in saved.items() if "lora_" not in k}
    if family in GROWN:
        # the embedding and output layers ride along, grown; an un-resized base refuses them
        assert not_lora and set(not_lora.values()) == {rows}, not_lora
        with pytest.raises(RuntimeError, match="size mismatch"):
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_output["base"]),
                                      str(final))
        base.resize_token_embeddings(len(tokenizer))  # peft's documented recipe
    else:
        assert not not_lora  # nothing grew: the adapter alone, on the base as it is
    _assert_same(PeftModel.from_pretrained(base, str(final)), sft_output, tokenizer)


def test_tethers_own_loaders_read_the_outputs_alike(sft_output):
    """tether's loading of its outputs: merged (a stage that trains every weight or a
    --ref-model) and, for an adapter, continued with its frozen "reference" copy."""
    final = sft_output["final"]
    tokenizer = load_tokenizer(str(final))
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(final).get_vocab()
    _assert_same(load_trainable_lm(str(final), tokenizer, None).model, sft_output, tokenizer)
    if sft_output["mode"] == "lora":
        spec = LoraSpec(r=8, alpha=8.0, dropout=0.0, target_modules="all-linear")
        lm = load_trainable_lm(str(final), tokenizer, spec)
        assert lm.reference_adapter == "reference"
        assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
        _assert_same(lm.model, sft_output, tokenizer)
