"""The demo's built-in task: short movie reviews from a small grammar, and a gold reward.

The language: one to three clauses joined by "and"/"but", each either "the plot was very dull"
or "i loved the music", ended by a full stop. The SFT model learns it from a corpus generated here.

The gold reward is what a person would endorse and no proxy sees directly:

    gold(text) = VADER compound sentiment of text   if text is a well-formed sentence of the grammar
               = -1                                 otherwise (degenerate text is worth nothing)

VADER (Hutto and Gilbert 2014) is a rule-based sentiment lexicon; it handles negation ("not
great") and intensifiers ("very"), which a small reward model learns only roughly. The proxy
reward model sees a limited number of preference pairs between well-formed sentences, labelled by
the gold reward with Bradley-Terry noise, as in Gao et al. (2022), "Scaling Laws for Reward Model
Overoptimization". It never sees ill-formed text, so nothing stops it from liking "great great
wonderful" more than any sentence: the opening a policy without a KL leash finds.
"""

from __future__ import annotations

import math
import random
import re
from functools import lru_cache

DETERMINERS = ("the", "this")
NOUNS = ("movie", "film", "plot", "acting", "ending", "music", "story", "cast", "script", "dialogue")
VERBS = ("was", "is", "felt", "seemed")
ADVERBS = ("very", "quite", "really", "so", "rather")
ADJECTIVES = ("great", "wonderful", "good", "fine", "brilliant", "charming", "funny", "clever",
              "fresh", "solid", "awful", "boring", "dull", "bad", "terrible", "messy", "weak",
              "strange", "slow", "long", "predictable", "simple")
FEELINGS = ("loved", "liked", "enjoyed", "hated", "disliked")
CONJUNCTIONS = ("and", "but")


def _alternation(words: tuple[str, ...]) -> str:
    return "(?:" + "|".join(words) + ")"


_DESCRIBE = (f"{_alternation(DETERMINERS)} {_alternation(NOUNS)} {_alternation(VERBS)}"
             f"(?: {_alternation(ADVERBS)})?(?: not)? {_alternation(ADJECTIVES)}")
_FEEL = f"i {_alternation(FEELINGS)} {_alternation(DETERMINERS)} {_alternation(NOUNS)}"
_CLAUSE = f"(?:{_DESCRIBE}|{_FEEL})"
MAX_CLAUSES = 3  # a review that strings more clauses together is a run-on, not a review
SENTENCE = re.compile(f"{_CLAUSE}(?: {_alternation(CONJUNCTIONS)} {_CLAUSE}){{0,{MAX_CLAUSES - 1}}}\\.")


def is_well_formed(text: str) -> bool:
    """True when `text` (surrounding white space ignored) is exactly one sentence of the grammar."""
    return SENTENCE.fullmatch(text.strip()) is not None


def _clause(rng: random.Random) -> list[str]:
    if rng.random() < 0.3:
        return ["i", rng.choice(FEELINGS), rng.choice(DETERMINERS), rng.choice(NOUNS)]
    words = [rng.choice(DETERMINERS), rng.choice(NOUNS), rng.choice(VERBS)]
    if rng.random() < 0.4:
        words.append(rng.choice(ADVERBS))
    if rng.random() < 0.15:
        words.append("not")
    return words + [rng.choice(ADJECTIVES)]


def sentence(rng: random.Random) -> str:
    """One random sentence of the grammar."""
    words = _clause(rng)
    n_clauses = 1 + (rng.random() < 0.4) + (rng.random() < 0.15)  # 1, 2 or 3
    for _ in range(n_clauses - 1):
        words += [rng.choice(CONJUNCTIONS)] + _clause(rng)
    return " ".join(words) + "."


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(n)]


def split_prompt(text: str) -> tuple[str, str]:
    """Cut a sentence after its first one or two words: ("the movie", " was very dull.")."""
    words = text.split(" ")
    cut = 1 if words[0] == "i" else 2
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def prompts(n: int, seed: int) -> list[str]:
    return [split_prompt(text)[0] for text in corpus(n, seed)]


@lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def gold_score(text: str) -> float:
    """The gold reward of one full text (prompt + response), in [-1, 1]."""
    if not is_well_formed(text):
        return -1.0
    return float(_vader().polarity_scores(text.strip())["compound"])


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Reward-function form of `gold_score`: (prompts, responses) -> scores."""
    return [gold_score(p + r) for p, r in zip(prompts, responses, strict=True)]


def preference_pairs(n: int, seed: int, noise_scale: float = 0.25) -> list[dict]:
    """`n` pairs {prompt, chosen, rejected} of well-formed continuations of the same prompt.

    The label follows the Bradley-Terry model on the gold reward,
    P(a preferred to b) = sigmoid((gold(a) - gold(b)) / noise_scale), so close pairs are often
    mislabelled and the proxy learned from them is good but imperfect.
    """
    rng = random.Random(seed)
    pairs: list[dict] = []
    while len(pairs) < n:
        prompt, first = split_prompt(sentence(rng))
        second = _continuation_of(prompt, rng)
        if second is None or second == first:
            continue
        gap = (gold_score(prompt + first) - gold_score(prompt + second)) / noise_scale
        first_wins = rng.random() < 1.0 / (1.0 + math.exp(-gap))
        chosen, rejected = (first, second) if first_wins else (second, first)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def _continuation_of(prompt: str, rng: random.Random, tries: int = 200) -> str | None:
    """A fresh random sentence that starts with `prompt`, as its continuation."""
    for _ in range(tries):
        text = sentence(rng)
        if text.startswith(prompt + " "):
            return text[len(prompt):]
    return None

