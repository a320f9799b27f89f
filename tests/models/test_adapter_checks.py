"""LoRA adapters checked before they are applied (issue 23).

Every adapter tether saves records its base (`tether_base.json`: shapes and 8 sampled values per
weight, `tether.models.adapter_checks`). Another base (another vocabulary, another architecture,
the same shapes with other weights), NaN weights, a missing, pickled, truncated or wrong-rank
weight file are each one `error:` line with exit 2 and nothing written, through every command that
takes an adapter (eval, generate, dpo --model/--ref-model, ppo --policy/--ref-model), on GPT-2
and Llama. Before: exit 0 with a wrong result (another vocabulary or base, NaN) or a peft,
safetensors or hub traceback (the rest).

What must keep working, against independent truth: the record holds the base's own weights (read
back from its safetensors file), peft's loaders ignore the extra file (same logits as tether's
load), the same base loaded in bfloat16 or float16 is accepted, and an adapter without a record
(peft's own) loads as peft loads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import sample_texts
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from refusals import refused
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tether.cli import main
from tether.errors import TetherError
from tether.models.adapter_checks import (
    BASE_RECORD,
    SAMPLES,
    _close,
    _tolerance,
    base_record,
    check_base,
)
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.tiny import save_tiny, save_tiny_llama

FAMILIES = {"gpt2": "tiny_model_dir", "llama": "tiny_llama_dir"}
OTHER = {"gpt2": "llama", "llama": "gpt2"}
CPU = ["--device", "cpu"]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """Data, bases that are not the adapters' own, a LoRA SFT adapter per family, and the broken
    variants of each (built once: each case copies the good adapter and breaks one thing)."""
    base = tmp_path_factory.mktemp("adapter_checks")
    write_jsonl(base / "sft.jsonl", sft_rows(8))
    write_jsonl(base / "prefs.jsonl", preference_rows(8))
    write_jsonl(base / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [float(len(r)) for r in responses]\n")
    bases = {"gpt2": tiny_model_dir, "llama": tiny_llama_dir}
    save_tiny(base / "gpt2_same", sample_texts(), vocab_size=300, seed=1)  # same shapes, other seed
    save_tiny_llama(base / "llama_same", sample_texts(), vocab_size=300, seed=1)
    save_tiny(base / "gpt2_vocab", sample_texts(), vocab_size=260)  # another vocabulary
    save_tiny_llama(base / "llama_vocab", sample_texts(), vocab_size=260)
    save_tiny(base / "gpt2_narrow", sample_texts(), vocab_size=300, n_embd=32)  # other widths
    for fam, model in bases.items():
        assert main(["sft", "--model", str(model), "--data", str(base / "sft.jsonl"),
                     "--run-name", f"lora_{fam}", "--output-dir", str(base / "runs"),
                     "--max-steps", "1", "--batch-size", "4", "--lora-r", "4", *CPU]) == 0
        for case, (edit, _) in CASES.items():
            _variant(base, fam, case, edit, bases)
        for case, (edit, _) in UNRECORDED.items():
            if (case, fam) != ("narrow", "llama"):
                _variant(base, fam, f"unrecorded_{case}", edit, bases, keep_record=False)
    return base


def _variant(root, fam, case, edit, bases, keep_record=True):
    out = root / "variants" / f"{fam}_{case}"
    shutil.copytree(root / "runs" / f"lora_{fam}" / "final", out)
    edit(out, fam, root, bases)
    if not keep_record:  # an adapter tether did not write (peft's, or tether's before the record)
        (out / BASE_RECORD).unlink()


def _set_base(which):
    def edit(out, fam, root, bases):
        path = bases[OTHER[fam]] if which == "other_arch" else root / f"{fam}_{which}"
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(path)
        (out / "adapter_config.json").write_text(json.dumps(config))
    return edit


def _nan(out, *_):
    weights = out / "adapter_model.safetensors"
    state = load_file(weights)
    name = next(k for k in state if "lora_B" in k)
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, weights)


def _missing(out, *_):
    (out / "adapter_model.safetensors").unlink()


def _pickled(out, *_):  # what peft writes with safe_serialization=False
    (out / "adapter_model.safetensors").rename(out / "adapter_model.bin")


def _truncated(out, *_):
    weights = out / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])


def _wrong_rank(out, *_):
    config = json.loads((out / "adapter_config.json").read_text())
    config["r"] = 8  # the weights are rank 4
    (out / "adapter_config.json").write_text(json.dumps(config))


def _bad_record(out, *_):
    (out / BASE_RECORD).write_text("{")


ANOTHER = r"is not the model the adapter .* was trained on \(.*\): "
CASES = {  # case -> (how the adapter is broken, the pattern its one line must contain)
    "vocab": (_set_base("vocab"), ANOTHER + r"that was a \w+ with \d+ parameters and 300 "
              r"embedding rows, this is a \w+ with \d+ parameters and 26[01] embedding rows"),
    "same": (_set_base("same"), ANOTHER + r"the same shapes but other weights "
             r"\((transformer\.wte|model\.embed_tokens)\.weight differs\)"),
    "other_arch": (_set_base("other_arch"), ANOTHER + r"that was a (GPT2LMHeadModel|"
                   r"LlamaForCausalLM) .* this is a (LlamaForCausalLM|GPT2LMHeadModel)"),
    "nan": (_nan, r"adapter_model.safetensors holds NaN or inf \(base_model.*lora_B.weight\)"),
    "missing": (_missing, "has adapter_config.json but no adapter_model.safetensors; the adapter "
                "directory is incomplete"),
    "pickled": (_pickled, r"holds its weights as adapter_model.bin \(a pickle\)"),
    "truncated": (_truncated, r"cannot read .*adapter_model.safetensors \(SafetensorError: .*\); "
                  "the file is truncated or damaged"),
    "wrong_rank": (_wrong_rank, "says r=8 but adapter_model.safetensors holds rank-4 weights"),
    "bad_record": (_bad_record, r"cannot read .*tether_base.json \(JSONDecodeError\)"),
}
UNRECORDED = {  # the same mistakes with an adapter that has no record: what its files allow
    "vocab": (_set_base("vocab"), r"has 26[01] embedding rows but the tokenizer of the adapter .* "
              r"has 300 regular tokens: the adapter was trained on a model with another vocabulary"),
    "other_arch": (_set_base("other_arch"), "does not fit .*: its target modules match no layer "
                   "of it, so it was trained on a model of another architecture"),
    "narrow": (_set_base("narrow"), r"does not fit .*gpt2_narrow: size mismatch for "
               r"base_model\.model\.transformer\.wte\.weight"),
}


def _commands(root, adapter, base):
    """Every command that takes an adapter, with it in each place an adapter goes."""
    prompts, prefs, out = str(root / "prompts.jsonl"), str(root / "prefs.jsonl"), str(root / "out")
    reward = ["--reward-fn", f"{root / 'rewards.py'}:score"]
    ppo = ["--prompts", prompts, *reward, "--output-dir", out, "--run-name", "p",
           "--total-episodes", "4", "--batch-size", "4", "--max-new-tokens", "4", *CPU]
    offline = ["--output-dir", out, "--run-name", "o", "--max-steps", "1", "--batch-size", "4",
               *CPU]
    dpo = ["--data", prefs, *offline]
    evaluate = ["eval", "--prompts", prompts, *reward, "--output", f"{out}/eval.json",
                "--max-new-tokens", "4", *CPU]
    return {
        "eval": [*evaluate, "--model", adapter, "--reference", base],
        "eval--reference": [*evaluate, "--model", base, "--reference", adapter],
        "generate": ["generate", "--model", adapter, "--prompts", prompts, "--output",
                     f"{out}/samples.jsonl", "--max-new-tokens", "4", *CPU],
        "dpo--ref-model": ["dpo", "--model", base, "--ref-model", adapter, *dpo],
        "dpo--model-lora": ["dpo", "--model", adapter, "--lora-r", "4", *dpo],
        "sft--model": ["sft", "--model", adapter, "--data", str(root / "sft.jsonl"), *offline],
        "rm--model-lora": ["rm", "--model", adapter, "--lora-r", "4", *dpo],
        "ppo--policy": ["ppo", "--policy", adapter, *ppo],
        "ppo--policy-lora": ["ppo", "--policy", adapter, "--lora-r", "4", *ppo],
        "ppo--ref-model": ["ppo", "--policy", base, "--ref-model", adapter, *ppo],
    }


COMMANDS = ["eval", "eval--reference", "generate", "sft--model", "rm--model-lora",
            "dpo--ref-model", "dpo--model-lora", "ppo--policy", "ppo--policy-lora",
            "ppo--ref-model"]


# ----------------------------------------------------------------------------- bad adapters


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_adapter_is_one_line_everywhere(case, fam, command, root, request, capsys):
    base = str(request.getfixturevalue(FAMILIES[fam]))
    adapter = str(root / "variants" / f"{fam}_{case}")
    refused(root, _commands(root, adapter, base)[command], CASES[case][1], capsys)


@pytest.mark.parametrize("command", ["eval", "dpo--model-lora", "ppo--ref-model"])
@pytest.mark.parametrize("case, fam", [(c, f) for c in UNRECORDED for f in FAMILIES
                                       if (c, f) != ("narrow", "llama")])  # one narrow base
def test_an_unrecorded_adapter_on_a_base_it_does_not_fit_is_one_line(case, fam, command, root,
                                                                     request, capsys):
    base = str(request.getfixturevalue(FAMILIES[fam]))
    adapter = str(root / "variants" / f"{fam}_unrecorded_{case}")
    refused(root, _commands(root, adapter, base)[command], UNRECORDED[case][1], capsys)


def test_a_lora_reward_model_whose_base_path_now_holds_another_model(root, tiny_model_dir,
                                                                     tmp_path_factory, capsys):
    """The reward model shares the policy's base by path (one copy in memory) or loads its own;
    either way a base saved over that path since is refused."""
    work = tmp_path_factory.mktemp("moving_base")
    moving = work / "base"
    shutil.copytree(tiny_model_dir, moving)
    assert main(["rm", "--model", str(moving), "--data", str(root / "prefs.jsonl"), "--run-name",
                 "rm", "--output-dir", str(work / "runs"), "--max-steps", "1", "--batch-size", "4",
                 "--lora-r", "4", *CPU]) == 0
    rm = work / "runs" / "rm" / "final"
    assert (rm / BASE_RECORD).is_file() and (rm / "tether_reward.json").is_file()
    shutil.copy(root / "gpt2_same" / "model.safetensors", moving / "model.safetensors")
    ppo = ["ppo", "--reward-model", str(rm), "--prompts", str(root / "prompts.jsonl"),
           "--output-dir", str(work / "out"), "--run-name", "p", "--total-episodes", "4",
           "--batch-size", "4", "--max-new-tokens", "4", *CPU]
    pattern = ANOTHER + "the same shapes but other weights"
    refused(work, [*ppo, "--policy", str(moving), "--lora-r", "4"], pattern, capsys)  # shared
    refused(work, [*ppo, "--policy", str(tiny_model_dir)], pattern, capsys)  # loaded on its own
    shutil.copy(tiny_model_dir / "model.safetensors", moving / "model.safetensors")
    assert main([*ppo, "--policy", str(moving), "--lora-r", "4"]) == 0  # its own base: it runs


def test_a_reward_adapter_of_the_hub_kind_without_weights(root, tiny_model_dir, capsys):
    """A peft SEQ_CLS adapter (`--reward-model`, not tether's format) missing its weights: before,
    peft took the directory for a hub repo id and raised HFValidationError."""
    adapter = root / "variants" / "seq_cls"
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    get_peft_model(classifier, LoraConfig(r=2, target_modules=["c_attn"], task_type="SEQ_CLS")
                   ).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    (adapter / "adapter_model.safetensors").unlink()
    refused(root, ["ppo", "--policy", str(tiny_model_dir), "--reward-model", str(adapter),
                   "--prompts", str(root / "prompts.jsonl"), "--output-dir", str(root / "out"),
                   "--run-name", "p", *CPU], "has adapter_config.json but no "
            "adapter_model.safetensors", capsys)


# ----------------------------------------------------------------------------- the record


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_the_record_holds_the_bases_own_weights(fam, root, request):
    """Read back from the base's safetensors file: every weight once (GPT-2's tied head is not
    saved), its shape, and its values at SAMPLES evenly spaced flat positions."""
    base = request.getfixturevalue(FAMILIES[fam])
    record = json.loads((root / "runs" / f"lora_{fam}" / "final" / BASE_RECORD).read_text())
    weights = load_file(base / "model.safetensors")
    assert record["format"] == "tether-base-v1" and record["dtype"] == "float32"
    assert record["base"] == str(base.resolve())
    assert record["embedding_rows"] == 300  # as saved: the adapter's own copy has the pad's 301
    assert record["parameters"] == sum(w.numel() for w in weights.values())
    assert sorted(name for name, _, _ in record["tensors"]) == sorted(weights)
    assert SAMPLES == 8
    for name, shape, values in record["tensors"]:
        flat = weights[name].reshape(-1)
        n = flat.numel()
        positions = [0, *((n - 1) * i // 7 for i in range(1, 7)), n - 1]  # first, 6 between, last
        assert shape == list(weights[name].shape)
        assert values == flat[positions].tolist(), name


def test_every_lora_stage_saves_the_record_of_its_base(root, tiny_model_dir, tiny_llama_dir,
                                                      tmp_path_factory):
    """rm and dpo continuing from an SFT adapter, ppo from the bare base: the record is the SFT
    adapter's (the same base, loaded alike); `merged/` is a plain model and has none."""
    out = tmp_path_factory.mktemp("stages")
    sft = {fam: root / "runs" / f"lora_{fam}" / "final" for fam in FAMILIES}
    offline = ["--output-dir", str(out), "--max-steps", "1", "--batch-size", "4", "--lora-r", "4",
               *CPU]
    assert main(["rm", "--model", str(sft["gpt2"]), "--data", str(root / "prefs.jsonl"),
                 "--run-name", "rm", "--merge-lora", *offline]) == 0
    assert main(["dpo", "--model", str(sft["llama"]), "--data", str(root / "prefs.jsonl"),
                 "--run-name", "dpo", *offline]) == 0
    assert main(["ppo", "--policy", str(tiny_model_dir), "--prompts", str(root / "prompts.jsonl"),
                 "--reward-fn", f"{root / 'rewards.py'}:score", "--output-dir", str(out),
                 "--run-name", "ppo", "--total-episodes", "4", "--batch-size", "4",
                 "--max-new-tokens", "4", "--lora-r", "4", *CPU]) == 0
    for run, fam in (("rm", "gpt2"), ("dpo", "llama"), ("ppo", "gpt2")):
        saved = json.loads((out / run / "final" / BASE_RECORD).read_text())
        # the same record, but for where the base is seen from the adapter (issue 32)
        here = saved.pop("base_from_adapter")
        assert (out / run / "final" / here).resolve() == Path(saved["base_absolute"]), run
        expected = json.loads((sft[fam] / BASE_RECORD).read_text())
        expected.pop("base_from_adapter")
        assert saved == expected, run
    assert not (out / "rm" / "merged" / BASE_RECORD).exists()


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_peft_loaders_ignore_the_record(fam, root):
    adapter = root / "runs" / f"lora_{fam}" / "final"
    assert (adapter / BASE_RECORD).is_file()
    with_peft = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).merge_and_unload()
    with_tether = load_causal_lm(str(adapter), load_tokenizer(str(adapter)))
    ids = torch.tensor([[5, 17, 40, 33, 9, 21]])
    with torch.no_grad():
        torch.testing.assert_close(with_tether(input_ids=ids).logits,
                                   with_peft(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_the_base_in_another_dtype_is_the_same_base(fam, root, request):
    """The record was taken in float32; the same checkpoint loaded in bfloat16 or float16 rounds
    every weight and still passes, while the same-shape other base still fails in those dtypes."""
    base = request.getfixturevalue(FAMILIES[fam])
    adapter = root / "runs" / f"lora_{fam}" / "final"
    for dtype in (torch.bfloat16, torch.float16):
        same = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        check_base(adapter, base_record(same, str(base)), str(base))
        other = AutoModelForCausalLM.from_pretrained(root / f"{fam}_same", dtype=dtype)
        with pytest.raises(TetherError, match="the same shapes but other weights"):
            check_base(adapter, base_record(other, "other"), "other")


def test_generate_in_bfloat16_from_a_float32_adapter(root, tiny_model_dir, tmp_path):
    out = tmp_path / "samples.jsonl"
    assert main(["generate", "--model", str(root / "runs" / "lora_gpt2" / "final"), "--prompts",
                 str(root / "prompts.jsonl"), "--output", str(out), "--dtype", "bfloat16",
                 "--max-new-tokens", "4", *CPU]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_a_light_fine_tune_of_the_base_is_another_base(root, tiny_llama_dir, tmp_path, capsys):
    """Every weight moved by about 1e-4 of its size (one small optimiser step, in effect): the
    shapes agree and the values differ at the sampled positions, so float32 tells them apart."""
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_llama_dir, tuned)
    state = load_file(tuned / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    state = {k: v * (1 + 1e-4 * torch.randn(v.shape, generator=gen)) for k, v in state.items()}
    save_file(state, tuned / "model.safetensors", metadata={"format": "pt"})
    adapter = tmp_path / "adapter"
    shutil.copytree(root / "runs" / "lora_llama" / "final", adapter)
    _set_base_to(adapter, tuned)
    refused(tmp_path, ["generate", "--model", str(adapter), "--prompts",
                       str(root / "prompts.jsonl"), "--output", str(tmp_path / "s.jsonl"), *CPU],
            ANOTHER + r"the same shapes but other weights \(model.embed_tokens.weight", capsys)


def _set_base_to(adapter, base):
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(config))


def test_deleting_the_record_applies_the_adapter_anyway(root, tmp_path):
    """The documented way out (an adapter moved onto a base on purpose): without the record, the
    path check is all there is, as for peft's own adapters."""
    adapter = tmp_path / "adapter"
    shutil.copytree(root / "variants" / "gpt2_same", adapter)
    (adapter / BASE_RECORD).unlink()
    assert main(["generate", "--model", str(adapter), "--prompts", str(root / "prompts.jsonl"),
                 "--output", str(tmp_path / "s.jsonl"), "--max-new-tokens", "4", *CPU]) == 0


def test_an_unrecorded_adapter_loads_as_peft_loads_it(tiny_llama_dir, tmp_path):
    """peft's own adapter (no record, no pad token: tether adds one on a new row): its logits
    over the base's vocabulary equal peft's merged model's."""
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # B = 0 would leave the base unchanged: nothing to compare
    adapter = tmp_path / "peft_adapter"
    peft.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(adapter)
    assert not (adapter / BASE_RECORD).exists()
    ids = torch.tensor([[0, 17, 40, 33, 9, 21]])
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        bare = fresh(input_ids=ids).logits
        expected = PeftModel.from_pretrained(fresh, str(adapter)).merge_and_unload()(
            input_ids=ids).logits  # merged into `fresh` in place
        tokenizer = load_tokenizer(str(adapter))
        got = load_causal_lm(str(adapter), tokenizer)(input_ids=ids).logits
    assert got.shape[-1] == 301 and expected.shape[-1] == 300  # the pad row tether added
    torch.testing.assert_close(got[..., :300], expected, rtol=1e-5, atol=1e-6)
    assert (expected - bare).abs().max() > 1e-2  # the adapter matters


def test_the_tolerance_between_dtypes_by_hand():
    # One dtype: the same checkpoint loads bit for bit, so nothing is tolerated.
    assert _tolerance("float32", "float32") == (0.0, 0.0)
    # float32 against bfloat16: bf16's eps 2^-7 relative, and its smallest normal 2^-126
    assert _tolerance("float32", "bfloat16") == (2.0**-7, 2.0**-126)
    # float16 against float32: fp16's eps 2^-10, and below 2^-14 fp16 keeps fewer bits
    assert _tolerance("float16", "float32") == (2.0**-10, 2.0**-14)
    # 1 rounded to bf16 neighbours differs by 2^-8 <= 2^-7 * (1 + 2^-8): the same value
    assert _close([1.0], [1.0 + 2.0**-8], 2.0**-7, 0.0)
    # 1.01 is 0.01 away, more than 2^-7 * 1.01 = 0.0079: another value
    assert not _close([1.0], [1.01], 2.0**-7, 0.0)
    assert not _close([1.0], [1.0 + 2.0**-23], 0.0, 0.0)  # one float32 ulp in one dtype
    assert _close([float("nan")], [float("nan")], 0.0, 0.0)
    assert not _close([float("nan")], [1.0], 2.0**-7, 0.0)
