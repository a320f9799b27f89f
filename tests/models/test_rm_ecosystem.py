"""`tether rm`'s output read by the ecosystem: the final model loads in plain
`AutoModelForSequenceClassification` (full fine-tuning) or with peft's standard recipe (LoRA) and
gives tether's raw scores; tether applies the stored normalisation on top. Directories written
before the v2 format still load.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from peft import AutoPeftModelForSequenceClassification, PeftModel
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tether.cli import main
from tether.models.hub_reward import load_hub_reward_model
from tether.models.reward_model import RewardModel
from tether.preference import bradley_terry_loss

MODELS = ["tiny_model_dir", "tiny_llama_dir"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_eco")
    return {"prefs": write_jsonl(root / "prefs.jsonl", preference_rows(16)),
            "norm": write_jsonl(root / "norm.jsonl", sft_rows(8, seed=4))}


def _train_rm(base, data, out, *extra):
    assert main(["rm", "--model", str(base), "--data", str(data["prefs"]), "--normalize-data",
                 str(data["norm"]), "--run-name", "rm", "--output-dir", str(out), "--max-steps",
                 "2", "--batch-size", "8", "--lr", "1e-2", "--eval-fraction", "0", "--device",
                 "cpu", *extra]) == 0
    return out / "rm" / "final"


def _padded_batch(tokenizer):
    """Texts of different lengths, EOS-terminated as tether encodes them, padded on the right
    with the tokenizer's pad token (what transformers' sequence classifiers read past)."""
    rows = preference_rows(6, seed=9)
    texts = [r["prompt"] + r["chosen"] + tokenizer.eos_token for r in rows]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
    assert (batch["attention_mask"] == 0).any()  # really padded
    return batch


def _tether_scores(final, batch):
    rm = RewardModel.from_pretrained(final).eval()
    with torch.no_grad():
        return rm, rm(batch["input_ids"], batch["attention_mask"]), rm.score(
            batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("family", MODELS)
def test_full_rm_loads_in_plain_transformers_with_tethers_raw_scores(family, data, request,
                                                                       tmp_path):
    final = _train_rm(request.getfixturevalue(family), data, tmp_path)
    assert not (final / "reward_head.safetensors").exists()
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert config["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id
    batch = _padded_batch(tokenizer)
    hf = AutoModelForSequenceClassification.from_pretrained(final).eval()  # no missing head
    with torch.no_grad():
        plain = hf(**batch).logits[:, 0]
    rm, raw, normalised = _tether_scores(final, batch)
    torch.testing.assert_close(plain, raw, rtol=1e-5, atol=1e-5)  # transformers = tether's raw
    meta = json.loads((final / "tether_reward.json").read_text())
    assert meta["format"] == "tether-reward-v2" and meta["std"] != 1.0  # normalisation fitted
    torch.testing.assert_close(normalised, (plain - meta["mean"]) / meta["std"])
    assert torch.equal(hf.score.weight, rm.head.weight) and rm.head.bias is None
    assert plain.std() > 1e-4  # the scores differ between texts: not a constant head


@pytest.mark.parametrize("family", MODELS)
def test_lora_rm_loads_with_peft_onto_a_sequence_classifier(family, data, request, tmp_path):
    base = request.getfixturevalue(family)
    final = _train_rm(base, data, tmp_path, "--lora-r", "4")
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
    tokenizer = AutoTokenizer.from_pretrained(final)
    # peft's standard recipe: the base as a one-label classifier, grown to the tokenizer when
    # tether gave it a pad token, its pad id set (transformers needs it for a batch), then the
    # adapter, which brings the trained head as `score`
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model = PeftModel.from_pretrained(model, str(final)).eval()
    batch = _padded_batch(tokenizer)
    with torch.no_grad():
        plain = model(**batch).logits[:, 0]
    _, raw, normalised = _tether_scores(final, batch)
    torch.testing.assert_close(plain, raw, rtol=1e-5, atol=1e-5)
    meta = json.loads((final / "tether_reward.json").read_text())
    torch.testing.assert_close(normalised, (plain - meta["mean"]) / meta["std"])
    assert plain.std() > 1e-4
    # peft's one-call loader (it grows the base to the adapter's tokenizer itself)
    auto = AutoPeftModelForSequenceClassification.from_pretrained(str(final), num_labels=1).eval()
    auto.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        torch.testing.assert_close(auto(**batch).logits[:, 0], raw, rtol=1e-5, atol=1e-5)
    # Without tether_reward.json it is any SEQ_CLS adapter from the hub: `--reward-model` merges
    # it into its base as a one-label classifier, the same raw score on each text alone.
    foreign = tmp_path / "foreign"
    shutil.copytree(final, foreign)
    (foreign / "tether_reward.json").unlink()
    hub = load_hub_reward_model(str(foreign)).eval()
    for i, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"], strict=True)):
        alone = ids[mask.bool()][None]
        with torch.no_grad():
            assert hub(alone, torch.ones_like(alone)).item() == pytest.approx(raw[i].item(),
                                                                                abs=1e-5)


def test_a_directory_from_before_v2_loads_and_resaves_with_the_same_scores(tiny_llama_dir,
                                                                            tmp_path):
    # The old layout by hand: the trunk, a head WITH a bias in reward_head.safetensors, the json.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    trunk = AutoModel.from_pretrained(tiny_llama_dir)
    trunk.resize_token_embeddings(len(tokenizer))
    old = tmp_path / "old"
    trunk.save_pretrained(old)
    tokenizer.save_pretrained(old)
    torch.manual_seed(0)
    weight, bias = torch.randn(1, trunk.config.hidden_size), torch.tensor([0.75])
    save_file({"weight": weight, "bias": bias}, str(old / "reward_head.safetensors"))
    (old / "tether_reward.json").write_text(json.dumps({"format": "tether-reward-v1",
                                                        "mean": 0.5, "std": 2.0}))
    batch = _padded_batch(tokenizer)
    with torch.no_grad():  # by hand: head(h) + bias at each row's last real token
        hidden = trunk(**batch).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        by_hand = hidden[torch.arange(len(last)), last] @ weight[0] + bias
    rm, raw, normalised = _tether_scores(old, batch)
    torch.testing.assert_close(raw, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normalised, (by_hand - 0.5) / 2.0, rtol=1e-5, atol=1e-5)
    # Saved again it is v2: transformers gives raw - bias (its head has none), and the bias moved
    # into the stored mean, so tether's normalised score is unchanged.
    rm.save_pretrained(tmp_path / "new")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "new").eval()
    with torch.no_grad():
        plain = hf(**batch).logits[:, 0]
    torch.testing.assert_close(plain, by_hand - 0.75, rtol=1e-5, atol=1e-5)
    _, _, renormalised = _tether_scores(tmp_path / "new", batch)
    torch.testing.assert_close(renormalised, normalised, rtol=1e-5, atol=1e-5)


def test_bradley_terry_gives_a_head_bias_zero_gradient(tiny_model_dir):
    # Why the v2 head has no bias: r = w.h + b enters the loss only through r_c - r_r, where b
    # cancels, so dL/db = sum_i (g_i - g_i) = 0 and a bias would stay at its initial value.
    from tether.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    rm = RewardModel.from_causal_lm(str(tiny_model_dir), tokenizer)
    rm.head = torch.nn.Linear(rm.head.in_features, 1)  # the pre-v2 head, with a bias
    rm.double()  # float64: what is left of the bias gradient is the summation's rounding alone
    ids = torch.randint(0, 200, (8, 7), generator=torch.Generator().manual_seed(0))
    hidden = rm.hidden_states(ids, torch.ones_like(ids))[:, -1]
    scores = rm.head(hidden).squeeze(-1)  # forward() returns float32; keep float64 here
    bradley_terry_loss(scores[:4], scores[4:]).backward()
    assert rm.head.weight.grad.abs().max() > 1e-4  # the weight does learn
    assert rm.head.bias.grad.abs().item() < 1e-15
