"""A batch of episodes, sampled turn by turn into one `Rollout`.

Notation: E episodes, B rows (one per episode, or more when a template forced a new segment),
P prompt width, R the width of everything after it.

    reset      every environment of the batch, concurrently: the first prompts
    turn t     every live episode's context (its prompt and all it holds so far) sampled by the
               engine in one call, each row from its own noise for turn t; stop strings cut it;
               each turn is cut at --max-new-tokens and at what is left of --max-episode-tokens
    step       every live environment gets its decoded turn, concurrently
    append     the observation's tokens (tether.rl.env.render), outside `action_mask`

An episode ends when its environment says done (the row `ended`), or truncated: a turn cut by
its budget (the environment still scores it), the episode's token budget spent, or --max-turns
reached. The row of an episode is one row of the layout of `tether.rl.rollout`: its prompt
left-padded, then its turns and observations, `action_mask` true on the sampled tokens only.
An episode's reward is the sum of its turns' rewards (`rewards`); each turn's reward also sits on
that turn's last sampled token (`turn_rewards`), for --reward-per-turn.

When every episode ended in its first turn, the rollout is that turn's sample as the engine laid
it out: a one-turn environment gives what a reward function gives, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from tether.errors import TetherError
from tether.rl.engines import RolloutEngine
from tether.rl.env.calls import EnvCalls, checked_prompt, checked_step
from tether.rl.env.render import Renderer
from tether.rl.rollout import Rollout, Sampling, apply_stop_strings, left_pad, right_padded
from tether.run.distributed import global_max
from tether.run.user_code.load import defined_at, own_file, raised


@dataclass(frozen=True)
class EpisodeLimits:
    """An episode's budgets (--max-turns, --max-new-tokens, --max-episode-tokens)."""

    max_turns: int
    max_new_tokens: int  # per turn
    max_episode_tokens: int  # everything after the prompt: turns, observations, template tokens
    max_context: int = 0  # the most tokens the model reads (its position limit); 0: no limit

    def room(self, episode: Episode) -> int:
        """Tokens the episode may still add: its budget, and its context's room in the model."""
        left = self.max_episode_tokens - episode.after_prompt()
        if self.max_context:
            left = min(left, self.max_context - len(episode.context()))
        return left


@dataclass
class Segment:
    """The tokens of one context: a prompt, then what follows it."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each
    turn_rewards: dict[int, float] = field(default_factory=dict)  # index in ids -> reward

    def extend(self, ids: list[int], sampled: bool, engine_logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        """Append `ids`, all sampled by the policy or all not (an observation's: log-prob 0.0,
        version 0)."""
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.engine_logprobs += [0.0] * len(ids) if engine_logprobs is None else engine_logprobs
        self.versions += [0] * len(ids) if versions is None else versions


@dataclass
class Episode:
    """One episode as it is sampled."""

    env: object
    segments: list[Segment]
    messages: list[dict] | None  # a chat episode's conversation so far
    prompt: str  # the first prompt's text
    text: str = ""  # the transcript after it: every turn and observation, decoded
    rewards: list[float] = field(default_factory=list)  # one per turn
    done: bool = False  # the environment ended it
    over: bool = False  # no more turns: done or truncated
    cut_observations: int = 0

    @property
    def segment(self) -> Segment:
        return self.segments[-1]

    def context(self) -> list[int]:
        return self.segment.prompt + self.segment.ids

    def after_prompt(self) -> int:
        """Tokens after the first prompt, over every segment (the episode's budget counts them)."""
        return sum(len(s.ids) for s in self.segments)


@dataclass
class Episodes:
    """A batch of episodes as training reads it."""

    rollout: Rollout  # B rows; `rollout.episode` maps rows to episodes when B > E
    rewards: torch.Tensor  # [B] each episode's summed reward on its last row, 0 on the others
    turn_rewards: torch.Tensor  # [B, R] each turn's reward on its last sampled token
    prompts: list[str]  # [B] each row's episode's first prompt
    row_texts: list[str]  # [B] each row's episode's transcript after its first prompt
    stats: dict[str, float]  # env/turns, env/action_tokens, env/observation_tokens, ...
    records: list[dict]  # [E] each episode as `tether generate --env` writes it (`record`)


def run_episodes(engine: RolloutEngine, calls: EnvCalls, renderer: Renderer, rows: list[dict],
                 seeds: list[int], noise: Callable[[int], torch.Tensor], limits: EpisodeLimits,
                 sampling: Sampling, *, tokenizer, device: torch.device,
                 where: Callable[[int], str] = lambda i: f"episode {i}") -> Episodes:
    """Episodes for `rows` (one each, environment seeds `seeds`), the engine sampling turn t
    with `noise(t)` [E, max_new_tokens] (row i's noise is episode i's) as `sampling` says (its
    temperature, EOS set, pad id and stop strings; the turns' lengths are `limits`'). `where(i)`
    names episode i in errors (its prompt-file row). Every environment's optional `close()` is
    called once its batch is over, whether it ended well or not."""
    envs = calls.make(len(rows))
    try:
        out = _sample(engine, calls, renderer, envs, rows, seeds, noise, limits, sampling,
                      tokenizer, device, where)
    except BaseException:
        _close(calls, envs, where, quiet=True)  # the first error is the one to report
        raise
    _close(calls, envs, where, quiet=False)
    return out


def _close(calls: EnvCalls, envs: list, where: Callable[[int], str], quiet: bool) -> None:
    """Each environment's `close()`, where it has one (a session to end, a process to stop)."""
    closing = [(i, env.close) for i, env in enumerate(envs) if callable(getattr(env, "close", None))]
    try:
        calls.gather([close for _, close in closing], [f"close of {where(i)}" for i, _ in closing])
    except TetherError:
        if not quiet:
            raise


def _sample(engine: RolloutEngine, calls: EnvCalls, renderer: Renderer, envs: list,
            rows: list[dict], seeds: list[int], noise: Callable[[int], torch.Tensor],
            limits: EpisodeLimits, sampling: Sampling, tokenizer, device: torch.device,
            where: Callable[[int], str]) -> Episodes:
    """run_episodes' work on environments already made."""
    firsts = calls.gather([partial(env.reset, row, seed)
                           for env, row, seed in zip(envs, rows, seeds)],
                          [f"reset of {where(i)}" for i in range(len(rows))])
    episodes = []
    for i, (env, first) in enumerate(zip(envs, firsts)):
        prompt = checked_prompt(first, f"environment {calls.name}: reset of {where(i)}")
        text, ids, messages = renderer.first(prompt, f"{where(i)}'s first prompt")
        if limits.max_context and len(ids) >= limits.max_context:
            raise TetherError(f"{where(i)}'s first prompt holds {len(ids)} tokens and the model "
                              f"reads at most {limits.max_context}: no room for a turn; lower "
                              "--max-prompt-len")
        episodes.append(Episode(env, [Segment(ids)], messages, text))
    pad_token_id, eos = sampling.pad_token_id, set(sampling.eos_token_ids)
    first_turn, versioned = None, False  # versioned: the engine tags tokens (sampling ahead)
    for turn in range(limits.max_turns):
        live = [i for i, e in enumerate(episodes) if not e.over]
        budget = [min(limits.max_new_tokens, limits.room(episodes[i])) for i in live]
        # Under torchrun every rank samples each turn, to the same width, while any rank has a
        # live episode: the native engine's decoding steps are collective (FSDP2's gathers, its
        # all-done vote), so every rank must take them together. A row's tokens do not depend
        # on the width, only on its own noise: an engine that is not collective samples the same.
        width = max(budget, default=0)
        width = global_max(width) if engine.lockstep else width
        if width == 0:
            break
        if not live:  # this rank's episodes are over: a context it has, sampled and dropped
            ids, mask = left_pad([episodes[0].segments[0].prompt], pad_token_id, device)
            engine.sample(ids, mask, **sampling.engine_settings(width, noise(turn)[:1, :width]))
            continue
        ids, mask = left_pad([episodes[i].context() for i in live], pad_token_id, device)
        sampled = engine.sample(ids, mask,
                                **sampling.engine_settings(width, noise(turn)[live][:, :width]))
        sampled = apply_stop_strings(sampled, tokenizer, sampling.stop_strings, pad_token_id)
        versioned = sampled.versions is not None
        if turn == 0:
            first_turn = sampled
        actions = [_take(sampled, j, budget[j], tokenizer) for j in range(len(live))]
        results = calls.gather([partial(episodes[i].env.step, actions[j][0])
                                for j, i in enumerate(live)],
                               [f"step of {where(i)}, turn {turn}" for i in live])
        for j, i in enumerate(live):
            label = f"environment {calls.name}: step of {where(i)}, turn {turn}"
            observation, reward, done = checked_step(results[j], label)
            _advance(episodes[i], actions[j], observation, reward, done, turn, limits, renderer,
                     eos, label)
    if first_turn is not None and all(len(e.rewards) == 1 for e in episodes):
        return _one_turn(first_turn, episodes)
    return _laid_out(episodes, pad_token_id, device, sampling.temperature, engine.own_logprobs,
                     versioned)


def _take(sampled: Rollout, j: int, budget: int, tokenizer
          ) -> tuple[str, list[int], list[float] | None, list[int] | None, bool]:
    """(decoded action, its ids, the engine's log-probs of them, the versions that sampled
    them, whether the turn ended) of row `j` of a turn's sample, cut at the episode's
    `budget`; log-probs and versions None where the engine reports none (`Segment.extend`)."""
    kept = sampled.response_mask[j]

    def cut(values: torch.Tensor | None) -> list | None:
        return None if values is None else values[j][kept].tolist()[:budget]
    ids = cut(sampled.responses)
    ended = bool(sampled.ended[j]) and int(kept.sum()) <= budget  # a turn cut short never ended
    return (tokenizer.decode(ids, skip_special_tokens=True), ids, cut(sampled.engine_logprobs),
            cut(sampled.versions), ended)


def _advance(episode: Episode, action: tuple, observation, reward: float, done: bool, turn: int,
             limits: EpisodeLimits, renderer: Renderer, eos: set[int], where: str) -> None:
    """Append the turn `action` and, if the episode goes on, the observation's tokens."""
    text, ids, logprobs, versions, ended = action
    segment = episode.segment
    segment.extend(ids, True, logprobs, versions)
    if ids:
        segment.turn_rewards[len(segment.ids) - 1] = reward
    episode.rewards.append(reward)
    episode.text += text
    if episode.messages is not None:
        episode.messages.append({"role": "assistant", "content": text})
    episode.done = done and ended
    if done or not ended or turn + 1 == limits.max_turns or not ids:
        episode.over = True
        return
    appended = renderer.observation(episode.messages, observation, ids[-1], eos, where)
    episode.cut_observations += appended.cut
    if appended.segment:  # a new context: the episode's budget, and the model's room for it
        fits = not limits.max_context or len(appended.ids) < limits.max_context
        budget = limits.max_episode_tokens - episode.after_prompt()
        if len(appended.ids) > renderer.max_prompt_len or not fits or budget <= 0:
            episode.over = True  # the new context does not fit: the episode ends truncated
            return
        episode.segments.append(Segment(appended.ids))
    else:
        if len(appended.ids) >= limits.room(episode):  # no room for another turn after it
            episode.over = True
            return
        segment.extend(appended.ids, False)
    episode.text += renderer.tokenizer.decode(appended.ids, skip_special_tokens=True)


def _one_turn(sampled: Rollout, episodes: list[Episode]) -> Episodes:
    """Every episode ended in its first turn: the rollout is that turn's sample, as laid out."""
    rewards = torch.tensor([e.rewards[0] for e in episodes], dtype=torch.float32)
    last = sampled.action_mask.long().cumsum(1).argmax(1)  # each row's last sampled token
    turn_rewards = torch.zeros(sampled.action_mask.shape, dtype=torch.float32)
    turn_rewards[torch.arange(len(episodes)), last.cpu()] = rewards
    # ended: by the environment's word, not by EOS
    rollout = replace(sampled, ended=torch.tensor([e.done for e in episodes],
                                                  device=sampled.ended.device))
    return Episodes(rollout, rewards.to(sampled.input_ids.device),
                    turn_rewards.to(sampled.input_ids.device), [e.prompt for e in episodes],
                    [e.text for e in episodes], _stats(episodes), [record(e) for e in episodes])


def _laid_out(episodes: list[Episode], pad_token_id: int, device: torch.device,
              temperature: float, own_logprobs: bool, versioned: bool) -> Episodes:
    """The episodes' segments as rows of the rollout layout (with the engine's log-probs when
    it reports them, and each sampled token's version when it tags them)."""
    segments = [(e_index, s) for e_index, e in enumerate(episodes) for s in e.segments]
    width = max(max(len(s.ids) for _, s in segments), 1)

    def after(fact: Callable[[Segment], list], fill, dtype: torch.dtype) -> torch.Tensor:
        """[rows, width]: a per-token fact of each segment's tokens after its prompt."""
        return right_padded([fact(s) for _, s in segments], width, fill, dtype, device)
    action_mask = after(lambda s: s.sampled, False, torch.bool)
    if not bool(action_mask.any(1).all()):
        raise TetherError("an episode segment holds no token the policy sampled (a bug: please "
                          "report it)")
    turn_rewards = after(lambda s: [s.turn_rewards.get(t, 0.0) for t in range(len(s.ids))], 0.0,
                         torch.float32)
    # each episode's summed reward on the row of its last segment, 0 on the others
    rewards = torch.tensor([sum(episodes[e].rewards) if s is episodes[e].segments[-1] else 0.0
                            for e, s in segments], dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad([s.prompt for _, s in segments], pad_token_id, device)
    ended = torch.tensor([episodes[e].done for e, _ in segments], device=device)
    episode = (torch.tensor([e for e, _ in segments], dtype=torch.long, device=device)
               if len(segments) > len(episodes) else None)
    rollout = Rollout.from_parts(
        prompt_ids, prompt_mask, after(lambda s: s.ids, pad_token_id, torch.long),
        after(lambda s: [True] * len(s.ids), False, torch.bool), ended, temperature,
        action_mask=action_mask, episode=episode,
        engine_logprobs=after(lambda s: s.engine_logprobs, 0.0, torch.float32)
        if own_logprobs else None,
        versions=after(lambda s: s.versions, 0, torch.long) if versioned else None)
    return Episodes(rollout, rewards.to(device), turn_rewards.to(device),
                    [episodes[e].prompt for e, _ in segments],
                    [episodes[e].text for e, _ in segments], _stats(episodes),
                    [record(e) for e in episodes])


def record(episode: Episode) -> dict:
    """An episode as data: `token_ids` (its prompt and everything after it) and `action_mask`
    (1 where the policy sampled the token), lists of lists when a template split it into
    segments (one per segment, each with its own context); the turns' rewards, their sum, the
    transcript and how it ended."""
    ids = [s.prompt + s.ids for s in episode.segments]
    mask = [[0] * len(s.prompt) + [int(x) for x in s.sampled] for s in episode.segments]
    one = len(ids) == 1
    return {"prompt": episode.prompt, "text": episode.text,
            "token_ids": ids[0] if one else ids, "action_mask": mask[0] if one else mask,
            "turn_rewards": list(episode.rewards), "reward": sum(episode.rewards),
            "turns": len(episode.rewards), "done": episode.done,
            "segments": len(ids), "cut_observations": episode.cut_observations}


def _stats(episodes: list[Episode]) -> dict[str, float]:
    """Means over the batch's episodes (docs/agents.md defines each), with the counts an
    environment reports itself (an optional `metrics()` method: {name: number}) as env/<name>."""
    n = len(episodes)
    sampled = [sum(sum(s.sampled) for s in e.segments) for e in episodes]
    after = [e.after_prompt() for e in episodes]
    own: dict[str, float] = {}
    for e in episodes:
        for key, value in _own_metrics(e.env).items():
            own[f"env/{key}"] = own.get(f"env/{key}", 0.0) + value / n
    return own | {"env/turns": sum(len(e.rewards) for e in episodes) / n,
            "env/action_tokens": sum(sampled) / n,
            "env/observation_tokens": sum(a - s for a, s in zip(after, sampled)) / n,
            "env/done_rate": sum(e.done for e in episodes) / n,
            "env/segments": sum(len(e.segments) - 1 for e in episodes) / n,
            "env/cut_observations": sum(e.cut_observations for e in episodes) / n}


def _own_metrics(env) -> dict[str, float]:
    """What the environment's optional `metrics()` reports, {name: number}; anything else (a
    str, a dict of text), or a raise, is one line naming its class and file."""
    report = getattr(env, "metrics", None)
    if not callable(report):
        return {}
    where = f"metrics() of environment {type(env).__qualname__} ({defined_at(report)})"
    try:
        values = report()
    except Exception as exc:  # noqa: BLE001 - the user's code, on one line
        raise TetherError(f"{where} raised {raised(exc, own_file(report))}; fix it") from exc
    with suppress(AttributeError, TypeError, ValueError):  # no .items(), or not numbers
        return {key: float(value) for key, value in values.items()}
    raise TetherError(f"{where} returned a {type(values).__name__} {str(values)[:60]!r}; "
                      "return a dict of {name: number} (docs/agents.md)")
