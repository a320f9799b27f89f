"""A LoRA run directory copied elsewhere still loads (issue 32): with peft's own
`AutoPeftModelForCausalLM.from_pretrained(dir)`, and with tether from any directory; a base that
moved on its own is found with `--base` or re-pointed with `tether set-base`, and a wrong or
missing base is one line naming that fix (docs/loading.md, "Where an adapter's base is").

Each run is trained in a project directory with relative paths (`--model llama`), and the project
is then moved away, so the absolute paths of the training machine no longer exist: what loads
afterwards loads from what the adapter recorded portably.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from peft import AutoPeftModelForCausalLM
from refusals import refused, snapshot
from transformers import AutoModelForCausalLM

from tether.cli import main
from tether.models.adapter_checks import BASE_RECORD
from tether.models.pretrained import load_causal_lm, load_tokenizer

FAMILIES = {"gpt2": "tiny_model_dir", "llama": "tiny_llama_dir"}
CPU = ["--device", "cpu", "--report-to", "none"]
SAMPLING = ["--device", "cpu", "--max-new-tokens", "4", "--batch-size", "2"]
IDS = torch.tensor([[5, 17, 40, 33, 9, 21]])


@pytest.fixture(scope="module")
def stash(tmp_path_factory, request):
    """Per family, a project (the base, data, prompts, a LoRA SFT run made there with relative
    paths) moved away from where it was made: the paths recorded absolute point at nothing."""
    root = tmp_path_factory.mktemp("portable")
    cwd = os.getcwd()
    try:
        for family, fixture in FAMILIES.items():
            made = root / "made" / family
            shutil.copytree(request.getfixturevalue(fixture), made / family)
            write_jsonl(made / "sft.jsonl", sft_rows(8))
            write_jsonl(made / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
            os.chdir(made)
            assert main(["sft", "--model", family, "--data", "sft.jsonl", "--run-name", "lora",
                         "--output-dir", "runs", "--max-steps", "1", "--batch-size", "4",
                         "--lora-r", "2", "--lr", "1e-2", *CPU]) == 0
            os.chdir(cwd)
            made.rename(root / family)
    finally:
        os.chdir(cwd)
    return root


def _project(stash, family, tmp_path):
    project = tmp_path / "elsewhere" / "project"
    shutil.copytree(stash / family, project)
    return project


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_the_base_is_recorded_as_given_and_where_it_was(family, stash):
    final = stash / family / "runs" / "lora" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    record = json.loads((final / BASE_RECORD).read_text())
    assert config["base_model_name_or_path"] == family  # as typed, relative to the project
    assert record["base"] == family
    assert record["base_from_adapter"] == f"../../../{family}"
    assert record["base_absolute"] == str(stash / "made" / family / family)  # gone now
    assert not os.path.exists(record["base_absolute"])
    card = (final / "README.md").read_text()  # peft's model card names it the same way
    assert f"base_model: {family}\n" in card and str(stash) not in card


@pytest.mark.parametrize("family", FAMILIES)
def test_a_copied_project_loads_with_peft_and_with_tether(family, stash, tmp_path, monkeypatch):
    project = _project(stash, family, tmp_path)
    monkeypatch.chdir(project)  # peft reads the recorded name against the current directory
    plain = AutoPeftModelForCausalLM.from_pretrained("runs/lora/final").eval()
    expected = _logits(plain)
    tokenizer = load_tokenizer("runs/lora/final")
    torch.testing.assert_close(_logits(load_causal_lm("runs/lora/final", tokenizer).eval()),
                               expected, rtol=1e-5, atol=1e-6)
    # tether, from any directory: the base is found beside the adapter, where it moved with it
    monkeypatch.chdir(tmp_path)
    final = str(project / "runs" / "lora" / "final")
    torch.testing.assert_close(_logits(load_causal_lm(final, load_tokenizer(final)).eval()),
                               expected, rtol=1e-5, atol=1e-6)
    # and the adapter is not a no-op: the base alone gives other numbers
    bare = _logits(AutoModelForCausalLM.from_pretrained(project / family).eval())
    assert (bare - expected[..., :bare.shape[-1]]).abs().max() > 1e-4


def test_eval_of_a_moved_run_uses_its_moved_base_and_writes_beside_final(stash, tmp_path,
                                                                         monkeypatch):
    project = _project(stash, "llama", tmp_path)
    final = project / "runs" / "lora" / "final"
    before = snapshot(final)
    monkeypatch.chdir(tmp_path)  # not the project: its relative name would find nothing here
    assert main(["eval", "--model", str(final), "--prompts", str(project / "prompts.jsonl"),
                 *SAMPLING]) == 0
    written = json.loads((project / "runs" / "lora" / "final.eval.json").read_text())
    # the reference is the run's starting model, which config.yaml records where it was made:
    # that base is the adapter's, so it is found where the adapter's base is now
    assert written["reference"] == str(project / "llama")
    assert snapshot(final) == before  # the evaluated model is untouched
    assert main(["eval", "--model", str(final), "--prompts", str(project / "prompts.jsonl"),
                 "--reference", str(project / "llama"), "--output", "explicit.json",
                 *SAMPLING]) == 0
    assert json.loads((tmp_path / "explicit.json").read_text())["metrics"] == written["metrics"]
    # The base moves on its own: --base finds it, for the policy and for the default reference
    (project / "llama").rename(project / "moved_llama")
    final_eval = project / "runs" / "lora" / "final.eval.json"
    final_eval.unlink()
    assert main(["eval", "--model", str(final), "--prompts", str(project / "prompts.jsonl"),
                 "--base", str(project / "moved_llama"), *SAMPLING]) == 0
    again = json.loads(final_eval.read_text())
    assert again["reference"] == str(project / "moved_llama")
    assert again["metrics"] == written["metrics"]
    assert snapshot(final) == before


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def test_bon_of_a_run_whose_base_moved_finds_it_with_base(stash, tmp_path):
    project = _project(stash, "llama", tmp_path)
    args = ["bon", "--model", str(project / "runs" / "lora" / "final"), "--prompts",
            str(project / "prompts.jsonl"), "--n", "2", "--reward-fn",
            f"{__file__}:length_reward", *SAMPLING]
    assert main([*args, "--output", str(tmp_path / "before.json")]) == 0
    (project / "llama").rename(project / "moved_llama")
    assert main([*args, "--output", str(tmp_path / "after.json")]) == 2  # its base is gone
    assert main([*args, "--base", str(project / "moved_llama"), "--output",
                 str(tmp_path / "after.json")]) == 0
    assert (tmp_path / "after.json").read_text() == (tmp_path / "before.json").read_text()


def test_set_base_passes_trust_remote_code_to_the_loader(stash, tmp_path, monkeypatch):
    from tether.tools import set_base

    project = _project(stash, "llama", tmp_path)
    real, seen = set_base._from_pretrained, []

    def spy(*args):
        seen.append(args[-1])  # trust_remote_code, the last positional argument
        return real(*args)
    monkeypatch.setattr(set_base, "_from_pretrained", spy)
    adapter = str(project / "runs" / "lora" / "final")
    assert main(["set-base", adapter, "--base", str(project / "llama")]) == 0
    assert main(["set-base", adapter, "--base", str(project / "llama"),
                 "--trust-remote-code"]) == 0
    assert seen == [False, True]


def _generate(adapter, prompts, output, *extra):
    return ["generate", "--model", str(adapter), "--prompts", str(prompts), "--output",
            str(output), *SAMPLING, *extra]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_base_moved_on_its_own_is_found_with_base_or_set_base(family, stash, tmp_path,
                                                                 monkeypatch, capsys):
    project = _project(stash, family, tmp_path)
    monkeypatch.chdir(project)
    prompts = project / "prompts.jsonl"
    assert main(_generate("runs/lora/final", prompts, tmp_path / "before.jsonl")) == 0
    (project / "models").mkdir()
    (project / family).rename(project / "models" / family)  # the base moves, the run does not
    adapter = project / "runs" / "lora" / "final"

    line = refused(project, _generate("runs/lora/final", prompts, tmp_path / "g.jsonl"),
                   r"the base model of the adapter \S*runs/lora/final is not where it was "
                   r"recorded \(tried .*\); pass where it is now with --base PATH \(tether eval, "
                   r"generate\), or re-point the adapter once: tether set-base \S+ --base PATH",
                   capsys)
    assert str(project / family) in line  # where it looked, beside the adapter first

    # --base: the adapter is read, never written
    assert main(_generate("runs/lora/final", prompts, tmp_path / "with_base.jsonl", "--base",
                          f"models/{family}")) == 0
    same = (tmp_path / "before.jsonl").read_text()
    assert (tmp_path / "with_base.jsonl").read_text() == same
    refused(project, _generate(f"models/{family}", prompts, tmp_path / "g.jsonl", "--base",
                               f"models/{family}"),
            r"--base applies to a LoRA adapter directory, and --model \S+ is not one", capsys)

    # set-base with another model of the same shapes: refused, nothing rewritten
    other = tmp_path / "other"
    shutil.copytree(project / "models" / family, other)
    _jitter(other)
    refused(project, ["set-base", "runs/lora/final", "--base", str(other)],
            r"is not the model the adapter \S+ was trained on \(.*\): .*; pass the model it was "
            r"trained on with --base PATH \(tether eval, generate\), or re-point the adapter at "
            r"it: tether set-base \S+ --base PATH", capsys)

    # set-base with the right one: both files name it, tether and peft load without --base
    assert main(["set-base", "runs/lora/final", "--base", f"models/{family}"]) == 0
    assert f"base_model_name_or_path is now models/{family}" in capsys.readouterr().out
    config = json.loads((adapter / "adapter_config.json").read_text())
    record = json.loads((adapter / BASE_RECORD).read_text())
    assert config["base_model_name_or_path"] == record["base"] == f"models/{family}"
    assert record["base_from_adapter"] == f"../../../models/{family}"
    assert record["base_absolute"] == str(project / "models" / family)
    assert main(_generate("runs/lora/final", prompts, tmp_path / "after.jsonl")) == 0
    assert (tmp_path / "after.jsonl").read_text() == same
    plain = AutoPeftModelForCausalLM.from_pretrained("runs/lora/final")
    tether = load_causal_lm("runs/lora/final", load_tokenizer("runs/lora/final"))
    torch.testing.assert_close(_logits(plain.eval()), _logits(tether.eval()), rtol=1e-5,
                               atol=1e-6)


def test_an_adapter_given_as_the_base_is_refused_before_anything_loads(stash, tmp_path,
                                                                      monkeypatch, capsys):
    """An adapter directory passed where its base belongs: transformers would load the base that
    adapter names instead, here a relative name that finds nothing from this directory, so a hub
    name (before: 26 s of the hub's retries online, then "the weight files are damaged")."""
    project = _project(stash, "llama", tmp_path)
    monkeypatch.chdir(tmp_path)
    adapter = project / "runs" / "lora" / "final"

    def nothing_loads(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", nothing_loads)
    line = re.escape(f"--base {adapter} is a LoRA adapter directory (it has adapter_config.json), "
                     f"not a base model; point --base at the base model the adapter {adapter} "
                     "was trained on (its adapter_config.json names llama)")
    prompts = project / "prompts.jsonl"
    for argv in (["set-base", str(adapter), "--base", str(adapter)],
                 _generate(adapter, prompts, tmp_path / "g.jsonl", "--base", str(adapter)),
                 ["eval", "--model", str(adapter), "--prompts", str(prompts), "--base",
                  str(adapter), *SAMPLING]):
        refused(project, argv, line, capsys)


def _jitter(model_dir):
    """The same shapes, every weight moved a little: another model at a glance."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()},
              str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def test_an_adapter_from_before_the_location_fields_names_the_fix(stash, tmp_path, capsys):
    """An adapter saved before issue 32 records its base absolute only: moved, it is one line
    naming the fix, and set-base brings it up to date."""
    project = _project(stash, "llama", tmp_path)
    adapter = project / "runs" / "lora" / "final"
    gone = str(stash / "made" / "llama" / "llama")
    record = json.loads((adapter / BASE_RECORD).read_text())
    for key in ("base_absolute", "base_from_adapter"):
        del record[key]
    (adapter / BASE_RECORD).write_text(json.dumps(record | {"base": gone}))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps(config | {"base_model_name_or_path": gone}))
    prompts = project / "prompts.jsonl"
    refused(project, _generate(adapter, prompts, tmp_path / "g.jsonl"),
            rf"is not where it was recorded \(tried {gone}\); pass where it is now with --base",
            capsys)
    assert main(["set-base", str(adapter), "--base", str(project / "llama")]) == 0
    assert main(_generate(adapter, prompts, tmp_path / "g.jsonl")) == 0


def _cache_as_hub_repo(model_dir, cache, repo_id):
    """Lay a saved model out as huggingface_hub's cache does after a download of `repo_id`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


def test_a_hub_base_stays_a_hub_name(tiny_llama_dir, tmp_path):
    """A base given by hub name is recorded by that name alone (no local place), and the run
    directory copied anywhere loads with peft and tether from the hub cache. In subprocesses:
    huggingface_hub reads HF_HUB_CACHE once, at import."""
    _cache_as_hub_repo(tiny_llama_dir, tmp_path / "hub_cache", "tiny/llama")
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub_cache"),
                        "PYTHONPATH": os.pathsep.join(sys.path)}
    train = subprocess.run([sys.executable, "-m", "tether.cli", "sft", "--model", "tiny/llama",
                            "--data", "sft.jsonl", "--run-name", "lora", "--output-dir", "runs",
                            "--max-steps", "1", "--batch-size", "4", "--lora-r", "2", *CPU],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    final = tmp_path / "runs" / "lora" / "final"
    assert json.loads((final / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "tiny/llama"
    record = json.loads((final / BASE_RECORD).read_text())
    assert record["base"] == "tiny/llama" and "base_absolute" not in record
    shutil.copytree(final, tmp_path / "copied" / "final")
    code = ("import sys; from peft import AutoPeftModelForCausalLM; "
            "AutoPeftModelForCausalLM.from_pretrained('copied/final'); "
            "from tether.cli import main; sys.exit(main(['generate', '--model', 'copied/final', "
            "'--prompts', 'prompts.jsonl', '--output', 'g.jsonl', '--device', 'cpu', "
            "'--max-new-tokens', '4']))")
    load = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) == 2
