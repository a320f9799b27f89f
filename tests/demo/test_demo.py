"""`tether demo --quick` end to end through the CLI: every stage, the report, and no overwrite."""

from __future__ import annotations

import json

import pytest
from test_demo_report import check_rendered

from tether.cli import main


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path, capsys):
    # --jobs 2: the stages run in two worker processes whatever the machine's cores
    code = main(["demo", "--quick", "--output-dir", str(tmp_path), "--ppo-batches", "12",
                 "--sweep-batches", "4", "--jobs", "2"])
    assert code == 0, capsys.readouterr().err
    root = tmp_path / "demo"
    out = capsys.readouterr().out
    assert "report written to" in out and "ppo-no-kl" in out
    for run in ("sft", "rm", "ppo-no-kl-seed0", "ppo-fixed-seed0", "ppo-adaptive-seed0", "dpo",
                "ipo"):
        assert (root / run / "final" / "config.json").is_file(), run
    # Each PPO run evaluated at step 0 (the SFT policy, KL exactly 0) and kept its samples.
    lines = [json.loads(x) for x in (root / "ppo-fixed-seed0" / "metrics.jsonl").read_text()
             .splitlines()]
    evals = [x for x in lines if "eval/gold_score" in x]
    assert evals[0]["step"] == 0 and evals[0]["eval/kl"] == 0.0 and evals[-1]["step"] == 12
    samples = (root / "ppo-fixed-seed0" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == len(evals)
    # The three runs differ only in the leash: beta stays 0 and 0.1, the adaptive one moves
    # (its KL is below target early on, so beta falls from its start of 0.2).
    def betas(run):
        return [json.loads(x)["objective/beta"] for x in (root / run / "metrics.jsonl")
                .read_text().splitlines()]
    assert set(betas("ppo-no-kl-seed0")) == {0.0}
    assert set(betas("ppo-fixed-seed0")) == {0.1}
    adaptive = betas("ppo-adaptive-seed0")
    assert adaptive[0] == 0.2 and adaptive[-1] < 0.2
    check_rendered(root / "report.html", n_verdicts=5)  # no KL (2), adaptive, DPO, IPO
    # The SFT model scored offline gives the numbers every PPO run logged at its step 0.
    table = {line.split()[0] + line.split()[1]: line.split() for line in out.splitlines()
             if line.split()[:1] and line.split()[0] in ("sft", "ppo-no-kl", "ppo-fixed")}
    # (columns: run, seed, final proxy, start gold, ...; exact equality: test_eval.py)
    assert table["sft0"][3] == table["ppo-no-kl0"][3] == table["ppo-fixed0"][3]
    # The sweep section: its runs (the two extreme betas under --quick), its page, its CSV.
    for beta in ("0", "1"):
        assert (root / "sweep" / f"ppo-beta{beta}-seed0" / "final").is_dir(), beta
    page = (root / "report.html").read_text()
    assert "Which beta? A sweep" in page
    assert "Recommended beta" in page or "The rule&#x27;s pick: beta" in page
    assert (root / "sweep" / "report.html").is_file() and (root / "sweep" / "results.csv").is_file()
    # The page says the sweep's beta 0 is the first batches of ppo-no-kl seed 0 (same seed,
    # settings and constant lr; evaluation sampled apart from training): the same numbers.
    def gold_by_step(run_dir):
        return {x["step"]: x["eval/gold_score"] for x in map(json.loads, (
            run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/gold_score" in x}
    sweep_gold = gold_by_step(root / "sweep" / "ppo-beta0-seed0")
    main_gold = gold_by_step(root / "ppo-no-kl-seed0")
    assert sorted(sweep_gold) == [0, 2, 4]
    assert all(sweep_gold[s] == main_gold[s] for s in sweep_gold), (sweep_gold, main_gold)
    assert "beta 0 is the first 4 batches of ppo-no-kl seed 0" in page
    # the baselines beside the sweep's runs: best-of-8 of the SFT model, beta 0 interpolated
    assert [p["n"] for p in json.loads((root / "sweep" / "bon" / "bon.json").read_text())] == \
        list(range(1, 9))
    line = json.loads((root / "sweep" / "ppo-beta0-seed0" / "interpolate" / "interpolate.json")
                      .read_text())
    assert [p["eta"] for p in line] == [0, 0.5, 1] and line[0]["eval/kl"] == 0.0
    assert line[-1]["eval/gold_score"] == sweep_gold[4]  # eta 1: the run's own final policy
    assert "id='best-of-n'" in page and "id='interpolated'" in page

    # A stage run in a worker process gives the numbers it gives run here, one after another
    # (--jobs 1), bit for bit: every metric but the timings.
    from tether.demo import pipeline
    from tether.demo.config import DemoConfig

    cfg = DemoConfig(quick=True, ppo_batches=12, sweep_batches=4).scaled()
    paths = {k: str(root / "data" / f"{k}.jsonl") for k in ("prompts", "eval_prompts")}
    pipeline.run_ppo(tmp_path / "here", cfg, paths, str(root / "sft" / "final"),
                     str(root / "rm" / "final"), "ppo-fixed", 0)
    def numbers(run_dir):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")}
                for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert numbers(tmp_path / "here" / "ppo-fixed-seed0") == numbers(root / "ppo-fixed-seed0")
    # Each stage's output is in its log, and the console shows the progress over all stages.
    assert "ppo-fixed-seed0: step" not in out and "ppo-fixed-seed0: step 12/12" in (
        root / "logs" / "ppo-fixed-seed0.log").read_text()
    assert "[11/11] " in out and "s left" in out
    for claim in ("no KL penalty: the proxy keeps rising", "no KL penalty: gold first peaks",
                  "adaptive beta: KL stays", "DPO: gold rises", "IPO: gold rises"):
        assert out.count(claim) == 1, claim  # each verdict is printed once

    # A second run must not write over the first one's results.
    before = (root / "report.html").read_bytes()
    assert main(["demo", "--quick", "--output-dir", str(tmp_path)]) == 2
    assert "already holds a demo" in capsys.readouterr().err
    assert (root / "report.html").read_bytes() == before


@pytest.mark.parametrize("args, field", [(["--seeds", "0"], "seeds"),
                                         (["--kl-target", "-1"], "kl_target"),
                                         (["--run-name", "a/b"], "run_name"),
                                         (["--jobs", "-1"], "jobs")])
def test_demo_rejects_bad_settings_before_writing(tmp_path, capsys, args, field):
    assert main(["demo", "--output-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and field in err and "\n" not in err
    assert not any(tmp_path.iterdir())  # nothing written
