"""The demo task: its grammar, gold reward, noisy preference labels and diversity measure."""

from __future__ import annotations

import math

import pytest

from tether.demo import task


def test_every_generated_sentence_is_well_formed():
    assert all(task.is_well_formed(s) for s in task.corpus(2000, seed=3))


@pytest.mark.parametrize("text", [
    "the movie was great.",
    "i loved the music.",
    "this plot seemed very dull but i enjoyed the cast.",
    "the ending was not good.",
    "the film was fine and i hated the plot but i loved this music.",  # three clauses
    "  the film is quite fine.  ",  # surrounding white space is not the model's fault
])
def test_grammar_accepts(text):
    assert task.is_well_formed(text)


@pytest.mark.parametrize("text", [
    "the movie was great great wonderful.",  # the degenerate string a hacked policy writes
    "the movie was great",  # no full stop
    "the movie was great. the movie was great.",  # two sentences
    "great great great",
    "i loved the",
    "the movie was great and and i loved it.",
    # four clauses: a run-on, the other way a policy strings praise together
    "the film was fine and i loved the plot and i liked the cast and i enjoyed the music.",
    "",
])
def test_grammar_rejects(text):
    assert not task.is_well_formed(text)


def test_gold_is_vader_on_well_formed_text_and_minus_one_otherwise():
    # VADER's lexicon gives "great" 3.1; compound = s / sqrt(s^2 + 15) = 3.1 / sqrt(24.61).
    assert task.gold_score("the movie was great.") == pytest.approx(3.1 / math.sqrt(3.1**2 + 15),
                                                                      abs=1e-4)
    assert task.gold_score("the movie was awful.") < 0
    assert task.gold_score("the movie was great great great.") == -1.0
    assert task.gold_reward(["the movie", "i"], [" was great.", " loved loved"]) == [
        task.gold_score("the movie was great."), -1.0]


def test_preference_labels_follow_bradley_terry_on_gold():
    # Among pairs with gold gap g, the share where the higher-gold text is "chosen" should be
    # sigmoid(|g| / scale) on average: measure it against the model's own prediction.
    pairs = task.preference_pairs(3000, seed=0, noise_scale=0.25)
    predicted, observed = 0.0, 0
    for p in pairs:
        g_c = task.gold_score(p["prompt"] + p["chosen"])
        g_r = task.gold_score(p["prompt"] + p["rejected"])
        gap = abs(g_c - g_r) / 0.25
        predicted += 1.0 / (1.0 + math.exp(-gap))
        observed += g_c >= g_r
    n = len(pairs)
    # Binomial standard error of a share near 0.8 over 3000 pairs is ~0.007.
    assert observed / n == pytest.approx(predicted / n, abs=0.03)
    assert 0.6 < observed / n < 0.95  # noisy but informative
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    assert all(task.is_well_formed(p["prompt"] + p["chosen"]) for p in pairs)


def test_split_prompt_keeps_the_text():
    for s in task.corpus(100, seed=1):
        prompt, response = task.split_prompt(s)
        assert prompt + response == s and response.startswith(" ")

