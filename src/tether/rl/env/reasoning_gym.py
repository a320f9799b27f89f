"""reasoning-gym's procedural datasets as tether environments (the `reasoning-gym` extra).

    --env reasoning-gym:leg_counting?size=1000&attempts=2&max_animals=5

    reset(row, seed)   the question of entry `seed % size` of the dataset (built once, with the
                       dataset seed `seed`, 0 unless given), as chat messages: reasoning-gym's
                       system prompt (`system`, its "default": answer inside <answer> tags) and
                       the question as a user turn. The k samples of a prompt share the
                       environment seed, so they answer the same question; prompt row i of a
                       run meets the same question in every epoch. A row with a
                       `question_index` column asks that entry instead (a held-out set names its
                       own entries: eval rows get seeds of their own, but `seed % size` may
                       still meet a training question).
                       Every other column of the row is ignored: the prompts file only counts
                       the episodes, `{}` on each line will do.
    step(action)       the text inside the action's last <answer>...</answer> (reasoning-gym's
                       `extract_answer`; None without the tags) scored by the dataset's own
                       `score_answer(answer, entry)`: 1.0 right, 0.0 wrong, some datasets give
                       partial credit in between.
    attempts=N         a wrong answer (score < 1) before the N-th is told so as a user turn,
                       rewarded 0, and the episode goes on; the reward is the last answer's
                       score. N=1 (the default) is one turn: the episode's reward is the score.
    metrics()          env/solved (score 1), env/answered (the last turn had <answer> tags).

Options after `?` are `size`, `seed` and the dataset's own config fields (reasoning-gym's
`<Name>Config`), read as JSON where they parse (`5`, `0.5`, `true`, `["+", "-"]`), else as text;
plus the adapter's own `attempts` and `system` (a name in reasoning-gym's SYSTEM_PROMPTS, or
`none`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import threading
from collections.abc import Callable
from typing import Any

from tether.errors import TetherError
from tether.run.extras import require

OWN_OPTIONS = ("attempts", "system")  # the adapter's; every other option is the dataset's
RETRY = "That answer is not correct. Try again, with your final answer in <answer> </answer> tags."
NO_TAGS = "No answer found. Give your final answer in <answer> </answer> tags."


def reasoning_gym_environment(dataset: str, *, attempts: int = 1, system: str = "default",
                              **config: Any) -> Callable:
    """A tether environment factory over `reasoning_gym.create_dataset(dataset, **config)`
    (the module docstring says what its episodes do). `config`: `size`, `seed` and the
    dataset's config fields; the dataset is built, and its options checked, here, once."""
    return _factory(dataset, attempts, system, config, f"reasoning_gym_environment({dataset!r})")


def from_spec(dataset: str, options: dict[str, str], where: str) -> Callable:
    """The factory `--env reasoning-gym:<dataset>?<options>` names (`where`: that value)."""
    if not dataset:
        raise TetherError(f"--env {where} names no dataset; give one, e.g. "
                          "--env reasoning-gym:leg_counting")
    values: dict[str, Any] = {}
    for key, text in options.items():
        try:
            values[key] = json.loads(text)
        except ValueError:
            values[key] = text  # plain text: a name, a word
    attempts = values.pop("attempts", 1)
    system = options.get("system", "default")  # a name, whatever JSON would make of it
    values.pop("system", None)
    return _factory(dataset, attempts, system, values, f"--env {where}")


def _factory(dataset: str, attempts: Any, system: str, config: dict[str, Any],
             needed_by: str) -> Callable:
    """The factory, its options checked; `needed_by` names what the user wrote, in errors."""
    rg = require("reasoning_gym", needed_by)
    utils = require("reasoning_gym.utils", needed_by)
    registered = rg.factory.DATASETS
    if dataset not in registered:  # one line listing a few registered names
        close = difflib.get_close_matches(dataset, sorted(registered), n=8) or sorted(registered)
        raise TetherError(f"{needed_by}: reasoning-gym has no dataset {dataset!r}; "
                          f"it has e.g. {', '.join(close[:8])} ({len(registered)} in all)")
    fields = [f.name for f in dataclasses.fields(registered[dataset][1])]  # its config's
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise TetherError(f"{needed_by}: {dataset} has no option {unknown[0]!r}; its options are "
                          f"{', '.join(OWN_OPTIONS + tuple(fields))}")
    _whole(needed_by, "attempts", attempts, 1)
    _whole(needed_by, "size", config.get("size", 1), 1)  # entry `seed % size` of the dataset
    if config.get("seed") is not None:  # None: reasoning-gym draws one
        _whole(needed_by, "seed", config["seed"])
    prompts = utils.SYSTEM_PROMPTS
    if system != "none" and system not in prompts:
        raise TetherError(f"{needed_by}: system={system!r} is not one of reasoning-gym's system "
                          f"prompts; give one of {', '.join(sorted(prompts))} or none")
    # reasoning-gym draws a random seed when given none: not reproducible
    config.setdefault("seed", 0)
    try:
        data = rg.create_dataset(dataset, **config)
    except (AssertionError, ValueError, TypeError) as exc:  # the config's own validate()
        raise TetherError(f"{needed_by}: reasoning-gym refused the options of {dataset} "
                          f"({type(exc).__name__}: {exc}); fix them") from exc
    shared = _Dataset(data, utils.extract_answer)
    opening = [] if system == "none" else [{"role": "system", "content": prompts[system]}]

    def make_env() -> ReasoningGymEpisode:
        return ReasoningGymEpisode(shared, attempts, opening)
    # tether names a factory `module:qualname` in its errors: here `reasoning-gym:<dataset>`
    make_env.__module__, make_env.__qualname__ = "reasoning-gym", dataset
    make_env.attempts = attempts  # the turns an episode may need (tether.rl.env.load)
    return make_env


def _whole(needed_by: str, key: str, value: Any, least: int | None = None) -> None:
    """A whole-number option (at least `least`), or one line naming it and what it takes."""
    if not isinstance(value, int) or isinstance(value, bool) or least is not None and value < least:
        raise TetherError(f"{needed_by}: {key}={value!r}; give a whole number"
                          + (f" >= {least}" if least is not None else ""))


class _Dataset:
    """The dataset the episodes of a run share. Its entries and scores are read under a lock:
    sync environment calls run in threads, and a dataset's code need not be thread-safe."""

    def __init__(self, data, extract_answer: Callable[[str], str | None]):
        self.data, self.extract_answer, self.lock = data, extract_answer, threading.Lock()

    def entry(self, row: dict, seed: int) -> dict:
        index = row.get("question_index", seed % len(self.data))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.data):
            raise TetherError(f"question_index {index!r} is not an entry of the dataset "
                              f"(0 to {len(self.data) - 1}); fix the row or raise ?size=")
        with self.lock:
            return self.data[index]

    def score(self, answer: str | None, entry: dict) -> float:
        with self.lock:
            return float(self.data.score_answer(answer, entry))


class ReasoningGymEpisode:
    """One episode: one question, up to `attempts` answers."""

    def __init__(self, dataset: _Dataset, attempts: int, opening: list[dict]):
        self.dataset, self.attempts, self.opening = dataset, attempts, opening
        self.entry: dict = {}
        self.tries, self.last_score, self.answered = 0, 0.0, False

    def reset(self, row: dict, seed: int) -> list[dict]:
        self.entry = self.dataset.entry(row, seed)
        return self.opening + [{"role": "user", "content": self.entry["question"]}]

    def step(self, action: str) -> tuple[str | None, float, bool]:
        answer = self.dataset.extract_answer(action)
        self.tries += 1
        self.answered = answer is not None
        self.last_score = self.dataset.score(answer, self.entry)
        if self.last_score >= 1.0 or self.tries >= self.attempts:
            return None, self.last_score, True
        return (RETRY if self.answered else NO_TAGS), 0.0, False  # the last answer is scored

    def metrics(self) -> dict[str, float]:
        return {"solved": float(self.last_score >= 1.0), "answered": float(self.answered)}
