"""`tether sweep` against bad grids (issue 23): one `error:` line, exit 2, nothing written; and the
legitimate edits (points added, points removed) doing the right thing.

- a grid that is not a mapping, a key of the wrong type, a bad field of either stage: refused
  before any run starts;
- a grid point given twice (`beta: [0.1, 0.1]`, `[1, 1.0]`, `seeds: [0, 0]`): refused, naming
  the axis and both values (it used to train one run twice and count it as two seeds);
- run names distinct by construction, so no two runs (no two --jobs workers) share a directory;
- a grid changed under runs already in the sweep directory: refused, naming the runs and the
  fields; adding points is no change; removing points leaves those runs out of the report.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re

import pytest
import yaml

from tether.cli import main
from tether.errors import TetherError
from tether.tools.sweep_plan import plan, state

PROMPTS = ["the movie was", "it"]
REWARDS = "def length(prompts, responses):\n    return [len(r) / 10.0 for r in responses]\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Prompts, preference pairs and a reward function; each test writes its grids beside them."""
    root = tmp_path_factory.mktemp("sweep_guard")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": " good.", "rejected": " bad."}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARDS)
    return root


def _ppo_grid(base, model_dir, name: str, **ppo) -> dict:
    fn = f"{base / 'rewards.py'}:length"
    return {"name": name, "output_dir": str(base / "runs"), "seeds": [0],
            "ppo": {"policy": str(model_dir), "prompts": str(base / "prompts.jsonl"),
                    "eval_prompts": str(base / "prompts.jsonl"), "reward_fn": fn, "gold_fn": fn,
                    "batch_size": 2, "total_episodes": 2, "max_new_tokens": 3, "device": "cpu",
                    "report_to": "none", **ppo}}


def _write(base, spec, file: str = "grid.yaml") -> str:
    path = base / file
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _tree(root) -> dict[str, str]:
    """Every file's hash and every directory under `root`: what 'nothing written' compares."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _refused(argv, capsys, pattern: str) -> str:
    """exit 2, exactly one stderr line, `error: ...` matching `pattern`."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "Traceback" not in err, err
    assert re.search(pattern, err), err
    return err


# ------------------------------------------------------------------------ grids refused at once

def _edit(**top):
    return lambda spec: spec.update(top)


def _edit_ppo(**fields):
    return lambda spec: spec["ppo"].update(fields)


BAD_GRIDS = [  # (id, the grid file's text or an edit of a good grid, what the one line says)
    ("list", "- a\n- b\n",  # was "unknown key 'a'"
     r"grid .*grid.yaml must be a YAML mapping of name, output_dir, seeds, ppo, dpo, eval, bon, "
     r"interpolate \(got list\)"),
    ("list-of-mappings", "- {ppo: {beta: 0.1}}\n",  # was a TypeError traceback
     r"must be a YAML mapping .*\(got list\)"),
    ("number", "5\n", r"must be a YAML mapping .*\(got int\)"),  # was a TypeError traceback
    ("string", "hello\n", r"must be a YAML mapping .*\(got str\)"),  # was "unknown key 'e'"
    ("unknown-key", _edit(bogus=1), r"unknown key 'bogus'; allowed: name, output_dir"),
    ("eval-list", _edit(eval=[1, 2]),  # was a TypeError traceback
     r"'eval' must be a mapping of eval fields, got \[1, 2\]"),
    ("name-list", _edit(name=["a"]),  # made a sweep folder named "['a']"
     r"'name' must be a plain name, got \['a'\]"),
    ("output-dir-number", _edit(output_dir=5),  # was a TypeError traceback
     r"'output_dir' must be a path, got 5"),
    ("seeds-number", _edit(seeds=3), r"'seeds' must be a non-empty list of integers"),
    ("empty-axis", _edit_ppo(beta=[]), r"ppo axis 'beta' is an empty list; give it values"),
    ("beta-word-in-axis", _edit_ppo(beta=["high", 0.1]),
     r"grid: ppo-betahigh-seed0: config field 'beta' must be a number"),
    ("beta-word", _edit_ppo(beta="high"),
     r"grid: ppo-seed0: config field 'beta' must be a number, got 'high'"),
    ("beta-mapping", _edit_ppo(beta={"a": 1}), r"config field 'beta' must be a number"),
    ("unknown-field", _edit_ppo(bogus=1),  # was the ~90 ppo fields on one line
     r"grid: unknown config field 'bogus' in the 'ppo' block; see tether ppo --help$"),
    ("near-miss-field", _edit_ppo(beta_ed=1), r"'beta_ed' in the 'ppo' block; did you mean 'beta_end'\?"),
    ("trl-field", _edit_ppo(num_generations=8),
     r"grid: config field 'num_generations' in the 'ppo' block is TRL's name; tether's is "
     r"samples_per_prompt \(docs/from_trl.md\)"),
    # one grid point twice: one run trained twice (its second try failing) and counted as 2 seeds
    ("repeat-0.1", _edit_ppo(beta=[0.1, 0.1]),
     r"grid: ppo axis 'beta' lists one setting twice \(0.1 and 0.1\), so two runs would train "
     r"the same thing .*remove the repeat"),
    ("repeat-1-1.0", _edit_ppo(beta=[1, 1.0]),
     r"ppo axis 'beta' lists one setting twice \(1 and 1.0\)"),
    # YAML 1.1 reads 1e-4 as a string, which the config reads as 0.0001: the same run
    ("repeat-1e-4-0.0001", _edit_ppo(beta=["1e-4", 0.0001]),
     r"axis 'beta' lists one setting twice \('1e-4' and 0.0001\)"),
    ("repeat-list-value", _edit_ppo(stop_strings=[["a"], ["a"]]),
     r"axis 'stop_strings' lists one setting twice"),
    ("repeat-second-axis", _edit_ppo(beta=[0.1, 0.2], lr=[1, 1.0]),
     r"axis 'lr' lists one setting twice \(1 and 1.0\)"),
    ("repeat-seed", _edit(seeds=[0, 1, 0]),
     r"'seeds' lists 0 twice, so two runs would train the same thing"),
]


@pytest.mark.parametrize("bad, pattern", [pytest.param(b, p, id=i) for i, b, p in BAD_GRIDS])
def test_a_bad_grid_is_one_line_and_writes_nothing(bad, pattern, base, tiny_model_dir, capsys):
    spec = bad if isinstance(bad, str) else _ppo_grid(base, tiny_model_dir, "bad")
    if callable(bad):
        bad(spec)
    grid = _write(base, spec)
    before = _tree(base)
    _refused(["sweep", grid], capsys, pattern)
    assert _tree(base) == before  # no sweep directory, no run directory, no file changed


def test_a_bad_dpo_field_is_refused_before_any_run(base, tiny_llama_dir, capsys):
    # It used to be planned and fail only when its run came up, after the others had run.
    spec = {"name": "bad", "output_dir": str(base / "runs"),
            "eval": {"prompts": str(base / "prompts.jsonl"),
                     "gold_fn": f"{base / 'rewards.py'}:length"},
            "dpo": {"model": str(tiny_llama_dir), "data": str(base / "pairs.jsonl"),
                    "loss": ["sigmoid", "ipo"], "beta": "high"}}
    grid = _write(base, spec)
    before = _tree(base)
    _refused(["sweep", grid], capsys, r"grid: dpo-losssigmoid-seed0: config field 'beta' must be "
                                      r"a number, got 'high'")
    assert _tree(base) == before


# ------------------------------------------------------------------------ names and paths

def test_run_names_are_distinct_by_construction(base, tiny_model_dir):
    def names(**ppo):
        grid = _write(base, _ppo_grid(base, tiny_model_dir, "names", **ppo))
        return [run.name for run in plan(grid).runs]

    # Values that read apart keep their plain names (a finished sweep's runs are found again).
    assert names(beta=[0.0, 0.05, 0.5, 1e-7]) == [
        "ppo-beta0-seed0", "ppo-beta0.05-seed0", "ppo-beta0.5-seed0", "ppo-beta1e_07-seed0"]
    # Both used to be ppo-beta0.123457-seed0 (format :g keeps 6 digits): with --jobs 2 two
    # workers trained in one directory. A float that would read alike is written in full.
    assert names(beta=[0.1234567, 0.1234568, 0.5]) == [
        "ppo-beta0.1234567-seed0", "ppo-beta0.1234568-seed0", "ppo-beta0.5-seed0"]

    # Strings that slug alike ('/' becomes '_'), or differ only in case (one directory on a
    # case-insensitive disk), get 6 hex digits of their value's hash.
    def tagged(value) -> str:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:6]

    assert names(stop_strings=[["a/b"], ["a_b"]]) == [
        f"ppo-stop_strings__a_b___{tagged(['a/b'])}-seed0",
        f"ppo-stop_strings__a_b___{tagged(['a_b'])}-seed0"]
    got = names(stop_strings=[["A"], ["a"]])
    assert len({name.lower() for name in got}) == 2
    assert got == [f"ppo-stop_strings__A___{tagged(['A'])}-seed0",
                   f"ppo-stop_strings__a___{tagged(['a'])}-seed0"]


def test_an_empty_list_for_a_list_field_is_its_value_not_an_axis(base, tiny_model_dir):
    # `stop_strings: []` (no stop strings) used to be refused as "an empty axis".
    sweep = plan(_write(base, _ppo_grid(base, tiny_model_dir, "empty", stop_strings=[])))
    assert [run.name for run in sweep.runs] == ["ppo-seed0"]
    assert sweep.runs[0].fields["stop_strings"] == [] and sweep.axes == {"ppo": []}


def test_tilde_in_the_output_dir_is_the_home_directory(base, tiny_model_dir, tmp_path,
                                                       monkeypatch):
    # `output_dir: ~/x` used to create a folder literally named `~` in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = _ppo_grid(base, tiny_model_dir, "home")
    spec["output_dir"] = "~/x"
    grid = _write(base, spec)
    sweep = plan(grid)
    assert sweep.root == tmp_path / "x" / "home"
    assert sweep.runs[0].fields["output_dir"] == str(tmp_path / "x" / "home")
    assert plan(grid, "~/y").root == tmp_path / "y" / "home"  # --output-dir '~/y', quoted


# ------------------------------------------------------------------------ a grid edited later

def _results(root) -> list[str]:
    return sorted({row["run"] for row in csv.DictReader((root / "results.csv").open())})


def test_a_grid_changed_under_finished_runs_is_refused(base, tiny_model_dir, capsys):
    spec = _ppo_grid(base, tiny_model_dir, "edited", beta=[0.0, 0.5])
    grid = _write(base, spec, "edited.yaml")
    assert main(["sweep", grid]) == 0, capsys.readouterr().err
    root = base / "runs" / "edited"
    finished = _tree(root)

    # A field that changes what is trained: the old runs would be reported as the new grid's.
    spec["ppo"]["lr"] = 0.5
    _write(base, spec, "edited.yaml")
    err = _refused(["sweep", grid], capsys, "the grid changed under 2 run")
    assert err == (
        f"error: the grid changed under 2 run(s) already in {root}: ppo-beta0-seed0 (lr: 1e-05 "
        "-> 0.5), ppo-beta0.5-seed0 (lr: 1e-05 -> 0.5); to keep them, give the new grid another "
        "'name:' or --output-dir; to redo them under this grid, delete those run directories "
        "(for an evaluation alone, its eval.json); or restore the grid's old values")
    assert _tree(root) == finished  # report.html, results.csv, plan/, the runs: as they were

    # A field that changes no result (logging, device) is no change: nothing to run.
    spec["ppo"].pop("lr")
    spec["ppo"]["log_every"] = 7
    _write(base, spec, "edited.yaml")
    capsys.readouterr()
    assert main(["sweep", grid]) == 0
    assert "0 to run" in capsys.readouterr().out

    # A point added: only it runs; the finished runs are kept byte for byte.
    spec["ppo"]["beta"] = [0.0, 0.5, 1.0]
    _write(base, spec, "edited.yaml")
    assert main(["sweep", grid]) == 0
    assert "1 to run" in capsys.readouterr().out
    assert _results(root) == ["ppo-beta0-seed0", "ppo-beta0.5-seed0", "ppo-beta1-seed0"]
    for name in ("ppo-beta0-seed0", "ppo-beta0.5-seed0"):
        assert {k: v for k, v in _tree(root).items() if k.startswith(name)} == {
            k: v for k, v in finished.items() if k.startswith(name)}

    # A point removed: the report is the grid's as it is now; the run stays on disk, named.
    spec["ppo"]["beta"] = [0.5, 1.0]
    _write(base, spec, "edited.yaml")
    kept = {k: v for k, v in _tree(root).items() if k.startswith("ppo-beta0-seed0")}
    assert main(["sweep", grid]) == 0
    out = capsys.readouterr().out
    assert (f"sweep: 1 run(s) in {root} are not in this grid; kept as they are, left out of "
            "the report: ppo-beta0-seed0") in out
    assert _results(root) == ["ppo-beta0.5-seed0", "ppo-beta1-seed0"]
    page = (root / "report.html").read_text()
    assert re.search(r"<p id='left-out' class='note'>1 run\(s\) .* left out: ppo-beta0-seed0", page)
    assert "PPO beta 0.5" in page and "PPO beta 1<" in page and "PPO beta 0<" not in page
    assert {k: v for k, v in _tree(root).items() if k.startswith("ppo-beta0-seed0")} == kept


def test_a_path_recorded_absolute_is_the_grids_relative_one(base, tiny_model_dir, capsys,
                                                           monkeypatch):
    # A run may record its paths absolute where the grid gives them relative to the directory
    # the sweep starts from: the same file, no change. Another file is a change.
    monkeypatch.chdir(base)
    spec = _ppo_grid(base, tiny_model_dir, "relative")
    spec["ppo"]["prompts"] = "prompts.jsonl"
    grid = _write(base, spec, "relative.yaml")
    assert main(["sweep", grid]) == 0, capsys.readouterr().err
    config = base / "runs" / "relative" / "ppo-seed0" / "config.yaml"
    recorded = yaml.safe_load(config.read_text())
    for as_recorded in (str(base / "prompts.jsonl"), "prompts.jsonl", "./prompts.jsonl"):
        config.write_text(yaml.safe_dump({**recorded, "prompts": as_recorded}, sort_keys=False))
        capsys.readouterr()
        assert main(["sweep", grid]) == 0
        assert "0 to run" in capsys.readouterr().out
    (base / "other.jsonl").write_text((base / "prompts.jsonl").read_text())
    spec["ppo"]["prompts"] = "other.jsonl"
    _write(base, spec, "relative.yaml")
    _refused(["sweep", grid], capsys, r"ppo-seed0 \(prompts: '\./prompts.jsonl' -> '(.*/)?"
                                      r"other.jsonl'\)")


def test_a_dpo_evaluation_changed_or_unreadable_is_refused(base, tiny_llama_dir, capsys):
    # Llama-style model; the DPO run is trained once, then only its evaluation is in question.
    spec = {"name": "dpo-eval", "output_dir": str(base / "runs"),
            "eval": {"prompts": str(base / "prompts.jsonl"), "max_new_tokens": 3,
                     "gold_fn": f"{base / 'rewards.py'}:length", "device": "cpu"},
            "dpo": {"model": str(tiny_llama_dir), "data": str(base / "pairs.jsonl"),
                    "batch_size": 2, "max_steps": 1, "save_every": 0, "device": "cpu",
                    "report_to": "none"}}
    grid = _write(base, spec, "dpo.yaml")
    assert main(["sweep", grid]) == 0, capsys.readouterr().err
    run = base / "runs" / "dpo-eval" / "dpo-seed0"
    trained = {k: v for k, v in _tree(run).items() if k.startswith("final")}
    finished = _tree(run.parent)

    spec["eval"]["max_new_tokens"] = 4
    _write(base, spec, "dpo.yaml")
    _refused(["sweep", grid], capsys, r"dpo-seed0 \(evaluation max_new_tokens: 3 -> 4\); .*for "
                                      r"an evaluation alone, its eval.json")
    assert _tree(run.parent) == finished

    # The fix the line names: without its eval.json the run is evaluated again, not retrained.
    (run / "eval.json").unlink()
    capsys.readouterr()
    assert main(["sweep", grid]) == 0, capsys.readouterr().err
    assert json.loads((run / "eval.json").read_text())["config"]["max_new_tokens"] == 4
    assert {k: v for k, v in _tree(run).items() if k.startswith("final")} == trained

    # A damaged eval.json used to end the report in a JSONDecodeError traceback.
    (run / "eval.json").write_text('{"metrics": {"eval/kl"')
    damaged = _tree(run.parent)
    _refused(["sweep", grid], capsys, r"dpo-seed0 \(its eval.json cannot be read\)")
    assert _tree(run.parent) == damaged


def test_plan_refuses_a_repeat_in_python_too(base, tiny_model_dir):
    # The demo and notebooks call plan() directly: the same refusal, as a TetherError.
    grid = _write(base, _ppo_grid(base, tiny_model_dir, "py", beta=[0.1, 0.1]))
    with pytest.raises(TetherError, match=r"axis 'beta' lists one setting twice"):
        plan(grid)


def test_a_run_is_done_only_with_all_it_promised(base, tiny_model_dir):
    # A --merge-lora run with final/ but no merged/ (its final save failed) is resumed, which
    # completes it (RunDir.finished), rather than counted as done and reported without merged/.
    (plain,) = plan(_write(base, _ppo_grid(base, tiny_model_dir, "promised"))).runs
    (merging,) = plan(_write(base, _ppo_grid(base, tiny_model_dir, "promised", beta=[0.1],
                                             lora_r=2, merge_lora=True))).runs
    root = base / "runs" / "promised"
    assert state(plain) == state(merging) == "new"
    for run in (plain, merging):
        (root / run.name / "final").mkdir(parents=True)
    assert (state(plain), state(merging)) == ("done", "broken")
    (root / merging.name / "merged").mkdir()
    assert state(merging) == "done"
