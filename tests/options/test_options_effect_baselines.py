"""Every option of `tether bon` and `tether interpolate` takes effect: each test fails when the
command silently ignores one (tests/audit/mutate_options.py; the map is tests/audit/
option_tests.py). The truth is `tether eval`, run with the same options: draw d of bon's pool is
eval's sample with the seed moved d strides on (SAMPLE_SEED_STRIDE), so the curve is rebuilt
from eval's records by enumerating subsets (tests/tools/test_best_of_n.py's brute force); and
interpolate's last point, eta 1, is the --to model itself, evaluated as eval evaluates it against
--from. An option bon or interpolate ignored is then one that eval, honouring it, does not."""

from __future__ import annotations

import itertools
import json
import shutil
from fractions import Fraction

import pytest
import torch
from test_options_effect import ModelCalls

from tether.cli import main
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.run.config import ENSEMBLE_JSON
from tether.tools.generate import SAMPLE_SEED_STRIDE

PROMPTS = ["the movie was", "a film with a long plot and a long story", "it", "the ending was"]
ENV = '''
class Guess:
    def reset(self, row, seed):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return " once more and again", float(sum(map(ord, action)) % 7), self.turn == 4


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''


def brute_force(proxy, values, n):
    """The mean over every size-n subset of the pool of the value its best by the proxy picks
    (ties: their mean), in exact fractions (tests/tools/test_best_of_n.py's)."""
    total, subsets = Fraction(0), list(itertools.combinations(range(len(proxy)), n))
    for subset in subsets:
        tied = [Fraction(values[i]) for i in subset if proxy[i] == max(proxy[j] for j in subset)]
        total += sum(tied) / len(tied)
    return total / len(subsets)


def text_code(prompts, responses):
    """A score that tells almost any two texts apart: a changed sample shows in the curve."""
    return [sum((i + 1) * ord(c) for i, c in enumerate(r)) % 997 / 10 for r in responses]


def e_count(prompts, responses):
    return [float(r.count("e")) for r in responses]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """The prompts, an environment, a GPT-2 moved off the tiny one (interpolate's --to), and an
    ensemble of two untrained reward models on the tiny Llama."""
    root = tmp_path_factory.mktemp("baselines")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in PROMPTS))
    (root / "envs.py").write_text(ENV)
    from transformers import AutoModelForCausalLM

    other = shutil.copytree(tiny_model_dir, root / "other")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(other)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    for k in range(2):
        torch.manual_seed(10 + k)
        RewardModel.from_causal_lm(str(tiny_llama_dir), tokenizer).save_pretrained(
            root / "ens" / f"member{k}", tokenizer)
    (root / "ens" / ENSEMBLE_JSON).write_text(json.dumps({"members": ["member0", "member1"]}))
    return root


def option_sets(files, models):
    """name -> (model, options): every option of the sampling, reward and environment sections
    that changes what is sampled or how it is scored, off its default."""
    common = ["--prompts", str(files / "prompts.jsonl"), "--device", "cpu"]
    sampling = ["--max-prompt-len", "4", "--max-new-tokens", "4", "--temperature", "0.7",
                "--stop-strings", "e", "--batch-size", "3"]
    functions = ["--reward-fn", f"{__file__}:text_code", "--gold-fn", f"{__file__}:e_count"]
    episodes = ["--env", f"{files / 'envs.py'}:Guess", "--max-new-tokens", "6",
                "--stop-strings", "e", "a", "o"]
    return {
        "sampling": (models["tiny_llama_dir"], [*common, *sampling, *functions]),
        "ensemble": (models["tiny_llama_dir"], [*common, "--max-new-tokens", "5",
                                                "--reward-model", str(files / "ens"),
                                                "--reward-aggregate", "min",
                                                "--dtype", "bfloat16"]),
        # turns that end at a stop string, so that episodes run to their limits: --max-turns
        # and a cut observation change the later turns; --max-episode-tokens ends episodes
        "episodes": (models["tiny_model_dir"], [*common, *episodes, "--max-turns", "2",
                                                "--max-observation-tokens", "2"]),
        "budget": (models["tiny_model_dir"], [*common, *episodes, "--max-episode-tokens", "20"]),
        # the tool's schema in every prompt, the reward on the final answer
        "tools": (models.get("tiny_qwen2_tools_dir", ""), [
            *common, "--tools", f"{files / 'envs.py'}:add", "--max-prompt-len", "512",
            "--max-new-tokens", "4", "--reward-fn", f"{__file__}:text_code"]),
    }


@pytest.mark.parametrize("which", ["sampling", "ensemble", "episodes", "budget", "tools"])
def test_bon_s_pool_is_eval_s_samples_with_the_same_options(which, files, tiny_model_dir,
                                                           tiny_llama_dir, tiny_qwen2_tools_dir,
                                                           tmp_path):
    models = {"tiny_model_dir": str(tiny_model_dir), "tiny_llama_dir": str(tiny_llama_dir),
              "tiny_qwen2_tools_dir": str(tiny_qwen2_tools_dir)}
    model, options = option_sets(files, models)[which]
    out = tmp_path / "bon.json"
    assert main(["bon", "--model", model, *options, "--seed", "3", "--n", "3",
                 "--output", str(out)]) == 0
    draws = []
    for d in range(3):
        record = tmp_path / f"eval{d}.json"
        assert main(["eval", "--model", model, *options, "--seed", str(3 + d * SAMPLE_SEED_STRIDE),
                     "--output", str(record)]) == 0
        draws.append(json.loads(record.read_text())["samples"])
    curve = json.loads(out.read_text())
    assert [p["n"] for p in curve] == [1, 2, 3]
    pools = [[draw[i] for draw in draws] for i in range(len(PROMPTS))]
    assert len({s["response"] for pool in pools for s in pool}) > len(PROMPTS)  # draws differ
    if which == "tools":
        assert all('"name": "add"' in s["prompt"] for pool in pools for s in pool)
    for point in curve:
        proxy = [float(brute_force([s["score"] for s in pool], [s["score"] for s in pool],
                                   point["n"])) for pool in pools]
        assert point["proxy"] == pytest.approx(sum(proxy) / len(pools), rel=1e-12, abs=1e-12)
        if which == "sampling":
            gold = [float(brute_force([s["score"] for s in pool], [s["gold_score"] for s in pool],
                                      point["n"])) for pool in pools]
            assert point["gold"] == pytest.approx(sum(gold) / len(pools), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("which", ["sampling", "ensemble"])
def test_interpolate_s_last_point_is_eval_of_to_against_from(which, files, tiny_model_dir,
                                                            tiny_llama_dir, tmp_path):
    # the line from the tiny model (--from) to a model moved off it (--to): its eta 1 is --to
    start = {"sampling": str(tiny_model_dir), "ensemble": str(tiny_llama_dir)}[which]
    end = str(files / "other") if which == "sampling" else str(tiny_llama_dir)
    _, options = option_sets(files, {"tiny_model_dir": start, "tiny_llama_dir": start})[which]
    line = tmp_path / "line"
    with ModelCalls() as calls:
        assert main(["interpolate", "--from", start, "--to", end, "--points", "0,0.5,1",
                     "--output-dir", str(line), *options, "--seed", "5",
                     "--no-chunked-lm-head"]) == 0
    assert calls.full_logits > 0  # --no-chunked-lm-head: the KL from full [N, T, V] logits
    assert sorted(p.name for p in line.iterdir() if p.is_dir()) == ["eta0", "eta0.5", "eta1"]
    record = tmp_path / "eval.json"
    assert main(["eval", "--model", end, "--reference", start, *options, "--seed", "5",
                 "--no-chunked-lm-head", "--output", str(record)]) == 0
    truth, point = (json.loads(p.read_text()) for p in (record, line / "eta1.eval.json"))
    assert point["metrics"] == truth["metrics"] and point["samples"] == truth["samples"]
    rows = json.loads((line / "interpolate.json").read_text())
    assert [r["eta"] for r in rows] == [0, 0.5, 1] and rows[0]["eval/kl"] == 0.0
    assert rows[-1]["eval/kl"] == truth["metrics"]["eval/kl"]
    if which == "sampling":
        assert truth["metrics"]["eval/kl_exact"] > 0 and "eval/gold_score" in rows[1]


def test_bon_samples_each_draw_in_chunks_of_batch_size(files, tiny_model_dir, tmp_path,
                                                      monkeypatch):
    # each row has its own noise, so the chunks change no sample: the sampler's calls tell
    from test_options_effect_tools import Sampler

    sampler = Sampler(monkeypatch)
    assert main(["bon", "--model", str(tiny_model_dir), "--prompts", str(files / "prompts.jsonl"),
                 "--reward-fn", f"{__file__}:text_code", "--batch-size", "3", "--n", "2",
                 "--max-new-tokens", "3", "--device", "cpu", "--output",
                 str(tmp_path / "bon.json")]) == 0
    assert [c["rows"] for c in sampler.calls] == [3, 1, 3, 1]  # 4 prompts, two draws
