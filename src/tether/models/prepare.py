"""Getting a loaded model ready for its role: dropout off, frozen for scoring, torch's fused GELU,
gradient checkpointing, and a saved policy prepared for sampling.

RL and reward modelling compare log-probs and scores across forward passes, so dropout is off in
every role (InstructGPT and TRL do the same); a model tether only scores with (a reference, a
reward model) is frozen by one function, `freeze`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tether.errors import TetherError
from tether.models.pretrained import load_causal_lm


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0: modules, float attributes read in forward, and config.

    RL and reward modelling compare log-probs and scores across forward passes; dropout would make
    the same sequence look different each time (InstructGPT and TRL both switch it off).
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(config.to_dict().items()):
            if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
                setattr(config, name, 0.0)
    return model


def freeze(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """The one way tether freezes a model it only scores with (a reference, a reward model):
    dropout off, eval mode, no gradients, optionally moved to `device`; in place."""
    disable_dropout(model)
    model.eval().requires_grad_(False)
    return model if device is None else model.to(device)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy (see `freeze`); it shares no tensor with `model`."""
    return freeze(copy.deepcopy(model))


def fuse_gelu(model: nn.Module) -> nn.Module:
    """Swap every tanh-approximate GELU in `model` for torch's fused kernel,
    `nn.GELU(approximate="tanh")`: the same function, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
    x^3))) (Hendrycks & Gimpel 2016), in one kernel forward and one backward, where transformers'
    GPT-2 GELU ("gelu_new", `NewGELUActivation`) runs five elementwise kernels from Python: about
    10% of an rloo or grpo run on the CPU (docs/benchmarks.md), fewer launches on CUDA.

    Swapped: `NewGELUActivation`, `FastGELUActivation` ("gelu_fast", sqrt(2/pi) rounded to
    0.7978845608: 4e-12 relative, below fp32's rounding), `AccurateGELUActivation`
    ("gelu_accurate") and `GELUTanh` (alias `PytorchGELUTanh`; "gelu_pytorch_tanh", Gemma's,
    already torch's kernel unless its Python form was asked for). Never the erf GELU ("gelu"),
    the clipped or quick ones, or anything else."""
    from transformers import activations as hf

    tanh_gelus = (hf.NewGELUActivation, hf.GELUTanh, hf.FastGELUActivation,
                  hf.AccurateGELUActivation)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in tanh_gelus:
                setattr(module, name, nn.GELU(approximate="tanh"))
    return model


def enable_gradient_checkpointing(model: nn.Module, context_fn=None) -> nn.Module:
    """Recompute each transformer layer's activations in the backward pass (less memory).

    Works on a plain Hugging Face model, on tether's wrappers (`RewardModel`, `ValueModel`: their
    `backbone`) and on a peft `PeftModel` (its wrapped transformers model): the outermost
    `PreTrainedModel` inside `model` gets transformers' checkpointing, non-reentrant. Non-reentrant
    checkpointing needs no input that requires grad, so a frozen base with LoRA adapters still
    gets its adapter gradients (transformers adds an input-grad hook anyway; it is harmless).
    transformers checkpoints a layer only while the module is in training mode and grad is on.
    `context_fn` goes to `torch.utils.checkpoint` (LoRA roles on one base pass
    `tether.models.lora.adapter_recompute_context`, so a layer is recomputed under the adapter it
    ran with).
    """
    from transformers import PreTrainedModel

    trunk = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if trunk is None or not trunk.supports_gradient_checkpointing:
        name = type(trunk if trunk is not None else model).__name__
        raise TetherError(f"{name} does not support gradient checkpointing; drop "
                          "--gradient-checkpointing")
    kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
    if hasattr(trunk, "activation_checkpointing_enable"):  # transformers >= 5.2x: the new name
        trunk.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def load_frozen_lm(path: str, tokenizer, dtype: str, trust_remote_code: bool, device,
                   base: str = "") -> nn.Module:
    """A policy as PPO prepares it for sampling and scoring: a LoRA adapter directory merged into
    its base (`base` when given: --base), dropout off, GPT-2's GELU fused (same function),
    frozen, in eval mode."""
    model = load_causal_lm(path, tokenizer, dtype, trust_remote_code, base=base)
    return freeze(fuse_gelu(model), device)  # freeze switches dropout off

