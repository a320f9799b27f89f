"""Where a batch's rows come from: prompts answered once and scored by a reward, or episodes of
an environment. The loop draws its batches from one `RolloutSource` (`make_source` chooses,
once) and never asks which.

    PromptSource   each prompt row answered once by the engine, cut at the stop strings, scored
                   by the reward (a reward model or a Python function); `PromptsScoredAhead`
                   scores the batches sampled ahead in the background too
    EnvSource      each prompt row the start of an episode (tether.rl.env): reset, then turns of
                   the policy and answers of the environment, rewarded by it

Both take the global batch's prompt rows (each prompt k times, consecutive) and this rank's
slice of them (or an evaluation's chunk), and return those rows, padded to their own widths
(`tether.rl.roles.gather_rollout` pads ranks to one width). Noise: turn t of row i draws row i
of `sampling_uniforms(noise_seed + t * TURN_SEED_STRIDE, rows, max_new_tokens)`, so turn 0 is
what a one-turn source draws, and every draw is a function of (seed, batch, row, turn) alone,
whatever the slice.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tether.errors import TetherError
from tether.rl.engines import RolloutEngine
from tether.rl.env.calls import EnvCalls
from tether.rl.env.episodes import EpisodeLimits, run_episodes
from tether.rl.env.render import Renderer
from tether.rl.env.tools import tools_environment
from tether.rl.reward import FailedRows, Reward
from tether.rl.rollout import (
    Rollout,
    Sampling,
    apply_stop_strings,
    decode_responses,
    left_pad,
    sampling_uniforms,
)
from tether.run.distributed import current
from tether.run.user_code.load import load_function

TURN_SEED_STRIDE = 100_003  # turn t's noise: the batch's seed plus t strides
# The environment seed of every episode that starts from prompt row i is run seed * this + i:
# the k samples of a prompt meet the same environment, and a resumed run meets the ones it met
ENV_SEED_STRIDE = 1_000_033


@dataclass
class Collected:
    """This rank's rows of a batch."""

    prompts: list[str]  # each row's prompt text (an episode's first prompt)
    texts: list[str]  # each row's response (an episode's transcript after its first prompt)
    rollout: Rollout
    scores: torch.Tensor | None  # [B] raw scores: the reward's, an episode's summed reward; or
    # None: a source without a reward (`tether eval` without one)
    turn_rewards: torch.Tensor | None  # [B, R] each turn's reward on its last token (episodes)
    stats: dict[str, float]  # means over this rank's rows: an episode's (env/...), or each
    # reward function's over the responses it scored (reward/<name>)
    records: list[dict] | None = None  # each episode as data (tether.rl.env.episodes.record)
    rows: list[dict] | None = None  # the prompt row each row answers (what a gold function reads)
    failed: FailedRows | None = None  # rows the reward pool could not score (NaN in `scores`)


class RolloutSource(Protocol):
    def collect(self, rows: list[int], mine: slice, noise_seed: int) -> Collected: ...

    def prefetch(self, rows: list[int], mine: slice, noise_seed: int) -> None:
        """Tell the engine about the batch a later `collect` with these arguments will ask for
        (an engine sampling ahead of the trainer starts it now)."""

    def close(self) -> None: ...


class SubmittedAhead:
    """A source that hands each batch whole to its engine ahead of its `collect`
    (`RolloutEngine.submit`): `prefetch` submits `self.work(engine, rows, mine, noise_seed)`,
    which an engine sampling ahead runs now, in the background; `collect` takes its result, or
    runs the work now for a batch never handed over (a --dynamic-sampling refill)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[tuple, object] = {}  # a batch's key -> its handle, not yet taken

    @staticmethod
    def key(rows: list[int], mine: slice, noise_seed: int) -> tuple:
        return tuple(rows), (mine.start, mine.stop, mine.step), noise_seed  # slices: unhashable

    def prefetch(self, rows: list[int], mine: slice, noise_seed: int) -> None:
        key = self.key(rows, mine, noise_seed)
        if key not in self.pending:
            self.pending[key] = self.engine.submit(
                lambda engine: self.work(engine, rows, mine, noise_seed))

    def collect(self, rows: list[int], mine: slice, noise_seed: int) -> Collected:
        started = self.pending.pop(self.key(rows, mine, noise_seed), None)
        if started is not None:
            return started.result()
        return self.work(self.engine, rows, mine, noise_seed)


class PromptSource:
    """One response per prompt row (the single-turn loop)."""

    def __init__(self, engine: RolloutEngine, tokenizer, prompts: list[str],
                 prompt_ids: list[list[int]], reward: Reward | None, sampling: Sampling,
                 device: torch.device, rows: Sequence[dict] | None = None):
        self.engine, self.tokenizer, self.reward = engine, tokenizer, reward
        self.prompts, self.prompt_ids, self.rows = prompts, prompt_ids, rows
        self.sampling, self.device = sampling, device

    def request(self, rows: list[int], mine: slice, noise_seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """What the engine is asked for these rows: (prompt ids, their mask, the settings)."""
        s = self.sampling
        ids, mask = left_pad([self.prompt_ids[i] for i in rows[mine]], s.pad_token_id,
                             self.device)
        uniforms = sampling_uniforms(noise_seed, len(rows), s.max_new_tokens)[mine]
        return ids, mask, s.engine_settings(s.max_new_tokens, uniforms)

    def prefetch(self, rows: list[int], mine: slice, noise_seed: int) -> None:
        ids, mask, settings = self.request(rows, mine, noise_seed)
        self.engine.prefetch(ids, mask, **settings)

    def collect(self, rows: list[int], mine: slice, noise_seed: int) -> Collected:
        return self.work(self.engine, rows, mine, noise_seed)

    def work(self, engine: RolloutEngine, rows: list[int], mine: slice,
             noise_seed: int) -> Collected:
        """The rows answered by `engine`, cut at the stop strings, and scored."""
        s = self.sampling
        ids, mask, settings = self.request(rows, mine, noise_seed)
        rollout = engine.sample(ids, mask, **settings)
        rollout = apply_stop_strings(rollout, self.tokenizer, s.stop_strings, s.pad_token_id)
        prompts = [self.prompts[i] for i in rows[mine]]
        table = [self.rows[i] for i in rows[mine]] if self.rows else None
        responses = decode_responses(self.tokenizer, rollout)
        if self.reward is None:
            return Collected(prompts, responses, rollout, None, None, {}, rows=table)
        scored = self.reward(prompts, responses, rollout, table)
        # reward/<name>: each reward function's mean over the responses it scored (not None)
        means = {f"reward/{name}": float(part.nanmean()) for name, part in scored.parts.items()}
        return Collected(prompts, responses, rollout, scored.scores.to(self.device), None, means,
                         rows=table, failed=scored.failed)

    def close(self) -> None:
        pass


class PromptsScoredAhead(SubmittedAhead, PromptSource):
    """`PromptSource` for an engine sampling ahead of the trainer and a reward that does not run
    on the trainer's main thread anyway (the reward pool's workers, a reward server): a batch
    asked for ahead is sampled and scored in the background (`RolloutEngine.submit`), so
    neither the sampling nor the reward holds up the step. A reward function called directly
    stays on the main thread (`PromptSource`): one that times itself with SIGALRM
    (math_verify) can only run there."""


class EnvSource(SubmittedAhead):
    """Each prompt row the start of an episode (tether.rl.env.episodes): a batch's episodes are
    handed to the engine whole (`SubmittedAhead`), so that one sampling ahead of the trainer
    runs them, environment and all, while the trainer updates."""

    def __init__(self, engine: RolloutEngine, calls: EnvCalls, renderer: Renderer,
                 rows: Sequence[dict], limits: EpisodeLimits, sampling: Sampling, run_seed: int,
                 tokenizer, device: torch.device, source_name: str = "prompts"):
        self.engine, self.calls, self.renderer = engine, calls, renderer
        self.rows, self.limits, self.sampling = rows, limits, sampling
        self.run_seed, self.tokenizer, self.device = run_seed, tokenizer, device
        self.source_name = source_name
        self.checked_turns = False  # the first batch is checked for turns that never end
        super().__init__()

    def work(self, engine: RolloutEngine, rows: list[int], mine: slice,
             noise_seed: int) -> Collected:
        """This batch's episodes, sampled by `engine`."""
        s = self.sampling
        indices = rows[mine]

        def noise(turn: int) -> torch.Tensor:
            return sampling_uniforms(noise_seed + turn * TURN_SEED_STRIDE, len(rows),
                                     s.max_new_tokens)[mine]
        episodes = run_episodes(engine, self.calls, self.renderer,
                                [self.rows[i] for i in indices],
                                [self.run_seed * ENV_SEED_STRIDE + i for i in indices], noise,
                                self.limits, s, tokenizer=self.tokenizer, device=self.device,
                                where=lambda j: f"episode of {self.source_name} row {indices[j]}")
        # A turn cut by --max-new-tokens ends its episode (as specified): said once per source,
        # on its first batch, where every episode ended so in its first turn (issue 47)
        stats, limits = episodes.stats, self.limits
        if not self.checked_turns and limits.max_turns > 1 and current().is_main and (
                stats["env/turns"] == 1 and stats["env/action_tokens"] == limits.max_new_tokens):
            print(f"warning: every episode ended in its first turn: each reached --max-new-tokens "
                  f"{limits.max_new_tokens} without ending (no EOS or stop string), and a turn cut "
                  f"by its budget ends its episode, so --max-turns {limits.max_turns} never "
                  "comes into play; raise --max-new-tokens, or give --stop-strings that end a "
                  "turn", file=sys.stderr, flush=True)
        self.checked_turns = True
        table = [self.rows[indices[j]] for j in episodes.rollout.episode_ids().tolist()]
        return Collected(episodes.prompts, episodes.row_texts, episodes.rollout,
                         episodes.rewards, episodes.turn_rewards, episodes.stats,
                         episodes.records, table)

    def close(self) -> None:
        """Nothing to close: the environments' calls run on the process's event loop, kept for
        the process (tether.run.user_code.loop); episodes still running ahead end at their next
        turn (the engine closed first)."""


def make_source(settings, engine: RolloutEngine, tokenizer, *, prompts: list[str],
                prompt_ids: list[list[int]], rows: Sequence[dict], reward: Reward | None,
                env, tools: list, eos_token_ids: Sequence[int], device: torch.device,
                source_name: str, context_limit: int | None = None,
                env_seed_base: int | None = None, score_ahead: bool = False) -> RolloutSource:
    """The source the settings ask for, the one place that decides: episodes of `env` (a
    factory) or of `tools` (Python functions, scored by `reward`), else the prompts answered once
    and scored by `reward`. `settings`: a config with the sampling and environment fields
    (PPOConfig; `tether eval` and `tether generate`'s). `context_limit`: the most tokens the
    policy reads (`tether.models.reward_model.position_limit`), which no episode outgrows.
    `env_seed_base`: the run seed the environment seeds derive from (`ENV_SEED_STRIDE`; the
    settings' seed by default), so that held-out episodes meet other environments than training's.
    `score_ahead`: prompts sampled ahead are scored in the background too (`PromptsScoredAhead`:
    the engine samples ahead, and `reward` runs off the main thread)."""
    sampling = Sampling(settings.max_new_tokens, settings.temperature, tuple(eos_token_ids),
                        tokenizer.pad_token_id, tuple(settings.stop_strings))
    if not (env or tools):
        kind = PromptsScoredAhead if score_ahead else PromptSource
        return kind(engine, tokenizer, prompts, prompt_ids, reward, sampling, device, rows)
    schemas = None
    if tools:  # each tool call has --env-timeout (a hang goes back to the model), the reward
        # function on the answer --reward-fn-timeout: the step, tether's own code, none of its own
        env, schemas = tools_environment(tools, reward, tokenizer, settings.env_timeout)
    calls = EnvCalls(env, None if tools else settings.env_timeout, settings.env_workers)
    renderer = Renderer(tokenizer, settings.max_prompt_len, settings.max_observation_tokens,
                        schemas)
    limits = EpisodeLimits(settings.max_turns, settings.max_new_tokens,
                           settings.resolved_max_episode_tokens, context_limit or 0)
    return EnvSource(engine, calls, renderer, rows, limits, sampling,
                     settings.seed if env_seed_base is None else env_seed_base, tokenizer,
                     device, source_name)


def longest_prompt(settings, prompt_ids: Sequence[Sequence[int]],
                   context_limit: int | None = None) -> int:
    """The longest context an engine is given before a turn: the longest of `prompt_ids`, or for
    episodes a first prompt and all an episode may hold before its last turn, within the
    model's `context_limit` less one turn."""
    if settings.episodic:
        longest = (settings.max_prompt_len + settings.resolved_max_episode_tokens
                   - settings.max_new_tokens)
        if context_limit:
            longest = min(longest, max(context_limit - settings.max_new_tokens, 1))
        return longest
    return max(len(p) for p in prompt_ids)


def load_tools(specs: Sequence[str]) -> list:
    """The functions `--tools` names (`file.py:add,file.py:lookup`, or several values)."""
    names = [name.strip() for spec in specs for name in spec.split(",") if name.strip()]
    if specs and not names:  # `--tools ''`: episodes of no tools
        raise TetherError(f"--tools {' '.join(map(repr, specs))} names no tool; give "
                          "file.py:function (several joined by commas), or drop --tools")
    return [load_function(name, "tool") for name in names]
