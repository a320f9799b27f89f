"""Rollout engines: what samples a batch of responses in the layout of `tether.rl.rollout`.

    native        tether's own KV-cached sampler on the trainer's model (the default)
    vllm_engine   vLLM in the trainer's process, fed the trainer's weights in memory
    vllm_private  every use of vLLM's non-public internals, behind one small module
    vllm_limits   what vLLM's settings need of the model (checked before it starts), and its
                  start-up errors in tether's words
    mismatch      how far the engine's log-probs are from the trainer's, and the corrections
    weights       the policy's weights as an engine is sent them (vLLM's, the generator's copy)

Every engine is a `RolloutEngine`; the online loop, the held-out evaluation, `tether eval` and
`tether generate` hold one and never ask which it is. `make_engine` reads the engine's name, the
one place that does, from the table of engines (`tether.choices.ENGINES`: how each starts, its
generator for --max-staleness, whether its log-probs are its own, its package, the options that
act only with it). A new engine (an HTTP server, SGLang) is one file with a class of the methods
below and a `start` function, plus one entry in that table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from tether.choices import ENGINES, entry
from tether.rl.engines.jobs import Background, Deferred, T
from tether.rl.rollout import Rollout
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


class EngineSettings(Protocol):
    """The config fields an engine starts from, named as in PPOConfig, GenerateConfig and
    EvalConfig (`mixed_precision` where the config has one)."""

    engine: str
    engine_kv_cache_mb: int
    max_new_tokens: int
    dtype: str
    seed: int


# How a native engine reaches the policy: `run_model(fn)` returns `fn(policy)`, called where the
# policy may run (inside the DDP/FSDP2 wrapper in training: `tether.rl.roles.Roles.generate`).
RunModel = Callable[[Callable[[nn.Module], Rollout]], Rollout]


def check_engine_settings(settings: EngineSettings, model_path: str, *, longest_prompt: int,
                          device: torch.device, trust_remote_code: bool = False) -> None:
    """Before any weights load: refuse engine settings the model cannot run with, from its
    config.json alone (the engine's `check` in `tether.choices.ENGINES`: vLLM's head size on CPU,
    its KV cache against one sequence of `longest_prompt` plus `max_new_tokens`). A path without a
    config.json (a LoRA adapter's directory) is checked when the engine starts instead."""
    check = entry(ENGINES, settings.engine, "engine").check
    if check is None:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return
    check(settings, config, longest_prompt, device)


def make_engine(settings: EngineSettings, model: nn.Module, *, longest_prompt: int, d: Dist,
                peft: nn.Module | None = None, run_model: RunModel | None = None) -> RolloutEngine:
    """The engine `settings.engine` names (`tether.choices.ENGINES`), ready to sample `model`.

    `longest_prompt`: the longest context the engine will be given (with `max_new_tokens`, an
    engine sizes its longest sequence from it). `peft`: the PeftModel holding the policy's
    adapter, when it trains one. `run_model`: how the native engine calls the policy (default:
    directly, for a frozen model)."""
    start = entry(ENGINES, settings.engine, "engine").start
    return start(settings, model, peft, longest_prompt, d, run_model)
