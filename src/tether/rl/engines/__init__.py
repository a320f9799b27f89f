"""Rollout engines: what samples a batch of responses in the layout of `tether.rl.rollout`.

    native        tether's own KV-cached sampler on the trainer's model (the default)
    vllm_engine   vLLM in the trainer's process, fed the trainer's weights in memory
    mismatch      how far the engine's log-probs are from the trainer's, and the corrections

Every engine's `sample` has `native.sample_responses`'s signature, so the loops, the held-out
evaluation and `tether generate` call whichever was chosen alike (`engine_sampler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn


@contextlib.contextmanager
def engine_sampler(engine: str, model: nn.Module, prompt_ids: Sequence[Sequence[int]],
                   max_new_tokens: int, *, kv_cache_mb: int, dtype: str, seed: int,
                   device: torch.device) -> Iterator[Callable]:
    """The `sample` of `engine` ("native" or "vllm") for a frozen `model` in one process (`tether
    generate`, `tether eval`); a vLLM engine is stopped on leaving."""
    from tether.rl.engines.native import sample_responses

    if engine != "vllm":
        yield sample_responses
        return
    from tether.rl.engines.vllm_engine import start_engine
    from tether.run.distributed import current

    vllm = start_engine(model, None, prompt_ids, max_new_tokens, kv_cache_mb=kv_cache_mb,
                        dtype=dtype, seed=seed, d=current(), device=device)
    try:
        yield vllm.sample
    finally:
        vllm.close()
