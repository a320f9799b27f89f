"""`tether bon`: the best-of-n curve from one pool (tether.tools.bon, docs/frontier.md).

Independent truth: the reward and gold functions record every response they score, so each
prompt's pool is rebuilt here and its best-of-n computed by enumerating subsets
(tests/tools/test_best_of_n.py's brute force); draw 0 of the pool is what `tether eval` samples
with the same settings; the KL bound is log n - (n - 1) / n by its formula.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_best_of_n import brute_force  # tests/tools, on the path as pytest runs it

from tether.cli import main
from tether.tools import bon, evaluate
from tether.tools.config import BonConfig, EvalConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "the actor"]
ENV = '''
class Guess:
    def reset(self, row, seed):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return " again", float(len(action) % 3), self.turn == 2
'''


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bon") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def recorder(score, seen):
    """A reward function that records (prompt, response, score): the score as the loop holds
    it, in float32."""
    def reward(prompts, responses):
        scores = [score(r) for r in responses]
        seen.extend(zip(prompts, responses, torch.tensor(scores, dtype=torch.float32).tolist()))
        return scores
    return reward


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_the_curve_is_the_pool_s_best_of_n(family, prompts_file, tmp_path, request):
    model_dir = str(request.getfixturevalue(family))
    proxy_seen, gold_seen = [], []
    common = dict(model=model_dir, prompts=str(prompts_file), max_new_tokens=6, device="cpu",
                  batch_size=2, seed=3)
    points = bon.run(BonConfig(**common, n=4, output=str(tmp_path / "bon.json")),
                     reward_fn=recorder(lambda r: float(len(r) % 4), proxy_seen),  # ties, often
                     gold_fn=recorder(lambda r: -abs(len(r) - 9) / 3, gold_seen))
    assert json.loads((tmp_path / "bon.json").read_text()) == points
    pools = {p: ([], []) for p in PROMPTS}
    for (prompt, response, score), (_, gold_response, gold) in zip(proxy_seen, gold_seen):
        assert response == gold_response  # the gold scores the response the proxy scored
        pools[prompt][0].append(score)
        pools[prompt][1].append(gold)
    assert all(len(proxy) == 4 for proxy, _ in pools.values())
    assert [p["n"] for p in points] == [1, 2, 3, 4]
    for point in points:
        n = point["n"]
        proxies = [float(brute_force(proxy, proxy, n)) for proxy, _ in pools.values()]
        golds = [float(brute_force(proxy, gold, n)) for proxy, gold in pools.values()]
        assert point["proxy"] == pytest.approx(sum(proxies) / len(PROMPTS), rel=1e-12, abs=1e-12)
        assert point["gold"] == pytest.approx(sum(golds) / len(PROMPTS), rel=1e-12, abs=1e-12)
        spread = math.sqrt(sum((g - point["gold"]) ** 2 for g in golds) / (len(golds) - 1))
        assert point["gold_se"] == pytest.approx(spread / math.sqrt(len(golds)), rel=1e-9)
        assert point["kl_bound"] == pytest.approx(math.log(n) - (n - 1) / n)
        assert 0.0 <= point["kl_exact"] <= point["kl_bound"] + 1e-12
    assert points[0]["kl_exact"] == 0.0 and points[0]["proxy_se"] > 0
    assert points[-1]["proxy"] >= points[0]["proxy"]  # the best of more is never worse by the proxy
    # draw 0 of each pool is what tether eval samples with the same settings
    eval_seen = []
    evaluate.run(EvalConfig(**common), reward_fn=recorder(lambda r: 0.0, eval_seen), write=False)
    first = {}
    for prompt, response, _ in proxy_seen:
        first.setdefault(prompt, response)
    assert {prompt: response for prompt, response, _ in eval_seen} == first


def test_episodes_pool_their_rewards_and_the_cli_writes_no_gold_without_one(prompts_file, tmp_path,
                                                                            tiny_model_dir, capsys):
    (tmp_path / "envs.py").write_text(ENV)
    out = tmp_path / "bon.json"
    assert main(["bon", "--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                 "--env", f"{tmp_path / 'envs.py'}:Guess", "--max-turns", "2",
                 "--stop-strings", "a", "e", "--max-new-tokens", "5", "--device", "cpu",
                 "--n", "3", "--output", str(out)]) == 0
    points = json.loads(out.read_text())
    assert [p["n"] for p in points] == [1, 2, 3] and all(p["gold"] is None for p in points)
    assert all(0.0 <= p["proxy"] <= 4.0 for p in points)  # two turns of 0, 1 or 2
    assert points[0]["proxy"] <= points[1]["proxy"] <= points[2]["proxy"]
    assert "kl_exact" in capsys.readouterr().out


def test_bon_refuses_bad_input_in_one_line(prompts_file, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "r.py").write_text("def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    base = ["bon", "--model", str(tiny_model_dir), "--prompts", str(prompts_file), "--device", "cpu"]
    reward = ["--reward-fn", f"{tmp_path / 'r.py'}:f"]
    out = ["--output", str(tmp_path / "bon.json")]
    cases = [
        ([*base, *reward, *out, "--n", "1"], "--n 1 is a pool of 1"),
        ([*base, *reward, *out, "--n", "0"], "give --n 2 or more"),
        ([*base, *out, "--n", "4"], "give exactly one reward"),
        ([*base, *reward, "--n", "4", "--output", str(prompts_file)], "--prompts"),
        ([*base, *reward, "--n", "4", "--output", str(tmp_path)], "directory"),
        ([*base, *reward, "--n", "4"], "--output"),
    ]
    for argv, says in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], (argv, err)
    assert not (tmp_path / "bon.json").exists()
    assert prompts_file.read_text().count("\n") == len(PROMPTS)
