"""Issue 47: a multi-turn environment whose episodes never reach a second turn, because every
first turn reached --max-new-tokens without ending (a turn cut by its budget ends its episode,
as specified), ran on with `env/turns` 1 and no word. Now the first batch of a run (and `tether
eval --env`) says so once, naming --max-new-tokens and --stop-strings."""

from __future__ import annotations

import json

from tether.cli import main

TWO_TURNS = '''
class TwoTurns:
    def reset(self, row, seed):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return " and then?", 0.0, self.turn == 2
'''
WARNING = "warning: every episode ended in its first turn: each reached --max-new-tokens 2"


def _setup(tmp_path):
    (tmp_path / "envs.py").write_text(TWO_TURNS)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                              for p in ["the movie was", "it", "a film", "i"]))
    return ["--prompts", str(tmp_path / "p.jsonl"), "--env", f"{tmp_path / 'envs.py'}:TwoTurns",
            "--max-new-tokens", "2", "--device", "cpu"]


def test_a_run_whose_turns_all_hit_the_budget_is_told_once(tiny_model_dir, tmp_path, capsys):
    common = _setup(tmp_path)
    assert main(["grpo", "--policy", str(tiny_model_dir), *common, "--max-turns", "3",
                 "--batch-size", "8", "--total-episodes", "16", "--output-dir",
                 str(tmp_path / "runs"), "--save-every", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1 and "--max-turns 3 never comes into play" in err, err
    assert "raise --max-new-tokens, or give --stop-strings" in err
    metrics = [json.loads(line) for line in
               (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["env/turns"] for m in metrics if "env/turns" in m] == [1.0, 1.0]


def test_eval_says_it_too_and_a_one_turn_run_does_not(tiny_model_dir, tmp_path, capsys):
    common = _setup(tmp_path)
    for turns, told in (("2", 1), ("1", 0)):  # --max-turns 1: one turn is what was asked for
        assert main(["eval", "--model", str(tiny_model_dir), *common, "--max-turns", turns,
                     "--batch-size", "2", "--output", str(tmp_path / f"e{turns}.json")]) == 0
        assert capsys.readouterr().err.count(WARNING) == told
