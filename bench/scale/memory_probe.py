"""What a benchmark run really did, observed from outside the trainer (for bench/scale/memory.py, bench/scale/gpu.py).

A config field such as `lora_r` or `chunked_lm_head` says what the user asked for; a benchmark
must not report a number for a feature the code under test silently ignored. `Probe` watches
one training run through public hooks only, so it works on any trainer (tether or TRL) and on
tether before and after the scale features land:

- resident parameters: at the first forward pass with autograd on (the first update step,
  when every model of the run is loaded), every live `nn.Module` is found with `gc` and its
  parameters are counted once per storage. `base_copies` = resident parameter bytes / bytes of
  one base model: 4 for policy + reference + reward model + critic as separate networks, about 1
  when all four share one frozen base. `trainable_params` counts parameters with requires_grad.
- LM-head outputs: a global forward hook records the largest output of any `nn.Linear` whose
  `out_features` is the vocabulary size, in rows of V. A plain head produces a [B, R, V] logits
  tensor (B * R rows at once); a chunked head either never calls the module or calls it on a few
  rows at a time.
- gradient checkpointing: `torch.utils.checkpoint.checkpoint` is wrapped (before transformers or
  tether is imported, so their `from torch.utils.checkpoint import checkpoint` binds the wrapper)
  and calls made with autograd on are counted when the checkpointed function belongs to an
  `nn.Module` that has children (a transformer block), as transformers' layer checkpointing does;
  tether's own per-chunk log-prob checkpoint passes a plain function and is not counted.
"""

from __future__ import annotations

import functools
import gc
import resource
import sys
import warnings

import torch
from torch import nn


def status_mib(field: str) -> float:
    """A `VmRSS` / `VmHWM` line of /proc/self/status in MiB (falls back to ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (ru_maxrss, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _owner_module(function) -> nn.Module | None:
    """The nn.Module a checkpointed callable runs, if any (a module, a bound method, a partial)."""
    candidates = [function]
    if isinstance(function, functools.partial):
        candidates += [function.func, *function.args]
    for c in candidates:
        if isinstance(c, nn.Module):
            return c
        owner = getattr(c, "__self__", None)
        if isinstance(owner, nn.Module):
            return owner
    return None


class NotMeasurable(Exception):
    """Raised from inside the run when `Probe.check` finds a requested feature inactive."""


class Probe:
    """Observe one run: parameters resident, LM-head output sizes, layer checkpoint calls.

    `check(report) -> str | None`, if given, runs once right after the census (the first
    update step, after rollout and scoring); a returned message aborts the run with
    NotMeasurable, so a configuration that cannot be measured costs no update phase.
    """

    def __init__(self, vocab_size: int, base_params: int, base_bytes_per_param: int = 4,
                 check=None):
        self.vocab_size = vocab_size
        self.base_bytes = base_params * base_bytes_per_param
        self.max_logit_rows = 0
        self.layer_checkpoint_calls = 0
        self.census: dict[str, float] | None = None
        self.check = check
        self._handle = None
        self._restore = None

    def reset(self, vocab_size: int, base_bytes: int) -> None:
        """Forget what was observed so far (e.g. a reward-model run before the PPO run)."""
        self.vocab_size, self.base_bytes = vocab_size, base_bytes
        self.max_logit_rows, self.layer_checkpoint_calls, self.census = 0, 0, None

    def install(self) -> Probe:
        """Wrap checkpoint and register the global forward hook; call before importing the
        trainer (see the module docstring)."""
        if "transformers" in sys.modules:
            print("warning: transformers was imported before Probe.install(); layer "
                  "checkpoint calls may go uncounted", file=sys.stderr)
        import torch.utils.checkpoint as ckpt

        original = ckpt.checkpoint

        @functools.wraps(original)
        def counting_checkpoint(function, *args, **kwargs):
            owner = _owner_module(function)
            if torch.is_grad_enabled() and owner is not None and any(True for _ in owner.children()):
                self.layer_checkpoint_calls += 1
            return original(function, *args, **kwargs)

        ckpt.checkpoint = counting_checkpoint
        self._restore = (ckpt, original)
        self._handle = nn.modules.module.register_module_forward_hook(self._forward_hook)
        return self

    def remove(self) -> None:
        """Unregister the hook and restore `torch.utils.checkpoint.checkpoint` (names already
        imported from it keep the counting wrapper, which only counts)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._restore is not None:
            module, original = self._restore
            module.checkpoint = original
            self._restore = None

    def _forward_hook(self, module, inputs, output) -> None:
        if isinstance(module, nn.Linear) and module.out_features == self.vocab_size:
            out = output if isinstance(output, torch.Tensor) else output[0]
            self.max_logit_rows = max(self.max_logit_rows, out.numel() // self.vocab_size)
        if self.census is None and torch.is_grad_enabled():
            self.census = parameter_census(self.base_bytes)
            problem = self.check(self.report()) if self.check is not None else None
            if problem:
                raise NotMeasurable(problem)

    def report(self) -> dict[str, float]:
        census = self.census or {"resident_param_mib": float("nan"), "base_copies": float("nan"),
                                 "trainable_params": float("nan")}
        return {**census, "max_logit_rows": self.max_logit_rows,
                "layer_checkpoint_calls": self.layer_checkpoint_calls}


def parameter_census(base_bytes: int, modules=None) -> dict[str, float]:
    """Parameters of `modules` (default: every live nn.Module), each storage counted once, so
    tied weights and a base shared between roles count once."""
    storages: dict[int, int] = {}
    trainable: dict[int, int] = {}
    if modules is None:
        with warnings.catch_warnings():  # isinstance on deprecated module proxies warns
            warnings.simplefilter("ignore")
            modules = [obj for obj in gc.get_objects() if isinstance(obj, nn.Module)]
    else:
        modules = [sub for module in modules for sub in module.modules()]
    for obj in modules:
        for p in obj.parameters(recurse=False):
            storage = p.untyped_storage()
            if storage.data_ptr() == 0:
                continue
            storages[storage.data_ptr()] = storage.nbytes()
            if p.requires_grad:
                trainable[id(p)] = p.numel()
    total = sum(storages.values())
    return {"resident_param_mib": total / 2**20, "base_copies": total / base_bytes,
            "trainable_params": float(sum(trainable.values()))}
