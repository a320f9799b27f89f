"""Reward-model ensembles (docs/rm.md, "Ensembles"): the aggregates against numbers worked by hand,
`tether rm --ensemble K` as K runs with their own seeds, the ensemble's reward against its members
loaded alone (LoRA members on one base), one member with `mean` bit for bit the single model in
PPO, and the refusals."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from offline_fixtures import preference_rows, write_jsonl
from safetensors.torch import load_file

from tether.cli import main
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.rl.reward import RewardScores
from tether.rl.reward.ensemble import aggregate, load_ensemble, reward_from_ensemble
from tether.rl.reward.models import load_reward_model
from tether.run.config import ENSEMBLE_JSON, parse_aggregate

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def test_each_aggregate_against_numbers_worked_by_hand():
    # three members (rows) scoring three responses (columns)
    scores = torch.tensor([[1.0, 2.0, 0.0], [3.0, -2.0, 0.0], [2.0, 0.0, 3.0]])
    # column means 2, 0, 1; population variances (1+1+0)/3, (4+4+0)/3, (1+1+4)/3
    assert aggregate(scores, "mean").tolist() == pytest.approx([2.0, 0.0, 1.0])
    assert aggregate(scores, "min").tolist() == [1.0, -2.0, 0.0]
    assert aggregate(scores, "uwo", 0.5).tolist() == pytest.approx([2 - 1 / 3, -4 / 3, 0.0])
    many = torch.randn(5, 64)
    assert torch.equal(aggregate(many, "uwo", 0.0), aggregate(many, "mean"))  # uwo:0 is the mean
    assert torch.equal(aggregate(many[:1], "mean"), many[0])  # one member: its own scores

    def member(values):
        return lambda prompts, responses, rollout=None, rows=None: RewardScores(
            torch.tensor(values), {})
    reward = reward_from_ensemble([member(row.tolist()) for row in scores], "uwo:0.5")
    got = reward(["p"] * 3, ["r"] * 3)
    assert got.scores.tolist() == pytest.approx([2 - 1 / 3, -4 / 3, 0.0])
    assert got.parts["member1"].tolist() == [3.0, -2.0, 0.0]
    assert got.parts["ensemble_std"].tolist() == pytest.approx(
        [math.sqrt(2 / 3), math.sqrt(8 / 3), math.sqrt(2)])


@pytest.mark.parametrize("spec", ["max", "uwo", "uwo:", "uwo:-1", "uwo:nan", "uwo:inf",
                                  "mean:1", "min:0", ""])
def test_a_bad_aggregate_is_one_line(spec):
    with pytest.raises(TetherError, match="is not mean, min or uwo:LAMBDA with LAMBDA >= 0"):
        parse_aggregate(spec)


def rm_args(model, data, held_out, out, *extra):
    return ["rm", "--model", str(model), "--data", str(data), "--eval-data", str(held_out),
            "--output-dir", str(out), "--max-steps", "2", "--batch-size", "8", "--lr", "1e-3",
            "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def ensembles(tiny_llama_dir, tmp_path_factory):
    """A full and a LoRA ensemble of 2 on the tiny Llama, and a plain run with member 1's seed."""
    root = tmp_path_factory.mktemp("ensembles")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(32, seed=0))
    held_out = write_jsonl(root / "held_out.jsonl", preference_rows(8, seed=1))
    for args in (["--run-name", "full", "--seed", "3", "--ensemble", "2"],
                 ["--run-name", "plain", "--seed", "4"],
                 ["--run-name", "lora", "--seed", "3", "--ensemble", "2", "--lora-r", "4"]):
        assert main(rm_args(tiny_llama_dir, data, held_out, root, *args)) == 0
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    return root


def test_rm_ensemble_is_k_runs_with_their_own_seeds_in_one_directory(ensembles, tiny_llama_dir,
                                                                     capsys):
    final = ensembles / "full" / "final"
    assert json.loads((final / ENSEMBLE_JSON).read_text()) == {"members": ["member0", "member1"]}

    def weights(run_dir):
        return load_file(str(run_dir / "model.safetensors"))
    member1, plain = weights(final / "member1"), weights(ensembles / "plain" / "final")
    # member 1 is the run `tether rm --seed 4` (same data, held-out rows and settings), bit for bit
    assert member1.keys() == plain.keys() and all(torch.equal(member1[k], plain[k]) for k in plain)
    assert not torch.equal(weights(final / "member0")["score.weight"], plain["score.weight"])
    # final/ holds hard links to the members' own final models: no second copy on disk
    for name in ("member0", "member1"):
        assert ((final / name / "model.safetensors").stat().st_ino
                == (ensembles / "full" / name / "final" / "model.safetensors").stat().st_ino)
    # a second run into it is refused, and with --resume there is nothing left to run
    capsys.readouterr()
    args = rm_args(tiny_llama_dir, ensembles / "pairs.jsonl", ensembles / "held_out.jsonl",
                   ensembles, "--run-name", "full", "--ensemble", "2")
    assert main(args) == 2 and "already has results" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0 and "already finished" in capsys.readouterr().err


def test_ensemble_scores_are_its_members_and_lora_members_share_one_base(ensembles,
                                                                         tiny_llama_dir):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    ids = torch.tensor([tokenizer("the movie was good and long")["input_ids"]] * 2)
    ids[1, -2:] = tokenizer.pad_token_id
    mask = (ids != tokenizer.pad_token_id).long()
    rollout = type("R", (), {"input_ids": ids, "attention_mask": mask, "context_length": 3,
                             "__len__": lambda self: 2})()
    for name in ("full", "lora"):
        members = [str(ensembles / name / "final" / f"member{k}") for k in range(2)]
        ensemble = load_ensemble(members, "min", tokenizer, {}, 4, "cpu")
        got = ensemble.reward(["p", "p"], ["r", "r"], rollout)
        alone = [load_reward_model(m, tokenizer, {}, 4, "cpu").reward(["p", "p"], ["r", "r"],
                                                                      rollout).scores
                 for m in members]
        for k in range(2):  # each member as it scores alone, bit for bit
            assert torch.equal(got.parts[f"member{k}"], alone[k]), (name, k)
        assert torch.equal(got.scores, torch.minimum(*alone))
        assert not torch.equal(alone[0], alone[1])
        base = sum(p.numel() for p in load_reward_model(members[0], tokenizer, {}, 4, "cpu")
                   .model.parameters())
        held = sum(p.numel() for p in ensemble.model.parameters())
        # LoRA: one base, with the second member's adapter and head on it (not a second base)
        assert (held < 1.5 * base) if name == "lora" else (held == 2 * base)
        assert not any(p.requires_grad for p in ensemble.model.parameters())


def eval_args(model, prompts, reward_model, out, *extra):
    return ["eval", "--model", str(model), "--prompts", str(prompts), "--reward-model",
            str(reward_model), "--device", "cpu", "--max-new-tokens", "6", "--output", str(out),
            *extra]


def test_eval_of_an_ensemble_against_its_members_and_one_member_is_the_single_model(
        ensembles, tiny_llama_dir, tmp_path, capsys):
    prompts, members = ensembles / "prompts.jsonl", ensembles / "full" / "final"

    def scores(reward_model, *extra):
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        assert main(eval_args(tiny_llama_dir, prompts, reward_model, out, *extra)) == 0, \
            capsys.readouterr().err
        record = json.loads(out.read_text())
        return [s["score"] for s in record["samples"]], record["metrics"]
    alone = [scores(members / f"member{k}")[0] for k in range(2)]
    (low, metrics), (mean, _), (uwo0, _) = (scores(members, "--reward-aggregate", spec)
                                            for spec in ("min", "mean", "uwo:0"))
    assert low == [min(a, b) for a, b in zip(*alone)]  # the same responses, scored by each
    assert mean == uwo0 and mean == pytest.approx([(a + b) / 2 for a, b in zip(*alone)])
    assert metrics["eval/reward/member1"] == pytest.approx(sum(alone[1]) / len(alone[1]))
    spread = [abs(a - b) / 2 for a, b in zip(*alone)]  # two members: std = |a - b| / 2
    assert metrics["eval/reward/ensemble_std"] == pytest.approx(sum(spread) / len(spread))
    # one member under mean is the single model: the same numbers, bit for bit
    one = tmp_path / "one"
    shutil.copytree(members / "member0", one / "member0")
    (one / ENSEMBLE_JSON).write_text(json.dumps({"members": ["member0"]}))
    assert scores(one)[0] == alone[0]


def test_ppo_with_one_member_under_mean_is_the_single_reward_model_bit_for_bit(
        ensembles, tiny_llama_dir, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(ensembles / "full" / "final" / "member0", one / "member0")
    (one / ENSEMBLE_JSON).write_text(json.dumps({"members": ["member0"]}))
    runs = {}
    for name, reward_model in (("single", one / "member0"), ("ensemble", one)):
        assert main(["ppo", "--policy", str(tiny_llama_dir), "--prompts",
                     str(ensembles / "prompts.jsonl"), "--reward-model", str(reward_model),
                     "--batch-size", "4", "--total-episodes", "8", "--max-new-tokens", "5",
                     "--lr", "1e-3", "--device", "cpu", "--output-dir", str(tmp_path),
                     "--run-name", name, "--save-every", "0"]) == 0
        runs[name] = tmp_path / name
    a, b = (load_file(str(runs[n] / "final" / "model.safetensors")) for n in ("single", "ensemble"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = {n: [json.loads(x) for x in (runs[n] / "metrics.jsonl").read_text().splitlines()]
             for n in runs}
    for single, ensemble in zip(lines["single"], lines["ensemble"], strict=True):
        if "reward/member0" in ensemble:  # a batch's line: the member's mean score, its spread 0
            assert ensemble.pop("reward/ensemble_std") == 0.0
            assert ensemble.pop("reward/member0") == pytest.approx(single["objective/score"])
        assert {k: v for k, v in ensemble.items() if not k.startswith("perf/")} == {
            k: v for k, v in single.items() if not k.startswith("perf/")}


def test_refusals_before_anything_is_written(ensembles, tiny_llama_dir, tiny_model_dir, tmp_path,
                                             capsys):
    prompts = ensembles / "prompts.jsonl"
    ppo = ["ppo", "--policy", str(tiny_llama_dir), "--prompts", str(prompts), "--device", "cpu",
           "--output-dir", str(tmp_path / "runs"), "--run-name", "r"]
    single = ensembles / "plain" / "final"
    capsys.readouterr()
    assert main([*ppo, "--reward-model", str(single), "--reward-aggregate", "min"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--reward-aggregate applies with --reward-model ENSEMBLE" in err
    assert not (tmp_path / "runs").exists()
    # members of different bases: the tiny Llama's and the tiny GPT-2's
    mixed = tmp_path / "mixed"
    shutil.copytree(single, mixed / "llama")
    gpt2 = load_tokenizer(str(tiny_model_dir))
    from tether.models.reward_model import RewardModel

    RewardModel.from_causal_lm(str(tiny_model_dir), gpt2).save_pretrained(mixed / "gpt2", gpt2)
    (mixed / ENSEMBLE_JSON).write_text(json.dumps({"members": ["llama", "gpt2"]}))
    out = tmp_path / "eval.json"
    assert main(eval_args(tiny_llama_dir, prompts, mixed, out)) == 2
    err = capsys.readouterr().err
    assert "mixes bases" in err and "tether rm --ensemble K" in err and not out.exists()
    (mixed / ENSEMBLE_JSON).write_text(json.dumps({"members": []}))
    assert main(eval_args(tiny_llama_dir, prompts, mixed, out)) == 2
    assert "does not list the ensemble's members" in capsys.readouterr().err
    # --ensemble 0 trains nothing: refused before any data is read or anything written
    assert main(rm_args(tiny_llama_dir, "pairs.jsonl", "held_out.jsonl", tmp_path / "rm",
                        "--run-name", "none", "--ensemble", "0")) == 2
    assert "config field 'ensemble' must be > 0, got 0" in capsys.readouterr().err
    assert not (tmp_path / "rm").exists()


def test_ppo_under_min_trains_on_the_worst_member(ensembles, tiny_llama_dir, tmp_path):
    # Two members: min(a, b) = (a + b) / 2 - |a - b| / 2, and |a - b| / 2 is their std, so each
    # batch's mean score is the members' mean less reward/ensemble_std (mean would not subtract).
    assert main(["ppo", "--policy", str(tiny_llama_dir), "--prompts",
                 str(ensembles / "prompts.jsonl"), "--reward-model",
                 str(ensembles / "full" / "final"), "--reward-aggregate", "min",
                 "--batch-size", "4", "--total-episodes", "8", "--max-new-tokens", "5",
                 "--device", "cpu", "--output-dir", str(tmp_path), "--run-name", "min"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "min" / "metrics.jsonl").read_text().splitlines()]
    batches = [m for m in lines if "reward/ensemble_std" in m]
    assert len(batches) == 2 and all(m["reward/ensemble_std"] > 0 for m in batches)
    for m in batches:
        assert m["objective/score"] == pytest.approx(
            (m["reward/member0"] + m["reward/member1"]) / 2 - m["reward/ensemble_std"], abs=1e-6)
