"""models.prepare.fuse_gelu: every tanh GELU of a model becomes torch's fused kernel, the same
function as the formula (checked against a float64 evaluation), and nothing else is touched; a
swapped model gives the same logits and gradients, also under bf16 autocast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM
from transformers import activations as hf

from tether.models.prepare import fuse_gelu


def formula64(x: torch.Tensor) -> torch.Tensor:
    """The truth: Hendrycks & Gimpel's tanh GELU, evaluated in float64."""
    x = x.double()
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def is_fused(module: nn.Module) -> bool:
    return type(module) is nn.GELU and module.approximate == "tanh"


TANH_GELUS = {
    "gelu_new": hf.NewGELUActivation(),
    "gelu_pytorch_tanh": hf.GELUTanh(),
    "gelu_python_tanh": hf.GELUTanh(use_gelu_tanh_python=True),
    "PytorchGELUTanh": hf.PytorchGELUTanh(),
    "gelu_fast": hf.FastGELUActivation(),
    "gelu_accurate": hf.AccurateGELUActivation(),
    "torch_gelu_tanh": nn.GELU(approximate="tanh"),
}
OTHERS = {
    "gelu_erf": hf.GELUActivation(),
    "torch_gelu_erf": nn.GELU(),
    "gelu_10": hf.ClippedGELUActivation(-10, 10),
    "quick_gelu": hf.QuickGELUActivation(),
    "silu": nn.SiLU(),
    "tanh": nn.Tanh(),
}


def test_fuse_gelu_swaps_every_tanh_gelu_and_nothing_else():
    everything = {**TANH_GELUS, **OTHERS}
    model = nn.ModuleDict({name: nn.Sequential(act) for name, act in everything.items()})
    fuse_gelu(model)
    for name in TANH_GELUS:
        assert is_fused(model[name][0]), name
    for name, act in OTHERS.items():
        assert model[name][0] is act, name
    # ... and each swapped class is the same function (the erf GELU differs by ~1e-3).
    x = torch.linspace(-10, 10, 20_001)
    fused = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(fused.double(), formula64(x), rtol=0, atol=1e-6)
    for name, act in TANH_GELUS.items():
        torch.testing.assert_close(act(x), fused, rtol=0, atol=1e-6, msg=name)
    assert (OTHERS["gelu_erf"](x) - fused).abs().max() > 1e-4


def model_outputs(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(tokens, labels=tokens)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_fused_model_gives_the_same_logits_and_gradients(fixture, request):
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 24),
                           generator=torch.Generator().manual_seed(7))
    before = model_outputs(model, tokens)
    n_tanh = sum(type(m) in (hf.NewGELUActivation, hf.GELUTanh) for m in model.modules())
    fuse_gelu(model)
    assert sum(is_fused(m) for m in model.modules()) == n_tanh
    assert n_tanh == (model.config.n_layer if fixture == "tiny_model_dir" else 0)  # Llama: SiLU
    after = model_outputs(model, tokens)
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-5)
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=1e-5,
                                   atol=1e-5 * grad.abs().max().item())


def test_fused_gpt2_under_bf16_autocast_matches_the_unfused(tiny_model_dir):
    """Mixed precision: the MLP's matmul gives bf16, so the fused activation runs in bf16."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 24),
                           generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = model_outputs(model, tokens)
        fuse_gelu(model)
        seen = []
        for module in model.modules():
            if is_fused(module):
                module.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        after = model_outputs(model, tokens)
    assert seen and set(seen) == {torch.bfloat16}
    scale = before[0].abs().max().item()
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0.02 * scale)
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=0,
                                   atol=0.02 * grad.abs().max().item())
