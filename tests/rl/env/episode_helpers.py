"""Pieces for the episode tests: a tiny policy with its native engine, a recorder of what the
engine sampled, and `episodes(...)` that runs a batch of them the way the online loop does."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.rl.engines import RolloutEngine, native
from tether.rl.env.calls import EnvCalls
from tether.rl.env.episodes import EpisodeLimits, run_episodes
from tether.rl.env.render import Renderer
from tether.rl.rollout import Sampling, sampling_uniforms
from tether.run.distributed import Dist


class InProcess(RolloutEngine):
    """A test engine's RolloutEngine side beside `sample`: no log-probs of its own, and nothing
    to put to sleep, sync, close or checkpoint (`RolloutEngine`)."""

    lockstep = True


@dataclass
class Policy:
    tokenizer: object
    model: torch.nn.Module
    turns: list[list[list[int]]] = field(default_factory=list)  # per call, per row: sampled ids

    def engine(self):
        inner = native.start(None, self.model, None, 0, Dist())
        policy = self

        class Recording(InProcess):

            def sample(self, ids, mask, **settings):
                rollout = inner.sample(ids, mask, **settings)
                policy.turns.append([rollout.responses[i][rollout.response_mask[i]].tolist()
                                     for i in range(len(rollout))])
                return rollout

        return Recording()


def policy_of(model_dir) -> Policy:
    tokenizer = load_tokenizer(str(model_dir))
    return Policy(tokenizer, disable_dropout(load_causal_lm(str(model_dir), tokenizer)).eval())


def episodes(policy: Policy, factory, rows: list[dict], *, max_turns: int = 3,
             max_new_tokens: int = 6, max_episode_tokens: int = 200, max_observation: int = 16,
             stop_strings=(" ",), seeds=None, timeout: float = 10.0, tools=None, seed: int = 0,
             workers: int = 4, max_context: int = 0):
    """`run_episodes` on `rows` with the policy's native engine (every call recorded)."""
    tokenizer = policy.tokenizer
    return run_episodes(
        policy.engine(), EnvCalls(factory, timeout, workers=workers),
        Renderer(tokenizer, 64, max_observation, tools), rows,
        seeds if seeds is not None else list(range(len(rows))),
        lambda turn: sampling_uniforms(seed + 1000 * turn, len(rows), max_new_tokens),
        EpisodeLimits(max_turns, max_new_tokens, max_episode_tokens, max_context),
        Sampling(max_new_tokens, 1.0, (tokenizer.eos_token_id,), tokenizer.pad_token_id,
                 tuple(stop_strings)), tokenizer=tokenizer, device=torch.device("cpu"))


class Scripted(InProcess):
    """An engine that answers from a script instead of sampling: `reply(context_text)` gives a
    turn's text, encoded and closed by `end_id` (an EOS the policy would sample), cut at
    max_new_tokens. The tokens are what a policy that wrote that text would have sampled, so an
    episode's every other step (environment, template, layout) is the real one."""

    def __init__(self, tokenizer, reply, end_id: int | None = None):
        self.tokenizer, self.reply = tokenizer, reply
        self.end_id = tokenizer.eos_token_id if end_id is None else end_id
        self.contexts: list[str] = []

    def sample(self, ids, mask, *, max_new_tokens, temperature, eos_token_ids, pad_token_id,
               uniforms=None):
        from tether.rl.rollout import Rollout

        responses = []
        for row, row_mask in zip(ids, mask):
            context = self.tokenizer.decode(row[row_mask.bool()].tolist(),
                                            skip_special_tokens=False)
            self.contexts.append(context)
            text = self.reply(context)
            responses.append((self.tokenizer(text, add_special_tokens=False)["input_ids"]
                              + [self.end_id])[:max_new_tokens])
        width = max(len(r) for r in responses)
        out = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(responses), width), dtype=torch.bool)
        for i, r in enumerate(responses):
            out[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = True
        ended = torch.tensor([r[-1] in eos_token_ids for r in responses])
        return Rollout(torch.cat([ids, out], 1), torch.cat([mask.long(), response_mask.long()], 1),
                       response_mask, ended, ids.shape[1], temperature)



def scripted_episodes(engine: Scripted, factory, rows: list[dict], *, tools=None,
                      max_turns: int = 4, max_new_tokens: int = 256, max_episode_tokens: int = 1000,
                      max_prompt: int = 4000, max_observation: int = 64,
                      eos_token_ids: tuple[int, ...] | None = None):
    """`run_episodes` with a scripted engine (no stop strings: each turn ends at `end_id`; the
    EOS set is the tokenizer's EOS, or `eos_token_ids`)."""
    tokenizer = engine.tokenizer
    return run_episodes(
        engine, EnvCalls(factory, 10.0, workers=4),
        Renderer(tokenizer, max_prompt, max_observation, tools), rows, list(range(len(rows))),
        lambda turn: sampling_uniforms(turn, len(rows), max_new_tokens),
        EpisodeLimits(max_turns, max_new_tokens, max_episode_tokens),
        Sampling(max_new_tokens, 1.0, eos_token_ids or (tokenizer.eos_token_id,),
                 tokenizer.pad_token_id), tokenizer=tokenizer, device=torch.device("cpu"))
