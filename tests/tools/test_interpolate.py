"""`tether interpolate`: theta(eta) = theta_SFT + eta (theta_RL - theta_SFT) (WiSE-FT, WARP's LITI).

The truths checked here come from outside the code under test: the two ends are the input files'
tensors, bit for bit; the middle is the mean of the two, computed here as (a + b) / 2; a LoRA
point is checked through the merged weights tether's loader builds, against the base and the
merged RL adapter; and the model at eta 0, evaluated against --from, has KL exactly 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tether.cli import main

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
REWARDS = """
def length(prompts, responses):
    return [float(len(r)) for r in responses]

def good(prompts, responses):
    return [float(r.count("good")) for r in responses]
"""


def weights(model_dir) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def jittered(model_dir, out_dir, seed: int = 0) -> str:
    """A copy of the model at `model_dir` with every weight moved by noise: an "RL" model of the
    same architecture and shapes."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("interp_task")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARDS)
    return root


@pytest.fixture(scope="module")
def rl(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """For each family: (the SFT model, an RL model moved from it); and a LoRA adapter on the
    GPT-2 model with non-zero B."""
    from tether.models.lora import LoraSpec
    from tether.models.pretrained import load_tokenizer, load_trainable_lm
    from tether.models.saving import save_model

    root = tmp_path_factory.mktemp("interp_models")
    out = {"gpt2": (str(tiny_model_dir), jittered(tiny_model_dir, root / "gpt2-rl")),
           "llama": (str(tiny_llama_dir), jittered(tiny_llama_dir, root / "llama-rl", seed=1))}
    tokenizer = load_tokenizer(str(tiny_model_dir))
    lm = load_trainable_lm(str(tiny_model_dir), tokenizer, LoraSpec(4, 8.0, 0.0, "all-linear"))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in lm.peft.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    out["lora"] = (str(tiny_model_dir), str(save_model(lm.peft, tokenizer, root / "lora-rl")))
    return out


def interpolate(sft, rl_model, out, *extra) -> int:
    return main(["interpolate", "--from", sft, "--to", rl_model, "--output-dir", str(out),
                 "--device", "cpu", *extra])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_ends_are_the_models_bit_for_bit_and_the_middle_their_mean(family, rl, tmp_path,
                                                                         capsys):
    sft, rl_model = rl[family]
    out = tmp_path / "line"
    assert interpolate(sft, rl_model, out, "--points", "0,0.5,1") == 0, capsys.readouterr().err
    start, end = weights(sft), weights(rl_model)
    at = {eta: weights(out / f"eta{eta}") for eta in ("0", "0.5", "1")}
    assert set(start) == set(end) == set(at["0"]) == set(at["0.5"]) == set(at["1"])
    assert all(same_bits(at["0"][n], start[n]) and same_bits(at["1"][n], end[n]) for n in start)
    for name in start:  # the mean, computed another way: (a + b) / 2
        torch.testing.assert_close(at["0.5"][name], (start[name] + end[name]) / 2, rtol=0,
                                   atol=1e-7)
    assert not torch.equal(at["0.5"][name], start[name])  # really between, not a copy
    rows = json.loads((out / "interpolate.json").read_text())
    assert rows == [{"eta": eta, "path": str(out / f"eta{p}")}
                    for eta, p in ((0.0, "0"), (0.5, "0.5"), (1.0, "1"))]
    # loadable as any tether model: tokenizer and config came along
    from tether.models.pretrained import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(out / "eta0.5"))
    assert load_causal_lm(str(out / "eta0.5"), tokenizer).config.model_type in ("gpt2", "llama")


def test_a_lora_point_is_the_adapter_with_b_scaled(rl, tmp_path, capsys):
    from tether.models.lora import is_adapter
    from tether.models.pretrained import load_causal_lm, load_tokenizer

    base, adapter = rl["lora"]
    out = tmp_path / "line"
    assert interpolate(base, adapter, out, "--points", "0,0.5,1") == 0, capsys.readouterr().err
    trained, at = weights(adapter), {eta: weights(out / f"eta{eta}") for eta in ("0", "0.5", "1")}
    assert all(is_adapter(out / f"eta{eta}") for eta in at)  # an adapter per point, not merged
    assert all(same_bits(at["1"][n], trained[n]) for n in trained)
    for name, tensor in trained.items():
        if "lora_B" in name:
            assert torch.equal(at["0"][name], torch.zeros_like(tensor))
            torch.testing.assert_close(at["0.5"][name], tensor / 2, rtol=0, atol=1e-7)
        else:  # A and any saved embedding layers: the RL adapter's own
            assert same_bits(at["0"][name], tensor) and same_bits(at["0.5"][name], tensor)
    # Through tether's loader (the adapter merged into --from, found from its own record): eta 0
    # is the base exactly, eta 0.5 the mean of the base and the merged RL model.
    tokenizer = load_tokenizer(base)

    def merged(path):
        return load_causal_lm(str(path), tokenizer).state_dict()
    start, end, half, zero = (merged(p) for p in (base, adapter, out / "eta0.5", out / "eta0"))
    assert all(torch.equal(zero[n], start[n]) for n in start)
    moved = [n for n in start if not torch.equal(start[n], end[n])]
    assert moved
    for name in moved:
        torch.testing.assert_close(half[name], (start[name] + end[name]) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "lora"])
def test_each_point_is_evaluated_as_eval_does_with_kl_zero_at_the_start(family, rl, task,
                                                                        tmp_path, capsys):
    sft, rl_model = rl[family]
    out = tmp_path / "line"
    assert interpolate(sft, rl_model, out, "--points", "0,1", "--prompts",
                       str(task / "prompts.jsonl"), "--reward-fn",
                       f"{task / 'rewards.py'}:length", "--gold-fn", f"{task / 'rewards.py'}:good",
                       "--max-new-tokens", "4") == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    rows = json.loads((out / "interpolate.json").read_text())
    assert [row["eta"] for row in rows] == [0.0, 1.0]
    for row, eta in zip(rows, ("0", "1"), strict=True):
        record = json.loads((out / f"eta{eta}.eval.json").read_text())  # beside each point
        assert record["reference"] == sft
        assert {k: v for k, v in row.items() if k not in ("eta", "path")} == record["metrics"]
    assert rows[0]["eval/kl"] == 0.0 and rows[0]["eval/kl_exact"] == 0.0
    assert rows[1]["eval/kl_exact"] > 0
    assert "eval/gold_score" in rows[1] and "eval/kl_exact" in table


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A GPT-2 model of another vocabulary size: one architecture, other shapes."""
    from conftest import sample_texts

    from tether.models.tiny import save_tiny

    return str(save_tiny(tmp_path_factory.mktemp("narrow"), sample_texts(), vocab_size=280))


@pytest.mark.parametrize("case, message", [
    ("unsorted", "must be distinct etas"), ("repeated", "must be distinct etas"),
    ("outside", "must be distinct etas"), ("empty", "must be distinct etas"),
    ("architecture", "differ in model_type"), ("shapes", "differ in"),
    ("other base", "is a LoRA adapter on"), ("from adapter", "give full models"),
    ("to a hub name", "no safetensors"),
    ("not empty", "must be new or empty"), ("inside", "outside --from and --to"),
    ("gold without prompts", "scores the points on --prompts"), ("no weights", "no safetensors"),
    ("missing prompts", "not found"), ("device", "use --device cpu"),
])
def test_bad_input_is_one_line_and_nothing_is_written(case, message, rl, narrow, tmp_path,
                                                      no_loads, capsys):
    gpt2, gpt2_rl = rl["gpt2"]
    llama, _ = rl["llama"]
    _, adapter = rl["lora"]
    out = tmp_path / "line"
    args = {"unsorted": [gpt2, gpt2_rl, "--points", "0.5,0.25"],
            "repeated": [gpt2, gpt2_rl, "--points", "0,0.5,0.50"],
            "outside": [gpt2, gpt2_rl, "--points", "0,1.5"],
            "empty": [gpt2, gpt2_rl, "--points", ","],
            "architecture": [gpt2, llama], "shapes": [gpt2, narrow],
            "other base": [llama, adapter], "from adapter": [adapter, gpt2],
            "not empty": [gpt2, gpt2_rl], "inside": [gpt2, gpt2_rl],
            "gold without prompts": [gpt2, gpt2_rl, "--gold-fn", "x.py:f"],
            "no weights": [str(tmp_path), gpt2_rl], "to a hub name": [gpt2, "gpt2"],
            "missing prompts": [gpt2, gpt2_rl, "--prompts", str(tmp_path / "none.jsonl")],
            "device": [gpt2, gpt2_rl, "--prompts", str(tmp_path / "none.jsonl"), "--device",
                       "cuda"]}[case]
    if case == "device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs one without it")
    if case == "not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if case == "no weights":  # a model saved as a pickle (.bin) only, say
        args[0] = str(shutil.copytree(gpt2, tmp_path / "bin", ignore=shutil.ignore_patterns(
            "*.safetensors")))
    if case == "inside":
        out = Path(gpt2_rl) / "line"
    assert interpolate(args[0], args[1], out, *args[2:]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not out.exists() or [p.name for p in out.iterdir()] == ["keep.txt"]
    assert no_loads == []


def test_a_pad_row_tether_added_is_interpolated_from_the_row_tether_loads(tiny_model_dir, tmp_path):
    # An RL model whose tokenizer gained a pad token in training has one embedding row more
    # than its SFT model; tether loads the SFT model for that tokenizer with the new row at the
    # mean row (grow_embeddings), so that is the line's start: eta 0 is the SFT model as loaded.
    from transformers import AutoModelForCausalLM

    from tether.models.pretrained import grow_embeddings
    rl = jittered(tiny_model_dir, tmp_path / "rl")
    model = AutoModelForCausalLM.from_pretrained(rl)
    rows = model.get_input_embeddings().weight.shape[0]
    grow_embeddings(model, rows + 1)
    model.save_pretrained(rl)
    sft = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    grow_embeddings(sft, rows + 1)
    out = tmp_path / "line"
    assert main(["interpolate", "--from", str(tiny_model_dir), "--to", rl, "--points", "0,1",
                 "--output-dir", str(out)]) == 0
    start = weights(out / "eta0")
    assert all(torch.equal(start[name], param.detach()) for name, param in sft.state_dict().items()
               if name in start)
    assert start["transformer.wte.weight"].shape[0] == rows + 1
    end, given = weights(out / "eta1"), weights(rl)
    assert all(same_bits(end[name], given[name]) for name in given)
