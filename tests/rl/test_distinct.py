"""Diversity of held-out responses: distinct-2 over words, and over the token ids the policy
sampled (which any answer has, with or without spaces)."""

from __future__ import annotations

import json
import os

import pytest

from tether.cli import main
from tether.rl.evaluation import distinct_n, distinct_ngrams


def test_distinct_ngrams_by_hand():
    # bigrams (5,6) (6,5) (5,6) and none from [7]: 2 unique of 3
    assert distinct_ngrams([[5, 6, 5, 6], [7]], 2) == pytest.approx(2 / 3)
    assert distinct_ngrams([[1, 2, 3], [1, 2, 3]], 2) == pytest.approx(2 / 4)
    assert distinct_ngrams([[1], []], 2) == 0.0  # no pair at all


def test_answers_without_spaces_read_zero_in_words_but_not_in_tokens():
    # "42", "17", "42": no word pairs, so word distinct-2 says 0 (what looks like a collapse)
    assert distinct_n(["42", "17", "42"], 2) == 0.0
    # their tokens (two digits each, say) still have pairs: 2 unique of 3
    assert distinct_ngrams([[4, 2], [1, 7], [4, 2]], 2) == pytest.approx(2 / 3)


def ids_recorder(prompts, completions, completion_ids, **kwargs):
    """A TRL-style gold function that writes down the ids it was given (the sampled ones)."""
    with open(os.environ["TETHER_TEST_IDS"], "a", encoding="utf-8") as out:
        out.write(json.dumps(completion_ids) + "\n")
    return [0.0] * len(completions)


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_eval_reports_token_distinct_2_of_the_sampled_ids(family, request, tmp_path,
                                                          monkeypatch, capsys):
    model = str(request.getfixturevalue(family))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["the movie was", "it", "a film", "music", "the end"]))
    monkeypatch.setenv("TETHER_TEST_IDS", str(tmp_path / "ids.jsonl"))
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", model, "--prompts", str(prompts), "--gold-fn",
                 f"{__file__}:ids_recorder", "--device", "cpu", "--max-new-tokens", "6",
                 "--batch-size", "2",  # three chunks: 2, 2 and 1 prompts
                 "--output", str(out)]) == 0, capsys.readouterr().err
    ids = [row for line in (tmp_path / "ids.jsonl").read_text().splitlines()
           for row in json.loads(line)]
    assert len(ids) == 5 and all(ids)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["eval/distinct_2_tokens"] == pytest.approx(distinct_ngrams(ids, 2))
