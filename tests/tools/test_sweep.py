"""`tether sweep`: the grid, runs in worker processes, resume, the CSV and the frontier page."""

from __future__ import annotations

import csv
import json
import re

import pytest
import yaml
from pages import check_report_page

from tether.cli import main
from tether.errors import TetherError
from tether.tools.sweep_plan import plan

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
REWARDS = '''
def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]

def good_count(prompts, responses):
    return [float(r.count("good")) - 0.05 * len(r) for r in responses]
'''


@pytest.fixture
def grid(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                    for p in PROMPTS))
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": " good.", "rejected": " bad."}) + "\n"
        for p in PROMPTS))
    (tmp_path / "rewards.py").write_text(REWARDS)
    rewards = str(tmp_path / "rewards.py")
    spec = {"name": "s", "output_dir": str(tmp_path / "runs"), "seeds": [0],
            "ppo": {"policy": str(tiny_model_dir), "prompts": str(tmp_path / "prompts.jsonl"),
                    "eval_prompts": str(tmp_path / "prompts.jsonl"),
                    "reward_fn": f"{rewards}:length_reward", "gold_fn": f"{rewards}:good_count",
                    "batch_size": 4, "total_episodes": 8, "max_new_tokens": 5, "lr": 1e-2,
                    "device": "cpu", "save_every": 1, "beta": [0.0, 0.5]},
            "dpo": {"model": str(tiny_model_dir), "data": str(tmp_path / "pairs.jsonl"),
                    "batch_size": 4, "max_steps": 1, "device": "cpu", "save_every": 0,
                    "loss": ["sigmoid", "ipo"]}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_plan_names_each_grid_point_and_evaluates_dpo_as_ppo(grid):
    sweep = plan(str(grid))
    assert [r.name for r in sweep.runs] == ["ppo-beta0-seed0", "ppo-beta0.5-seed0",
                                            "dpo-losssigmoid-seed0", "dpo-lossipo-seed0"]
    assert sweep.axes == {"ppo": ["beta"], "dpo": ["loss"]}
    ppo_run, dpo_run = sweep.runs[1], sweep.runs[2]
    assert ppo_run.fields["beta"] == 0.5 and ppo_run.fields["eval_every"] == 1  # 2 batches
    # The DPO policy is scored with PPO's evaluation settings and rewards.
    ev = dpo_run.eval_fields
    assert ev["prompts"].endswith("prompts.jsonl") and ev["max_new_tokens"] == 5
    assert ev["gold_fn"].endswith(":good_count") and ev["batch_size"] == 4 and ev["seed"] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda g: g["ppo"].update(bogus=1), "unknown config field 'bogus' in the 'ppo' block"),
    (lambda g: g["ppo"].update(beta=[]), "empty list"),
    (lambda g: g["ppo"].update(run_name="x"), "set by the sweep"),
    (lambda g: g["ppo"].pop("gold_fn"), "gold_fn"),
    (lambda g: g.update(seeds="0"), "seeds"),
    (lambda g: g["ppo"].update(beta=[-1.0]), "beta"),
])
def test_bad_grids_fail_before_any_run(grid, edit, message):
    spec = yaml.safe_load(grid.read_text())
    edit(spec)
    grid.write_text(yaml.safe_dump(spec))
    with pytest.raises(TetherError, match=message):
        plan(str(grid))
    assert not (grid.parent / "runs").exists()


@pytest.mark.slow
def test_sweep_runs_resumes_and_reports(grid, tmp_path, capsys):
    assert main(["sweep", str(grid), "--jobs", "2"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "[0/4] sweep " in out and "4 to run, 2 at a time" in out and "[4/4] " in out
    # A clear winner is recommended by name; a tie says so first, then the rule's pick.
    said = (["Recommended beta"] if "Recommended beta: " in out else
            ["No clear winner", "The rule's pick: beta"])
    assert all(words in out for words in said), out
    root = tmp_path / "runs" / "s"
    rows = list(csv.DictReader((root / "results.csv").open()))
    # PPO: step 0, 1, 2 for each beta; DPO and IPO: one evaluation each.
    assert [(r["run"], r["step"]) for r in rows] == [
        ("ppo-beta0-seed0", "0"), ("ppo-beta0-seed0", "1"), ("ppo-beta0-seed0", "2"),
        ("ppo-beta0.5-seed0", "0"), ("ppo-beta0.5-seed0", "1"), ("ppo-beta0.5-seed0", "2"),
        ("dpo-losssigmoid-seed0", "0"), ("dpo-lossipo-seed0", "0")]
    assert float(rows[0]["kl"]) == 0.0 and rows[0]["beta"] == "0.0" and rows[6]["loss"] == "sigmoid"
    # The page: three figures decode, the recommendation and both stages' rows are there.
    check_report_page(root / "report.html", 3, {
        "recommended": said, "best-gold": ["best single evaluation"], "sweep-table": ["PPO beta 0.5", "DPO beta 0.1",
                                                             "IPO beta 0.1", "R²"]})

    # Resume: a finished run is kept as it is; a broken one (final model gone, checkpoint at
    # batch 1 kept) continues from its checkpoint.
    kept = (root / "ppo-beta0-seed0" / "metrics.jsonl").read_bytes()
    broken = root / "ppo-beta0.5-seed0"
    import shutil
    shutil.rmtree(broken / "final")
    shutil.rmtree(broken / "checkpoints" / "step_2")
    assert main(["sweep", str(grid)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "1 to run" in out and "resuming ppo-beta0.5-seed0" in out
    assert (root / "ppo-beta0-seed0" / "metrics.jsonl").read_bytes() == kept
    assert (broken / "final").is_dir()
    steps = [json.loads(x)["step"] for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(2) == 1  # batch 2 ran once more, not twice


def test_a_failing_run_is_reported_and_the_sweep_exits_1(grid, tmp_path, capsys):
    spec = yaml.safe_load(grid.read_text())
    del spec["dpo"]
    spec["ppo"]["beta"] = [0.1]
    (tmp_path / "broken.py").write_text("def gold(p, r):\n    raise ValueError('no gold today')\n")
    spec["ppo"]["gold_fn"] = f"{tmp_path / 'broken.py'}:gold"
    grid.write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(grid)]) == 1
    captured = capsys.readouterr()
    assert "1 run(s) failed" in captured.err
    # its progress line: the error line (no log: --jobs 1 runs it here, its output on the console)
    assert re.search(r"^\[1/1\] ppo-beta0.1-seed0 failed in \d+ s: .*no gold today.*; 0 running, "
                     "0 to start; ", captured.out, flags=re.M), captured.out
    page = (tmp_path / "runs" / "s" / "report.html").read_text()
    assert "no gold today" in page and "No PPO run finished" in page


def test_controller_target_and_estimator_axes(grid):
    # Any PPO field can be an axis: the controller, its target, the advantage estimator.
    spec = yaml.safe_load(grid.read_text())
    del spec["dpo"]
    spec["seeds"] = [0, 1]
    spec["ppo"].update(beta=0.1, kl_ctl=["fixed", "adaptive"], kl_target=[2.0, 4.0],
                       advantage=["gae", "rloo"], samples_per_prompt=2)
    grid.write_text(yaml.safe_dump(spec))
    sweep = plan(str(grid))
    assert len(sweep.runs) == 2 * 2 * 2 * 2  # three axes of two values, two seeds
    # named in the order the grid file lists the axes (this file was written sorted)
    assert sweep.runs[0].name == "ppo-advantagegae-kl_ctlfixed-kl_target2-seed0"
    assert {r.group for r in sweep.runs} == {r.name[:-6] for r in sweep.runs}
    assert sweep.runs[-1].fields["advantage"] == "rloo" and sweep.runs[-1].seed == 1


def test_a_bad_grid_is_one_line_and_exit_2_on_the_command_line(grid, capsys):
    spec = yaml.safe_load(grid.read_text())
    spec["ppo"]["bogus"] = 1
    grid.write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(grid)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: grid: unknown config field 'bogus' in the 'ppo' block; see tether ppo "
                   "--help")


def test_a_bon_block_puts_the_best_of_n_curve_beside_the_runs(grid, tmp_path, capsys):
    spec = yaml.safe_load(grid.read_text())
    del spec["dpo"]
    spec["bon"] = {"n": 3}
    spec["interpolate"] = {"points": [0, 0.5, 1]}  # of the smallest beta's run: ppo-beta0-seed0
    grid.write_text(yaml.safe_dump(spec))
    sweep = plan(str(grid))
    bon_run = sweep.runs[-1]
    assert sweep.runs[0].eval_fields["model"].endswith("ppo-beta0-seed0/final")
    assert sweep.runs[0].eval_fields["reference"] == spec["ppo"]["policy"]
    assert not sweep.runs[1].eval_fields
    assert [r.name for r in sweep.runs] == ["ppo-beta0-seed0", "ppo-beta0.5-seed0", "bon"]
    # the starting policy, on the held-out prompts, scored and sampled as PPO's evaluations
    assert bon_run.eval_fields["model"] == spec["ppo"]["policy"]
    assert bon_run.eval_fields["gold_fn"] == spec["ppo"]["gold_fn"]
    assert bon_run.eval_fields["max_new_tokens"] == 5 and bon_run.eval_fields["n"] == 3
    assert main(["sweep", str(grid)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    root = tmp_path / "runs" / "s"
    # the same pool as `tether bon` given those settings by hand
    ppo = spec["ppo"]
    alone = tmp_path / "alone.json"
    assert main(["bon", "--model", ppo["policy"], "--prompts", ppo["eval_prompts"], "--reward-fn",
                 ppo["reward_fn"], "--gold-fn", ppo["gold_fn"], "--max-new-tokens", "5",
                 "--batch-size", "4", "--device", "cpu", "--n", "3", "--output", str(alone)]) == 0
    assert (root / "bon" / "bon.json").read_bytes() == alone.read_bytes()
    assert "Best-of-3: gold" in out
    # the interpolation's ends: eta 0 is the start (KL 0), eta 1 the run's final policy, which
    # its last evaluation measured with the same prompts and noise
    rows = json.loads((root / "ppo-beta0-seed0" / "interpolate" / "interpolate.json").read_text())
    last = [json.loads(x) for x in (root / "ppo-beta0-seed0" / "metrics.jsonl").read_text()
            .splitlines() if "eval/gold_score" in x][-1]
    assert [r["eta"] for r in rows] == [0, 0.5, 1] and rows[0]["eval/kl"] == 0.0
    assert rows[-1]["eval/gold_score"] == last["eval/gold_score"]
    assert rows[-1]["eval/kl"] == pytest.approx(last["eval/kl"], rel=1e-5)
    assert "Interpolating ppo-beta0-seed0's weights from its start" in out
    assert "One curve for every setting (Gao et al.: a KL penalty acts as early stopping)" in out
    page = (root / "report.html").read_text()
    assert "id='best-of-n'" in page and "id='one-curve'" in page and "id='interpolated'" in page
    assert "best-of-n from one pool of 3 samples" in page
    # a grid changed under the baselines already made is refused, as under a run: their
    # reports would be the old settings' under the new grid's name
    for block, field, value, says in (("bon", "n", 4, "bon (n: 3 -> 4)"),
                                      ("interpolate", "points", [0, 1], "ppo-beta0-seed0 (points")):
        changed = yaml.safe_load(yaml.safe_dump(spec))
        changed[block][field] = value
        grid.write_text(yaml.safe_dump(changed))
        assert main(["sweep", str(grid)]) == 2
        assert says in capsys.readouterr().err
    # a bon block needs a ppo block and its own fields right: one line, nothing run
    for edit, says in ((lambda g: g.update(bon=[3]), "'bon' is a mapping of tether bon fields"),
                       (lambda g: g["interpolate"].update(run="ppo-x"), "not one of the grid's"),
                       (lambda g: g["interpolate"].update(points=[1, 0]), "--points 1.0,0.0 must"),
                       (lambda g: g["bon"].update(n=1), "a pool of 1")):
        bad = yaml.safe_load(yaml.safe_dump(spec))
        edit(bad)
        grid.write_text(yaml.safe_dump(bad))
        with pytest.raises(TetherError, match=says):
            plan(str(grid))
