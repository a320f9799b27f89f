"""tether's own rollout engine: plain ancestral sampling from softmax(logits / T), KV-cached, on
the trainer's own model (`NativeEngine`, a `tether.rl.engines.RolloutEngine`: its weights are the
trainer's, so `sync` has nothing to do, and its log-probs are the trainer's own).

Notation: B rows, P prompt width, R new tokens, V vocabulary.

The prompt's forward runs once per distinct prompt (`prefill`: GRPO and RLOO answer each prompt k
times), then one token per row per step through transformers' KV cache (`ModelForward`: the
model's own forward, so any causal LM and wrapper works, and under FSDP2 each layer's hooks
gather its parameters).

What it does not do (prefetch, sleep, sync, checkpoint: its weights are the trainer's) is
`RolloutEngine`'s default, here too: the interface every engine subclasses (re-exported by
`tether.rl.engines`), whose defaults are those of an engine that samples only when asked.

Each row's tokens depend on its own noise only (`tether.rl.rollout.sampling_uniforms`), not on the
batch it is sampled in, so any split of a global batch (ranks, chunks) samples what the whole batch
would, and a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from tether.models import forward as shared_prompt
from tether.models.forward import cache_name, output_cache, position_ids_from_mask
from tether.rl.engines.jobs import Background, Deferred, T
from tether.rl.rollout import Rollout, sampling_noise
from tether.run import distributed
from tether.run.distributed import Dist


class RolloutEngine(Protocol):
    """What the loop asks of whoever samples.

    sample      prompts [B, P] (left-padded, with their mask) -> a `Rollout` of B rows, each row
                sampled from softmax(logits / temperature) and nothing else, stopping on
                `eos_token_ids`, drawn from its own noise (`uniforms` [B, max_new_tokens], or a
                `generator`), so that any split of a batch samples what the whole would
    own_logprobs  True when the rollout carries the engine's own log-probs of what it sampled
                (`Rollout.engine_logprobs`, pi_engine): the engine computes the policy with other
                kernels, and the loop measures and may correct the gap (`mismatch`). False for an
                engine that samples the trainer's own model: its log-probs are the trainer's.
    prefetch    the same arguments as `sample`, nothing returned: a batch the loop will ask for
                later, which an engine sampling ahead of the trainer starts now (`ahead`);
                the others ignore it and sample when asked
    submit      work(engine) that samples through an engine several times (a batch of episodes,
                turn by turn) -> a handle whose `result()` is what the work returns
                (`jobs`): an engine sampling ahead runs the work now, in the background, with
                the weights last synced, and its next sync waits for it; the others run it
                when its result is asked for
    lockstep    True when `sample` is collective under torchrun (the native sampler's decoding
                steps): every rank calls it together, to the same width, even with nothing of
                its own left to sample
    sleep       the update is about to run: free what the update needs (a GPU engine's KV cache)
    sync        take the policy's current weights (after each update, and after a resume)
    close       stop and free everything; also after a failed start or a stopped run
    state_dict  what a checkpoint must hold for a resumed run to sample what the uninterrupted
                one did (the weights the batches in flight are sampled by, when sampling ahead);
                {} for an engine without state
    load_state_dict   the same, restored by --resume before the run's first sync; the batches in
                flight are then asked for again (`prefetch`, `submit`), oldest first
    An engine subclasses this class and inherits what an engine that samples only when asked,
    on weights it keeps no copy of, has nothing to do in (the native engine): no prefetch, work
    run when its result is asked for (`jobs.Deferred`), nothing to free, take, close or
    checkpoint. It writes `sample` and whatever it does differently (vLLM: `sleep`, `sync`,
    `close`; sampling ahead: all of them).
    """

    own_logprobs: bool = False
    lockstep: bool = False

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
               max_new_tokens: int, temperature: float, eos_token_ids: Sequence[int],
               pad_token_id: int, uniforms: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> Rollout: ...

    def prefetch(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> None:
        pass

    def submit(self, work: Callable[[RolloutEngine], T]) -> Deferred[T] | Background[T]:
        return Deferred(lambda: work(self))

    def sleep(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class NativeEngine(RolloutEngine):
    """`sample_responses` on the policy, reached through `run_model(fn) -> fn(policy)` (in
    training: inside the DDP/FSDP2 wrapper, `Roles.generate`). Its weights are the trainer's, so
    it has nothing to sync. Under several processes sampling stops when no row of any rank is
    alive, so every rank runs the same decoding steps (FSDP2's gathers must match) and the
    response width is the one-process width."""

    lockstep = True  # its decoding steps are collective (`all_done`, FSDP2's gathers)

    def __init__(self, run_model: Callable, d: Dist, record_logprobs: bool = False):
        self.run_model = run_model
        self.all_done = (None if not d.active else
                         lambda alive: distributed.global_sum(int(alive.sum()), d) == 0)
        # On the trainer's model its log-probs are the trainer's; a copy of the policy sampling
        # ahead of the trainer (rl.engines.ahead) records them: they are the behaviour policy's.
        self.own_logprobs = record_logprobs

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> Rollout:
        return self.run_model(lambda policy: sample_responses(
            policy, prompt_ids, prompt_mask, all_done=self.all_done,
            record_logprobs=self.own_logprobs, **settings))


def start(settings, model: nn.Module, peft: nn.Module | None, longest_prompt: int, d: Dist,
          run_model: Callable | None = None) -> NativeEngine:
    """The native engine on `model` (`tether.choices.ENGINES`' start): called through
    `run_model`, or directly (a frozen model)."""
    return NativeEngine(run_model or (lambda fn: fn(model)), d)


def start_recording(settings, model: nn.Module, peft: nn.Module | None, longest_prompt: int,
                    d: Dist) -> NativeEngine:
    """The native engine of the generator process (--max-staleness) on its copy of the policy:
    its rollouts carry the log-prob of each sampled token, the behaviour policy's."""
    return NativeEngine(lambda fn: fn(model), d, record_logprobs=True)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inversion: the first token whose cumulative
    probability reaches (1 - u) * total, with `uniforms` u [B] in [0, 1) (Devroye 1986, ch. 2.1).

    1 - u lies in (0, 1], so a token of probability 0 is never chosen (not even the first one);
    scaling by the row's own total absorbs the cumsum's rounding. The cumsum is float64: in
    float32 each step rounds by ~6e-8 absolute, which over a 128k vocabulary moves ~0.5% of the
    probability mass (torch.multinomial accumulates in double on the CPU too). Returns [B] long.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = (1.0 - uniforms.double())[:, None] * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, target).squeeze(1).clamp(max=probs.shape[-1] - 1)  # [B]


@torch.no_grad()
def sample_responses(policy: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                     max_new_tokens: int, temperature: float, eos_token_ids: Sequence[int],
                     pad_token_id: int, generator: torch.Generator | None = None,
                     uniforms: torch.Tensor | None = None, all_done=None,
                     record_logprobs: bool = False) -> Rollout:
    """Sample up to `max_new_tokens` per prompt from softmax(logits / temperature), KV-cached.

    Plain ancestral sampling and nothing else: no top-k, top-p, repetition penalty or any of the
    model's `generation_config` defaults, because the log-probs used for the KL and the PPO ratio are
    those of softmax(logits / T) over the whole vocabulary; any other processor would make the
    sampled distribution differ from the one we score.

    Args:
        prompt_ids: [B, P] prompts, left-padded. prompt_mask: [B, P], 1 on real tokens.
        eos_token_ids: ids that end a response (the EOS token is kept as its last token).
        generator: a torch.Generator, for reproducible samples (used when `uniforms` is None).
        uniforms: [B, max_new_tokens] in [0, 1), row b's noise for each step (`sampling_uniforms`):
            a row's tokens depend on its own noise only, not on the batch it is sampled in, so
            any split of a global batch (ranks, chunks) samples what the whole batch would.
        all_done: `alive [B] -> bool`, whether sampling may stop (default: no row is alive);
            under FSDP2 every rank must run the same number of steps, so it is a global "any".
        record_logprobs: also return each sampled token's log-prob, log softmax(z / T)[y], as
            `engine_logprobs` (0 after a row's end): the behaviour policy's, when this model is a
            copy sampling ahead of the trainer.
    """
    batch = prompt_ids.shape[0]
    device = prompt_ids.device
    uniforms = sampling_noise(uniforms, generator, batch, max_new_tokens, temperature).to(device)
    all_done = all_done or (lambda alive: not bool(alive.any()))
    attention_mask = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    logits, cache = prefill(policy, prompt_ids, attention_mask, position_ids)
    decoder = ModelForward(policy, cache, attention_mask, position_ids[:, -1:] + 1)
    eos = torch.tensor(list(eos_token_ids), device=device, dtype=torch.long)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    tokens, masks, logprobs = [], [], []
    for step in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
        token = inverse_cdf_sample(probs, uniforms[:, step])
        token = torch.where(alive, token, torch.full_like(token, pad_token_id))
        if record_logprobs:  # from the logits, not log(probs): exact for tiny probabilities
            scaled = logits.float() / temperature
            picked = scaled.gather(1, token[:, None]).squeeze(1) - scaled.logsumexp(dim=-1)
            logprobs.append(torch.where(alive, picked, 0.0))
        tokens.append(token)
        masks.append(alive)
        alive = alive & ~torch.isin(token, eos)
        if step == max_new_tokens - 1 or all_done(alive):
            break
        logits = decoder.step(token, alive)  # [B, V] for the next token
    responses = torch.stack(tokens, dim=1)  # [B, R]
    response_mask = torch.stack(masks, dim=1)  # [B, R]
    ended = torch.isin(responses, eos).any(dim=1)
    return Rollout.from_parts(prompt_ids, prompt_mask, responses, response_mask, ended, temperature,
                              engine_logprobs=torch.stack(logprobs, dim=1) if record_logprobs
                              else None)


def prefill(model: nn.Module, prompt_ids: torch.Tensor, attention_mask: torch.Tensor,
            position_ids: torch.Tensor, dedupe: bool = True):
    """The model on the prompts [B, P]: (logits at the last column [B, V], transformers' cache).

    With `dedupe`, identical rows (GRPO/RLOO put each prompt k times in a batch) are run once and
    their logits and cache copied to every row that repeats them: the same numbers to float
    rounding (a smaller batch may take another matmul kernel), k times less prompt compute.
    """
    # read through the module: switching prompt sharing off there (a test, bench/peers/grpo.py
    # --unshared) switches it off here too
    groups = (shared_prompt.prompt_groups(prompt_ids, attention_mask, prompt_ids.shape[1])
              if dedupe else None)
    if groups is not None:
        first, inverse = groups.first, groups.inverse
        logits, cache = prefill(model, prompt_ids[first], attention_mask[first],
                                position_ids[first], dedupe=False)
        if hasattr(cache, "batch_select_indices"):  # not on legacy tuple caches
            cache.batch_select_indices(inverse)  # [B_unique, ...] -> [B, ...]
            return logits[inverse], cache
    out = model(input_ids=prompt_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], output_cache(out)


class ModelForward:
    """One model forward per token, the cache grown by transformers (any model, any wrapper):
    `step(token [B], alive [B]) -> logits [B, V]` for the token after `token`."""

    def __init__(self, model: nn.Module, cache, attention_mask: torch.Tensor,
                 next_position: torch.Tensor):
        self.model, self.cache, self.cache_kw = model, cache, cache_name(model)
        self.attention_mask = attention_mask  # [B, L] long
        self.next_position = next_position  # [B, 1]

    def step(self, token: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        # Finished rows keep feeding pads with attention 0: their outputs are ignored.
        self.attention_mask = torch.cat([self.attention_mask, alive[:, None].long()], dim=1)
        out = self.model(input_ids=token[:, None], attention_mask=self.attention_mask,
                         position_ids=self.next_position, use_cache=True,
                         **{self.cache_kw: self.cache})
        self.cache = output_cache(out)
        self.next_position = self.next_position + 1
        return out.logits[:, -1]

