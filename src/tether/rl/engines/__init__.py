"""Rollout engines: what samples a batch of responses in the layout of `tether.rl.rollout`.

    native        tether's own KV-cached sampler on the trainer's model (the default)
    vllm_engine   vLLM in the trainer's process, fed the trainer's weights in memory
    vllm_private  every use of vLLM's non-public internals, behind one small module
    vllm_limits   what vLLM's settings need of the model (checked before it starts), and its
                  start-up errors in tether's words
    mismatch      how far the engine's log-probs are from the trainer's, and the corrections
    weights       the policy's weights as an engine is sent them (vLLM's, the generator's copy)

Every engine is a `RolloutEngine` (the interface, with the defaults of an engine that samples
only when asked: `native.py`, beside the engine that is exactly that); the online loop, the held-out evaluation, `tether eval` and
`tether generate` hold one and never ask which it is. `make_engine` reads the engine's name, the
one place that does, from the table of engines (`tether.choices.ENGINES`: how each starts, its
generator for --max-staleness, whether its log-probs are its own, its package, the options that
act only with it). A new engine (an HTTP server, SGLang) is one file with a class of the methods
below and a `start` function, plus one entry in that table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from tether.choices import ENGINES, entry
from tether.rl.engines.native import RolloutEngine
from tether.rl.rollout import Rollout
from tether.run.distributed import Dist


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
