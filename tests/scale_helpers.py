"""Helpers for the memory-knob tests: a dropout-free copy of a tiny model, a counter of
transformer-layer calls, and weight comparison."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

# The MLP inside each transformer layer. transformers checkpoints a layer's `forward`, so the
# layer's own hooks fire once, but its children run again when the backward pass recomputes it.
LAYER_MLPS = ("GPT2MLP", "LlamaMLP")


def no_dropout_copy(src: Path, dst: Path) -> Path:
    """A copy of a saved tiny model with every dropout probability in its config set to 0, so a
    run's gradients depend only on the data (SFT keeps a model's dropout on)."""
    if not dst.exists():
        shutil.copytree(src, dst)
        config_path = dst / "config.json"
        config = json.loads(config_path.read_text())
        for key, value in config.items():
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
                config[key] = 0.0
        config_path.write_text(json.dumps(config))
    return dst


@contextlib.contextmanager
def layer_calls():
    """Record (rows, grad enabled) for every call of a transformer layer's MLP.

    A pre-hook, because the recompute of non-reentrant checkpointing stops as soon as it has
    rebuilt the tensors the backward needs, before the MLP returns (a forward hook can miss it).
    """
    calls: list[tuple[int, bool]] = []

    def hook(module, args):
        if type(module).__name__ in LAYER_MLPS:
            calls.append((args[0].shape[0], torch.is_grad_enabled()))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def layer_output_dtypes():
    """Record the output dtype of every transformer-layer MLP call (autocast shows here)."""
    dtypes: list[torch.dtype] = []

    def hook(module, args, output):
        if type(module).__name__ in LAYER_MLPS:
            dtypes.append(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield dtypes
    finally:
        handle.remove()


def weights(run_dir_or_model) -> dict[str, torch.Tensor]:
    """The tensors of a saved model directory (model.safetensors) or of a module's state dict."""
    if isinstance(run_dir_or_model, torch.nn.Module):
        return {k: v.detach().clone() for k, v in run_dir_or_model.state_dict().items()}
    return load_file(str(Path(run_dir_or_model) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")


def max_change(before: dict, after: dict) -> float:
    return max((after[k].float() - before[k].float()).abs().max().item() for k in before.keys() & after.keys())
