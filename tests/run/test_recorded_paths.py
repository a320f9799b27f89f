"""A run directory records absolute paths (issue 23), so `tether eval`, `report` and `--resume`
give the same result from any working directory.

Each test works in two sibling directories: `here`, where the run is made with relative paths,
and `there`, which holds *other* models under the same names (the same tokenizer, other weights).
A path recorded relative and read against `there` would pick those: the tests show the result
from `there` equals the one from `here`, and that `there`'s models would have given another.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
import yaml
from offline_fixtures import other_weights, sft_rows, write_jsonl
from safetensors.torch import load_file

from tether.cli import main
from tether.run.parse import parse_config
from tether.run.paths import resolved_paths
from tether.run.rundir import RunDir
from tether.train import sft
from tether.train.offline_config import SFTConfig

PROMPTS = ["the movie was", "it", "the plot and", "music"]
SAMPLING = ["--device", "cpu", "--max-new-tokens", "4", "--batch-size", "2"]
FAMILIES = ["gpt2", "llama"]


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    root = tmp_path_factory.mktemp("places")
    here, there = root / "here", root / "there"
    for family, model in (("gpt2", tiny_model_dir), ("llama", tiny_llama_dir)):
        shutil.copytree(model, here / family)
        other_weights(model, there / family)
    (here / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (here / "reward.py").write_text("def score(prompts, responses):\n"
                                    "    return [len(r) / 10 for r in responses]\n")
    write_jsonl(here / "sft.jsonl", sft_rows(12))
    return here, there


def test_the_rules_for_each_kind_of_path_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local_model").mkdir()
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "r.py").write_text("")
    given = {"model": "gpt2", "policy": "org2/name", "ref_model": "local_model",
             "reward_model": "org/name", "data": "./missing/rows.jsonl", "output_dir": "runs",
             "output": "", "reward_fn": "r.py:score", "gold_fn": "task:gold",
             "runs": ["local_model", "nope"], "run_name": "local_model", "lr": 1.0}
    resolved = resolved_paths(given)
    assert resolved == {
        "model": "gpt2",  # no such local path: a hub name, kept
        "policy": "org2/name",
        "ref_model": str(tmp_path / "local_model"),  # exists here: absolute
        "reward_model": str(tmp_path / "org" / "name"),  # local first, as the loaders look
        "data": "./missing/rows.jsonl",  # missing: its error names what the user typed
        "output_dir": str(tmp_path / "runs"),  # outputs are always local
        "output": "",  # empty: the field's default place
        "reward_fn": f"{tmp_path / 'r.py'}:score",
        "gold_fn": "task:gold",  # no ./task.py: a module found on the import path
        "runs": [str(tmp_path / "local_model"), "nope"],
        "run_name": "local_model", "lr": 1.0}  # not paths
    monkeypatch.chdir(tmp_path / "org")  # a resolved record means the same from anywhere
    assert resolved_paths(resolved) == resolved


def test_a_tilde_is_expanded_in_yaml_and_flags(places, tmp_path, monkeypatch):
    here, _ = places
    home = tmp_path / "home"
    shutil.copytree(here / "gpt2", home / "m")
    shutil.copy(here / "reward.py", home / "r.py")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    (tmp_path / "c.yaml").write_text("output_dir: ~/runs\nmodel: ~/m\ndata: ~/missing.jsonl\n")
    cfg = parse_config(SFTConfig, ["--config", str(tmp_path / "c.yaml"), "--run-name", "t"])
    assert (cfg.output_dir, cfg.model) == (str(home / "runs"), str(home / "m"))
    assert cfg.data == str(home / "missing.jsonl")  # expanded, though missing
    assert main(["sft", "--model", "~/m", "--data", "sft.jsonl", "--run-name", "t",
                 "--output-dir", "~/runs", "--max-steps", "1", "--batch-size", "4",
                 "--device", "cpu", "--report-to", "none"]) == 0
    assert (home / "runs" / "t" / "final" / "model.safetensors").is_file()
    assert not (here / "~").exists()
    assert main(["eval", "--model", "~/runs/t/final", "--prompts", "prompts.jsonl", *SAMPLING,
                 "--reward-fn", "~/r.py:score", "--output", "~/e.json"]) == 0
    record = json.loads((home / "e.json").read_text())
    assert record["reference"] == str(home / "m")  # the run's --model, recorded expanded
    assert record["config"]["reward_fn"] == f"{home / 'r.py'}:score"
    assert not (here / "~").exists()


def _eval(model, prompts, output, *extra):
    return ["eval", "--model", model, "--prompts", prompts, *SAMPLING, "--output", str(output),
            *extra]


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_and_report_from_another_directory(family, places, tmp_path, monkeypatch):
    here, there = places
    monkeypatch.chdir(here)
    name = f"ppo-{family}"
    assert main(["ppo", "--policy", family, "--prompts", "prompts.jsonl", "--reward-fn",
                 "reward.py:score", "--run-name", name, "--output-dir", "runs", "--batch-size",
                 "2", "--total-episodes", "2", "--ppo-epochs", "1", "--max-new-tokens", "4",
                 "--device", "cpu", "--report-to", "none"]) == 0
    saved = yaml.safe_load((here / "runs" / name / "config.yaml").read_text())
    assert saved["policy"] == str(here / family)
    assert saved["prompts"] == str(here / "prompts.jsonl")
    assert saved["reward_fn"] == f"{here / 'reward.py'}:score"
    assert saved["output_dir"] == str(here / "runs")

    assert main(_eval(f"runs/{name}/final", "prompts.jsonl", tmp_path / "here.json")) == 0
    assert main(["report", f"runs/{name}", "--output", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_bytes()
    monkeypatch.chdir(there)
    final, prompts = f"../here/runs/{name}/final", "../here/prompts.jsonl"
    assert main(_eval(final, prompts, tmp_path / "there.json")) == 0
    assert main(["report", f"../here/runs/{name}", "--output", str(tmp_path / "report.html")]) == 0
    from_here = json.loads((tmp_path / "here.json").read_text())
    from_there = json.loads((tmp_path / "there.json").read_text())
    assert from_there["reference"] == from_here["reference"] == str(here / family)
    assert from_there["metrics"] == from_here["metrics"]
    assert (tmp_path / "report.html").read_bytes() == page
    # What reading the record against this directory would have given: another reference.
    assert main(_eval(final, prompts, tmp_path / "wrong.json", "--reference", family)) == 0
    wrong = json.loads((tmp_path / "wrong.json").read_text())["metrics"]
    assert wrong["eval/kl_exact"] > from_here["metrics"]["eval/kl_exact"] + 1e-3


def test_a_lora_adapter_records_its_base_portably(places, tmp_path, monkeypatch):
    # As typed, relative to where the run was made (issue 32: peft reads it there), and found by
    # tether beside the adapter from anywhere: `there` holds another `llama`, never picked.
    here, there = places
    monkeypatch.chdir(here)
    assert main(["sft", "--model", "llama", "--data", "sft.jsonl", "--run-name", "lora",
                 "--output-dir", "runs", "--max-steps", "1", "--batch-size", "4", "--lora-r", "2",
                 "--lr", "1e-2", "--device", "cpu", "--report-to", "none"]) == 0
    adapter = json.loads((here / "runs" / "lora" / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "llama"
    assert main(_eval("runs/lora/final", "prompts.jsonl", tmp_path / "here.json")) == 0
    monkeypatch.chdir(there)
    assert main(_eval("../here/runs/lora/final", "../here/prompts.jsonl",
                      tmp_path / "there.json")) == 0
    assert (json.loads((tmp_path / "there.json").read_text())["metrics"]
            == json.loads((tmp_path / "here.json").read_text())["metrics"])


class Stop(Exception):
    pass


def _stop_after(monkeypatch, n_steps):
    """The stage dies (like a killed job) in its (n_steps + 1)-th optimizer step."""
    real, calls = sft.optimizer_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) > n_steps:
            raise Stop
        return real(*args, **kwargs)
    monkeypatch.setattr(sft, "optimizer_step", step)


def _sft(model, data, output_dir, name, *extra):
    # GPT-2's dropout stays on in SFT: the resumed steps match only with the restored RNG
    return ["sft", "--model", model, "--data", data, "--run-name", name, "--output-dir",
            output_dir, "--max-steps", "3", "--batch-size", "4", "--save-every", "1", "--lr",
            "1e-3", "--device", "cpu", "--report-to", "none", *extra]


def _weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def _snapshot(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_from_another_directory(family, places, monkeypatch, capsys):
    here, there = places
    monkeypatch.chdir(here)
    whole, cut = f"whole-{family}", f"cut-{family}"
    assert main(_sft(family, "sft.jsonl", "runs", whole)) == 0
    _stop_after(monkeypatch, 1)
    with pytest.raises(Stop):
        main(_sft(family, "sft.jsonl", "runs", cut))
    monkeypatch.undo()
    monkeypatch.chdir(there)
    # The same relative name from here is another model (there's): a different run, refused.
    before = _snapshot(here / "runs" / cut)
    capsys.readouterr()
    assert main(_sft(family, "../here/sft.jsonl", "../here/runs", cut, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume with a different config") and "\n" not in err
    assert f"model: '{here / family}' -> '{there / family}'" in err
    assert _snapshot(here / "runs" / cut) == before
    # The same files by their paths from here: the run goes on, as if never stopped.
    assert main(_sft(f"../here/{family}", "../here/sft.jsonl", "../here/runs", cut,
                     "--resume")) == 0
    _same_weights(_weights(here / "runs" / whole), _weights(here / "runs" / cut))


def test_the_same_relative_flags_from_the_same_directory_are_no_change(places, monkeypatch):
    here, _ = places
    monkeypatch.chdir(here)
    argv = ["--model", "gpt2", "--data", "sft.jsonl", "--run-name", "same", "--output-dir", "runs"]
    first = parse_config(SFTConfig, argv)
    run = RunDir(first.output_dir, first.run_name)
    run.save_config(first)
    run.close()
    recorded = (here / "runs" / "same" / "config.yaml").read_bytes()
    again = parse_config(SFTConfig, [*argv, "--resume"])
    resumed = RunDir(again.output_dir, again.run_name, resume=True)
    assert resumed.save_config(again) == here / "runs" / "same" / "config.yaml"  # no change
    resumed.close()
    assert (here / "runs" / "same" / "config.yaml").read_bytes() == recorded


def test_an_old_run_with_relative_paths_resumes_as_before(places, monkeypatch):
    # Runs made before paths were resolved recorded them as typed; resumed from the directory
    # they were made in, with the same flags, they are no "changed" run.
    here, _ = places
    monkeypatch.chdir(here)
    assert main(_sft("gpt2", "sft.jsonl", "runs", "old-whole")) == 0
    _stop_after(monkeypatch, 1)
    with pytest.raises(Stop):
        main(_sft("gpt2", "sft.jsonl", "runs", "old"))
    monkeypatch.undo()
    monkeypatch.chdir(here)
    config = here / "runs" / "old" / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    assert saved["model"] == str(here / "gpt2")
    saved |= {"model": "gpt2", "data": "sft.jsonl", "output_dir": "runs"}  # as tether wrote it
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    relative = config.read_bytes()
    assert main(_sft("gpt2", "sft.jsonl", "runs", "old", "--resume")) == 0
    _same_weights(_weights(here / "runs" / "old-whole"), _weights(here / "runs" / "old"))
    assert config.read_bytes() == relative  # the record describes the run: left as it was
    assert os.path.isabs(yaml.safe_load((here / "runs" / "old-whole" / "config.yaml").read_text())
                         ["data"])


def test_a_module_in_the_current_directory_is_recorded_as_its_file(tmp_path, monkeypatch):
    """`task:gold` with ./task.py here means that file (the loader looks here first), so the
    record names it absolute: from another directory, with its own task.py, the same code loads."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.py").write_text("def gold(p, r):\n    return [1.0] * len(r)\n")
    resolved = resolved_paths({"gold_fn": "task:gold", "reward_fn": "tether.demo.task:gold_reward"})
    assert resolved == {"gold_fn": f"{tmp_path / 'task.py'}:gold",
                        "reward_fn": "tether.demo.task:gold_reward"}  # installed: kept
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "task.py").write_text("def gold(p, r):\n    return [0.0] * len(r)\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resolved_paths(resolved) == resolved
    from tether.run.user_code.load import load_function
    assert load_function(resolved["gold_fn"], "reward function")(["p"], ["r"]) == [1.0]
