"""Options accepted and ignored, config files read two ways, and their neighbours (issue 33,
clusters 5, 8 and 9).

- An online option that acts only under another setting (`--scale-rewards` with --advantage grpo,
  the critic's and GAE's options, the controllers', `--kl-per-token-mean`, `--eval-every`) is
  refused where the user gave it and it would do nothing: as a flag (even at its default), in a
  hand-written --config file, changed in a run's recorded config.yaml, or in a sweep grid. Before,
  `tether rloo --scale-rewards batch` trained exactly as without it, exit 0.
- A YAML key given twice (PyYAML kept the last without a word), a --config that names a
  directory, `--threads 99999999999` (a ValueError from inside torch), `tether report` of a run
  whose config.yaml is a list (an AttributeError).
- A relative path in a run's config.yaml (tether writes absolute ones; a hand edit) was read
  against the caller's directory, so `tether eval` from another directory compared with another
  model (KL 49.6 where it is 0): now read against the run directory, and refused where only the
  current directory gives it a meaning, or each a different one.

Every refusal goes through the CLI with `refused` (exit 2, one line, nothing written), the checks
that need no model under a guard that fails any model load; each has a valid neighbour.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from offline_fixtures import other_weights, sft_rows, write_jsonl
from refusals import refused

from tether.cli import main
from tether.errors import TetherError
from tether.run.config import MAX_THREADS
from tether.run.parse import parse_config
from tether.run.scopes import scopes_of
from tether.train.ppo_config import GRPOConfig, PPOConfig, RLOOConfig

FAMILIES = ["gpt2", "llama"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("config_refusals")
    write_jsonl(base / "prompts.jsonl", [{"prompt": p} for p in ("the movie was", "it", "a", "b")])
    write_jsonl(base / "sft.jsonl", sft_rows(4))
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [len(r) / 10 for r in responses]\n")
    (base / "runs").mkdir()
    return base


def online(stage, *extra):
    return [stage, "--policy", "m", "--prompts", "prompts.jsonl", "--reward-fn",
            "rewards.py:score", "--run-name", "x", "--output-dir", "runs", *extra]


# ----------------------------------------------------------------------------- scoped options

SCOPED_CASES = [  # (stage, flags, the one line's pattern)
    ("rloo", ["--scale-rewards", "batch"], r"--scale-rewards applies with --advantage grpo, and "
     r"tether rloo runs with --advantage rloo, where it has no effect; drop it, or use tether grpo"),
    ("rloo", ["--scale-rewards", "group"], "--scale-rewards applies with --advantage grpo"),  # the default, named
    ("ppo", ["--scale-rewards", "none"], "tether ppo runs with --advantage gae"),
    ("ppo", ["--advantage", "reinforce++", "--scale-rewards", "batch"], "--advantage reinforce"),
    ("grpo", ["--lam", "0.9"], "--lam applies with --advantage gae, and tether grpo runs with "
     "--advantage grpo"),
    ("grpo", ["--whiten-advantages", "on"], "--whiten-advantages applies with --advantage gae"),
    ("rloo", ["--critic", "shared"], r"--critic applies with the critic of --advantage gae, and "
     "tether rloo runs with --advantage rloo, which has no critic"),
    ("grpo", ["--vf-coef", "0.5"], "--vf-coef applies with the critic"),
    ("rloo", ["--value-clip-range", "0.1"], "--value-clip-range applies with the critic"),
    ("rloo", ["--gamma", "0.9"], "--gamma applies with --advantage gae or reinforce..*rloo, which "
     "discounts nothing"),
    ("ppo", ["--kl-target", "3"], "--kl-target applies with --kl-ctl adaptive, and tether ppo "
     "runs with --kl-ctl fixed, .*pass --kl-ctl adaptive"),
    ("ppo", ["--kl-ctl", "annealed", "--kl-horizon", "50"], "--kl-horizon applies with --kl-ctl "
     "adaptive, and tether ppo runs with --kl-ctl annealed"),
    ("grpo", ["--kl-max-error", "0.1"], "--kl-max-error applies with --kl-ctl adaptive"),
    ("rloo", ["--beta-end", "0.01"], "--beta-end applies with --kl-ctl annealed"),
    ("ppo", ["--kl-ctl", "adaptive", "--anneal-batches", "3"], "--anneal-batches applies with "
     "--kl-ctl annealed, and tether ppo runs with --kl-ctl adaptive"),
    ("ppo", ["--anneal-shape", "cosine"], "--anneal-shape applies with --kl-ctl annealed"),
    ("grpo", ["--kl-per-token-mean", "--loss-aggregation", "token"], "--kl-per-token-mean "
     "applies with --kl-in loss and no --loss-aggregation, and tether grpo runs with "
     "--loss-aggregation token"),
    ("rloo", ["--kl-per-token-mean"], "tether rloo runs with --kl-in reward"),
    ("ppo", ["--eval-every", "2"], "--eval-every applies with --eval-prompts, and tether ppo runs "
     "with no --eval-prompts"),
    ("grpo", ["--generator-threads", "2"], "--generator-threads applies with --max-staleness above "
     "0, and tether grpo runs with --max-staleness 0"),
    # one mechanism for every option that acts only under another setting (issue 43): the
    # engines' (their table's options), the environment's, the hand-written checks of before
    ("grpo", ["--engine-kv-cache-mb", "256"], "--engine-kv-cache-mb applies with --engine vllm, "
     "and tether grpo runs with --engine native, where it has no effect; drop it, or pass "
     "--engine vllm"),
    ("ppo", ["--engine-is-cap", "2"], "--engine-is-cap applies with --engine vllm or "
     "--max-staleness above 0, and tether ppo runs with --engine native and --max-staleness 0"),
    ("ppo", ["--engine-mask-kl", "0.5"], "--engine-mask-kl applies with --engine vllm and "
     "--max-staleness 0, and tether ppo runs with --engine native"),
    ("ppo", ["--max-staleness", "4", "--engine-mask-kl", "0.5"], "tether ppo runs with "
     "--max-staleness 4, whose decoupled loss corrects the staleness"),
    ("ppo", ["--gold-fn", "rewards.py:score"], "--gold-fn applies with --eval-prompts"),
    ("ppo", ["--reward-per-turn"], "--reward-per-turn applies with --env or --tools and "
     "--advantage gae or reinforce.., and tether ppo runs with no environment"),
    ("grpo", ["--env", "rewards.py:score", "--reward-per-turn"], "tether grpo runs with "
     "--advantage grpo, which compares whole episodes"),
    ("ppo", ["--reward-url-timeout", "5"], "--reward-url-timeout applies with --reward-url"),
    ("ppo", ["--merge-lora"], "--merge-lora applies with --lora-r above 0, and tether ppo runs "
     "with --lora-r 0, which trains every weight, where it has no effect; drop it, or pass "
     "--lora-r"),
    ("grpo", ["--max-turns", "3"], "--max-turns applies with --env or --tools, and tether grpo "
     "runs with no environment"),
    ("grpo", ["--max-episode-tokens", "64"], "--max-episode-tokens applies with --env or --tools"),
    ("grpo", ["--max-observation-tokens", "64"], "--max-observation-tokens applies with --env"),
    ("grpo", ["--env-timeout", "5"], "--env-timeout applies with --env or --tools"),
    ("grpo", ["--env-workers", "2"], "--env-workers applies with --env or --tools"),
    ("grpo", ["--jsd-beta", "0.2"], "--jsd-beta applies with --kl-estimator jsd, and tether grpo "
     "runs with --kl-estimator auto"),
    ("ppo", ["--ref-reset-optimizer"], "--ref-reset-optimizer applies with --ref-update reset:N, "
     "and tether ppo runs with --ref-update none"),
    ("ppo", ["--max-kl", "5", "--max-kl-to", "sft"], "--max-kl-to applies with --max-kl with "
     "--teacher or a moving --ref-update, and tether ppo runs with the SFT model as the anchor"),
    ("ppo", ["--max-kl-to", "sft"], "tether ppo runs with --max-kl 0"),
    ("ppo", ["--reward-aggregate", "min"], "--reward-aggregate applies with --reward-model "
     "ENSEMBLE, and tether ppo runs with no --reward-model, where it has no effect; drop it, or "
     "pass an ensemble"),
]


def test_every_scoped_option_has_a_case():
    named = {flag[2:].replace("-", "_") for _, flags, _ in SCOPED_CASES for flag in flags
             if flag.startswith("--")}
    assert set(scopes_of(PPOConfig)) <= named


@pytest.mark.parametrize(("stage", "flags", "pattern"), SCOPED_CASES,
                         ids=[f"{s}{''.join(f)}" for s, f, _ in SCOPED_CASES])
def test_an_option_without_effect_is_refused(stage, flags, pattern, root, monkeypatch, capsys,
                                             no_loads):
    monkeypatch.chdir(root)
    refused(root, online(stage, *flags), pattern, capsys)


def test_in_a_hand_written_config_file_even_at_its_default(root, tmp_path, monkeypatch, capsys,
                                                            no_loads):
    monkeypatch.chdir(root)
    for text in ("scale_rewards: batch\n", "scale_rewards: group\n"):
        (tmp_path / "c.yaml").write_text(text)
        refused(root, online("rloo", "--config", str(tmp_path / "c.yaml")),
                r"--scale-rewards applies with --advantage grpo, and tether rloo", capsys)


def test_in_a_sweep_grid(root, tmp_path, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    grid = {"name": "s", "output_dir": str(tmp_path / "sweeps"), "seeds": [0],
            "ppo": {"policy": "m", "prompts": "prompts.jsonl", "reward_fn": "rewards.py:score",
                    "eval_prompts": "prompts.jsonl", "gold_fn": "rewards.py:score",
                    "scale_rewards": ["group", "batch"]}}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(grid))
    refused(tmp_path, ["sweep", str(tmp_path / "g.yaml")],
            r"grid: the ppo block's 'scale_rewards' has no effect in any of its runs: "
            r"--scale-rewards applies with --advantage grpo, and tether ppo runs with --advantage "
            "gae, where it has no effect; drop it, or use tether grpo", capsys)
    # A grid crosses its axes: an option acting in some of its runs is a plan, not a mistake.
    from tether.tools.sweep_plan import plan
    grid["ppo"] |= {"advantage": ["gae", "grpo"], "samples_per_prompt": 2}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(grid))
    assert len(plan(str(tmp_path / "g.yaml")).runs) == 4


@pytest.mark.parametrize(("cls", "argv"), [
    (GRPOConfig, ["--scale-rewards", "batch"]),
    (PPOConfig, ["--advantage", "grpo", "--samples-per-prompt", "2", "--scale-rewards", "none"]),
    (RLOOConfig, ["--advantage", "grpo", "--scale-rewards", "batch"]),
    (PPOConfig, ["--kl-ctl", "adaptive", "--kl-target", "3", "--kl-horizon", "50"]),
    (RLOOConfig, ["--kl-ctl", "annealed", "--beta-end", "0.01", "--anneal-shape", "cosine"]),
    (RLOOConfig, ["--kl-in", "loss", "--kl-per-token-mean"]),
    (GRPOConfig, ["--kl-in", "reward", "--kl-estimator", "k1"]),  # its default token mean: not given
    (PPOConfig, ["--critic", "shared", "--lam", "0.9", "--gamma", "0.99", "--vf-coef", "0.5"]),
    (PPOConfig, ["--advantage", "reinforce++", "--gamma", "0.99"]),
    (PPOConfig, ["--eval-prompts", "prompts.jsonl", "--eval-every", "2"]),
])
def test_where_the_option_acts_it_is_accepted(cls, argv, root, monkeypatch):
    monkeypatch.chdir(root)
    parse_config(cls, online("x", *argv)[1:])


def test_a_recorded_config_is_no_choice_of_its_defaults(root, tmp_path, monkeypatch):
    # A run's config.yaml names every field (scale_rewards: group on an rloo run): as --config
    # of the same stage it is accepted; a changed value in it is the user's, and refused.
    monkeypatch.chdir(root)
    cfg = parse_config(RLOOConfig, online("x")[1:])
    from tether.run.rundir import recorded
    record = recorded(cfg)
    assert record["stage"] == "rloo" and record["scale_rewards"] == "group"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(record))
    parse_config(RLOOConfig, ["--config", str(tmp_path / "config.yaml"), "--run-name", "y"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(record | {"scale_rewards": "none"}))
    with pytest.raises(TetherError, match="--scale-rewards applies with --advantage grpo"):
        parse_config(RLOOConfig, ["--config", str(tmp_path / "config.yaml"), "--run-name", "y"])
    # A ppo run's record, its `stage:` line deleted to start an rloo run from its settings (as
    # the stage line's refusal suggests): every field is named, defaults and all; accepted.
    ppo = recorded(parse_config(PPOConfig, online("x")[1:]))
    del ppo["stage"]
    assert ppo["kl_target"] == 6.0 and ppo["kl_ctl"] == "fixed"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(ppo))
    assert parse_config(RLOOConfig, ["--config", str(tmp_path / "config.yaml")]).advantage == "gae"


@pytest.mark.parametrize("family", FAMILIES)
def test_rloo_with_grpo_advantages_scales_them(family, root, tmp_path, monkeypatch,
                                               tiny_model_dir, tiny_llama_dir):
    # the valid neighbour, end to end: --scale-rewards where it acts trains and is recorded
    monkeypatch.chdir(root)
    policy = str(tiny_model_dir if family == "gpt2" else tiny_llama_dir)
    argv = online("rloo", "--advantage", "grpo", "--scale-rewards", "batch", "--batch-size", "4",
                  "--total-episodes", "4", "--max-new-tokens", "3", "--device", "cpu",
                  "--report-to", "none", "--samples-per-prompt", "2")
    argv[argv.index("m")] = policy
    argv[argv.index("runs")] = str(tmp_path / "runs")
    assert main(argv) == 0
    assert yaml.safe_load((tmp_path / "runs" / "x" / "config.yaml").read_text())[
        "scale_rewards"] == "batch"


# ----------------------------------------------------------------------------- config files

def test_a_key_given_twice(root, tmp_path, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    (tmp_path / "c.yaml").write_text("lr: 0.001\nbatch_size: 2\nlr: 1.0\n")
    refused(root, ["sft", "--model", "m", "--data", "sft.jsonl", "--run-name", "x",
                   "--output-dir", "runs", "--config", str(tmp_path / "c.yaml")],
            r"config file .*c.yaml gives 'lr' twice \(lines 1 and 3\); YAML would keep the "
            "second silently: keep one", capsys)


def test_a_key_given_twice_in_a_sweep_grid(root, tmp_path, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    (tmp_path / "g.yaml").write_text(f"name: s\noutput_dir: {tmp_path / 'sweeps'}\nseeds: [0]\n"
                                     "ppo:\n  beta: [0.1]\n  lr: 0.001\n  beta: [0.5]\n")
    refused(tmp_path, ["sweep", str(tmp_path / "g.yaml")],
            r"g.yaml gives 'beta' twice \(lines 5 and 7\)", capsys)


def test_a_merge_key_may_be_overridden(root, tmp_path, monkeypatch):
    # YAML's `<<: *defaults` then a key of its own is an override, not a repeat
    monkeypatch.chdir(root)
    from tether.run.parse import load_yaml
    (tmp_path / "m.yaml").write_text("a: &d {lr: 1.0, batch_size: 2}\nb:\n  <<: *d\n  lr: 0.1\n")
    assert load_yaml(str(tmp_path / "m.yaml"))["b"] == {"lr": 0.1, "batch_size": 2}
    (tmp_path / "ok.yaml").write_text("lr: 0.001\nbatch_size: 2\n")
    cfg = parse_config(PPOConfig, ["--config", str(tmp_path / "ok.yaml"), *online("x")[1:]])
    assert (cfg.lr, cfg.batch_size) == (0.001, 2)


def test_a_config_that_names_a_directory(root, tmp_path, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    refused(root, online("grpo", "--config", str(tmp_path)),
            rf"config file {tmp_path} is a directory, not a YAML file; name the file$", capsys)
    (tmp_path / "config.yaml").write_text("lr: 0.001\n")  # a run directory: its config.yaml
    refused(root, online("grpo", "--config", str(tmp_path)),
            rf"is a directory, not a YAML file; name the file, e.g. {tmp_path}/config.yaml",
            capsys)


# ----------------------------------------------------------------------------- --threads

@pytest.mark.parametrize("argv", [
    ["sft", "--model", "m", "--data", "sft.jsonl", "--run-name", "x", "--output-dir", "runs"],
    ["generate", "--model", "m", "--prompts", "prompts.jsonl", "--output", "runs/g.jsonl"],
    online("grpo"),
])
def test_threads_out_of_range(argv, root, monkeypatch, capsys, no_loads):
    monkeypatch.chdir(root)
    for value in ("99999999999", str(MAX_THREADS + 1)):
        refused(root, [*argv, "--threads", value],
                rf"--threads {value} is out of range: give 0 \(auto\) or 1 to {MAX_THREADS} "
                r"threads per operation \(this machine has \d+ CPU cores", capsys)
    parse_config(PPOConfig, [*online("x")[1:], "--threads", str(MAX_THREADS)])


def test_the_largest_thread_count_runs():
    # MAX_THREADS is a count torch accepts and runs an operation with (99999999999 is not)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(MAX_THREADS)
        x = torch.ones(64, 64)
        assert (x @ x)[0, 0].item() == 64
        with pytest.raises(ValueError):
            torch.set_num_threads(99999999999)
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- tether report

@pytest.mark.parametrize("text", ["- lr\n- 0.1\n", "just words\n", "3\n"])
def test_report_of_a_config_that_is_not_a_mapping(text, tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(text)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    refused(tmp_path, ["report", str(run), "--output", str(tmp_path / "out.html")],
            r"runs/r/config.yaml is a YAML (list|str|int), not the mapping of config fields a "
            "run records; restore it from the run or leave the run out", capsys)
    (run / "config.yaml").write_text("lr: 0.1\n")  # the neighbour: a mapping
    assert main(["report", str(run), "--output", str(tmp_path / "out.html")]) == 0


# ----------------------------------------------------------------------------- recorded paths


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """`here`, where runs are made from `here/<family>` with --lr 0 (so final/ is the starting
    model: the KL to it is exactly 0), and `there`, holding other models under the same names."""
    base = tmp_path_factory.mktemp("hand_written")
    here, there = base / "here", base / "there"
    for family, model in (("gpt2", tiny_model_dir), ("llama", tiny_llama_dir)):
        shutil.copytree(model, here / family)
        other_weights(model, there / family)
    write_jsonl(here / "prompts.jsonl", [{"prompt": p} for p in ("the movie was", "it")])
    (here / "reward.py").write_text("def score(prompts, responses):\n"
                                    "    return [len(r) / 10 for r in responses]\n")
    return here, there


def _eval(final, prompts, output, *extra):
    return ["eval", "--model", final, "--prompts", prompts, "--device", "cpu", "--max-new-tokens",
            "4", "--batch-size", "2", "--output", str(output), *extra]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hand_written_relative_policy_path(family, places, tmp_path, monkeypatch, capsys):
    here, there = places
    monkeypatch.chdir(here)
    name = f"p-{family}"
    assert main(["ppo", "--policy", family, "--prompts", "prompts.jsonl", "--reward-fn",
                 "reward.py:score", "--run-name", name, "--output-dir", "runs", "--batch-size",
                 "2", "--total-episodes", "2", "--ppo-epochs", "1", "--max-new-tokens", "4",
                 "--lr", "0", "--device", "cpu", "--report-to", "none"]) == 0
    config = here / "runs" / name / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    assert saved["policy"] == str(here / family)  # as tether writes it: absolute

    # Relative to the working directory, by hand: `there` would read another model (before:
    # KL 49.6 against a run whose KL is 0); `here` the right one, but only by standing here.
    config.write_text(yaml.safe_dump(saved | {"policy": family}, sort_keys=False))
    final = str(here / "runs" / name / "final")
    for place, model in ((here, here / family), (there, there / family)):
        monkeypatch.chdir(place)
        refused(tmp_path, _eval(final, str(here / "prompts.jsonl"), tmp_path / "e.json"),
                rf"{config} records policy '{family}', a relative path \(tether writes absolute "
                rf"ones\): it names {model} from the current directory but nothing from the run "
                r"directory, so it depends on where the command runs; write the absolute path of "
                rf"the model meant in {config}, or pass --reference PATH$", capsys)

    # Relative to the run directory: the same model from anywhere, KL exactly 0.
    config.write_text(yaml.safe_dump(saved | {"policy": f"../../{family}"}, sort_keys=False))
    results = []
    for place in (here, there):
        monkeypatch.chdir(place)
        assert main(_eval(final, str(here / "prompts.jsonl"), tmp_path / "e.json")) == 0
        results.append(json.loads((tmp_path / "e.json").read_text()))
    assert [r["reference"] for r in results] == [str(here / family)] * 2
    assert [r["metrics"]["eval/kl_exact"] for r in results] == [0.0, 0.0]

    # A name that is a model both beside the run and here, two different ones: which is meant?
    shutil.copytree(there / family, here / "runs" / name / family)
    config.write_text(yaml.safe_dump(saved | {"policy": family}, sort_keys=False))
    monkeypatch.chdir(here)
    refused(tmp_path, _eval(final, str(here / "prompts.jsonl"), tmp_path / "e2.json"),
            rf"records policy '{family}', a relative path that names two different things: "
            rf"{here / 'runs' / name / family} \(from the run directory\) and {here / family} "
            r"\(from the current directory\)", capsys)
    monkeypatch.chdir(there)  # there holds another one again: as ambiguous
    refused(tmp_path, _eval(final, str(here / "prompts.jsonl"), tmp_path / "e2.json"),
            "a relative path that names two different things", capsys)
    monkeypatch.chdir(tmp_path)  # nothing of that name here: the one beside the run
    assert main(_eval(final, str(here / "prompts.jsonl"), tmp_path / "e3.json")) == 0
    assert json.loads((tmp_path / "e3.json").read_text())["reference"] == str(
        here / "runs" / name / family)
    shutil.rmtree(here / "runs" / name / family)
    config.write_text(yaml.safe_dump(saved, sort_keys=False))


class Stop(Exception):
    pass


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_reads_a_relative_path_against_the_run_directory(family, places, monkeypatch):
    # A config.yaml edited to name the model relative to the run directory is the same run from
    # anywhere (before: read against the current directory, a "different config" from here).
    from tether.train import sft as sft_stage
    here, there = places
    monkeypatch.chdir(here)
    write_jsonl(here / "sft.jsonl", sft_rows(8))
    name = f"cut-{family}"
    argv = ["sft", "--data", str(here / "sft.jsonl"), "--run-name", name, "--output-dir",
            str(here / "runs"), "--max-steps", "2", "--batch-size", "4", "--save-every", "1",
            "--device", "cpu", "--report-to", "none"]
    real, calls = sft_stage.optimizer_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise Stop
        return real(*args, **kwargs)
    monkeypatch.setattr(sft_stage, "optimizer_step", step)
    with pytest.raises(Stop):
        main([*argv, "--model", family])
    monkeypatch.undo()
    config = here / "runs" / name / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump(saved | {"model": f"../../{family}"}, sort_keys=False))
    monkeypatch.chdir(there)  # there/<family> is another model: never taken for this one
    assert main([*argv, "--model", str(here / family), "--resume"]) == 0
    assert (here / "runs" / name / "final").is_dir()
