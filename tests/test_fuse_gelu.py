"""tether.activations' tanh GELU and models.fuse_gelu: the same function as the formula, in value
and gradient, on any input; the swap changes no model's outputs; it touches only tanh GELUs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM
from transformers import activations as hf

from tether.models import activations
from tether.models.activations import TanhGELU, gelu_tanh
from tether.models.prepare import fuse_gelu

EPS32 = 2.0**-23  # one fp32 ulp at 1


def formula64(x: torch.Tensor) -> torch.Tensor:
    """The truth: Hendrycks & Gimpel's tanh GELU, evaluated in float64 (absolute error < 1e-15;
    relative precision is lost below x ~ -5, where 1 + tanh cancels even in float64)."""
    x = x.double()
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def truth(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 value and d(sum(grad_out * gelu(x)))/dx, the latter by autograd of `formula64`."""
    x64 = x.detach().double().requires_grad_(True)
    y64 = formula64(x64)
    (dx64,) = torch.autograd.grad(y64, x64, grad_out.double())
    return y64.detach(), dx64


def ours(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and gradient through `gelu_tanh`, checking that its own autograd Function ran."""
    leaf = x.detach().clone().requires_grad_(True)
    y = gelu_tanh(leaf)
    assert type(y.grad_fn).__name__ == "_GeluTanhFunctionBackward"  # not torch's kernel
    (dx,) = torch.autograd.grad(y, leaf, grad_out)
    return y.detach(), dx


@pytest.fixture
def many_pieces(monkeypatch):
    """Pieces of 1000 elements, so that inputs run over many pieces and a ragged last one."""
    monkeypatch.setattr(activations, "CHUNK_ELEMENTS", 1000)


def grid() -> torch.Tensor:
    """[-20, 20] in steps of 1e-4 (both zeros included); 2^u overflows below x = -10.06."""
    return torch.cat([torch.linspace(-20.0, 20.0, 400_001), torch.tensor([-0.0, 0.0])])


def test_values_equal_the_float64_formula_to_a_few_ulps(many_pieces):
    x = grid()
    y, _ = ours(x, torch.ones_like(x))
    ref, _ = truth(x, torch.ones_like(x))
    err = (y.double() - ref).abs()
    # Measured: <= 6 ulps of the value (torch's own kernel: ~400, from 1 + tanh cancelling for
    # x < 0), and < 1e-9 absolute where the value is below 1e-3.
    assert (err <= 8 * EPS32 * ref.abs() + 1e-9).all(), err.max()
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


def test_gradients_equal_the_float64_formula(many_pieces):
    x = grid()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    _, dx = ours(x, grad_out)
    _, ref = truth(x, grad_out)
    # gelu' is O(1) and crosses 0 at x ~ -0.75; measured max error 2e-7 x |grad_out| (torch's
    # gelu_backward: 1e-6). 1 - s is taken as 2^u s, so there is no loss where s rounds to 1.
    assert ((dx.double() - ref).abs() <= 4e-7 * grad_out.abs().double()).all()
    assert torch.isfinite(dx).all()


def test_signed_zeros_and_the_extremes():
    x = torch.tensor([-0.0, 0.0, 20.0, -20.0, 1e4, -1e4, 1e30, -1e30, math.inf]).repeat(1000)
    y, dx = ours(x, torch.ones_like(x))
    assert torch.equal(torch.signbit(y[:2]), torch.tensor([True, False]))  # gelu(-0) = -0
    assert torch.equal(y, F.gelu(x, approximate="tanh"))  # x, or -0 far below 0; inf -> inf
    assert torch.equal(dx[:2], torch.tensor([0.5, 0.5]))
    assert torch.equal(dx[2::2][:4], torch.ones(4))  # 20, 1e4, 1e30, inf (torch's: nan): 1
    assert (dx[3:8:2].abs() < 1e-18).all()  # -20, -1e4, -1e30: ~0, no inf * 0
    nan_in = torch.full((10_000,), math.nan)
    assert torch.isnan(gelu_tanh(nan_in)).all()


VIEWS = {"transposed": lambda t: t.t(), "strided": lambda t: t[:, ::3],
         "expanded": lambda t: t[:1].expand(64, 600)}


@pytest.mark.parametrize("pieces", [1000, None], ids=["many_pieces", "one_piece"])
@pytest.mark.parametrize("layout", list(VIEWS))
def test_non_contiguous_inputs(layout, pieces, monkeypatch):
    """A view of a leaf goes in as it is; its gradient reaches the leaf through autograd (summed
    over the expansion in the expanded case), against the same view of a float64 leaf."""
    if pieces:
        monkeypatch.setattr(activations, "CHUNK_ELEMENTS", pieces)
    view = VIEWS[layout]
    base = torch.randn(64, 600, generator=torch.Generator().manual_seed(1)) * 4
    leaf = base.clone().requires_grad_(True)
    x = view(leaf)
    assert not x.is_contiguous()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    y = gelu_tanh(x)
    assert type(y.grad_fn).__name__ == "_GeluTanhFunctionBackward"
    (dleaf,) = torch.autograd.grad(y, leaf, grad_out)
    leaf64 = base.double().requires_grad_(True)
    ref = formula64(view(leaf64))
    (ref_dleaf,) = torch.autograd.grad(ref, leaf64, grad_out.double())
    # The gradient bound of the contiguous test, 4e-7 |grad_out|, summed as the gradient is.
    zeros = torch.zeros_like(base, dtype=torch.float64).requires_grad_(True)
    (abs_sum,) = torch.autograd.grad((view(zeros) * grad_out.abs()).sum(), zeros)
    assert y.shape == x.shape
    assert ((y.double() - ref.detach()).abs() <= 8 * EPS32 * ref.detach().abs() + 1e-9).all()
    assert ((dleaf.double() - ref_dleaf).abs() <= 4e-7 * abs_sum).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_fp32_and_returned_in_its_dtype(dtype, many_pieces):
    x32 = torch.randn(20_000, generator=torch.Generator().manual_seed(4)) * 5
    x = x32.to(dtype)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    y, dx = ours(x, grad_out)
    assert y.dtype == dx.dtype == dtype
    ref, ref_dx = truth(x, grad_out)  # the truth at the rounded inputs
    # fp32 maths (errors as in the fp32 tests) rounded once to the half type: within one ulp of
    # the truth, as torch's own half kernel (which also computes in fp32) lands. An absolute
    # floor: fp16's subnormal spacing (6e-8), or 1e-12 for bf16, since below x ~ -5 the float64
    # formula itself loses its relative precision (1 + tanh cancels).
    eps = torch.finfo(dtype).eps
    smallest = max(1e-12, torch.finfo(dtype).tiny * eps)
    assert ((y.double() - ref).abs() <= eps * ref.abs() + smallest).all()
    fp32_error = 4e-7 * grad_out.abs().double()
    assert ((dx.double() - ref_dx).abs() <= eps * ref_dx.abs() + fp32_error + smallest).all()
    native = F.gelu(x, approximate="tanh").double()  # itself off by up to 1.5e-7 (1 + tanh)
    assert ((y.double() - native).abs() <= eps * native.abs() + 2e-7).all()


def test_torch_kernel_for_float64_and_other_devices_only():
    """Device and dtype decide, never size: a tensor of 3 elements takes the exp2 form too."""
    x64 = torch.randn(20_000, dtype=torch.float64, requires_grad=True)
    assert type(gelu_tanh(x64).grad_fn).__name__ == "GeluBackward0"
    meta = torch.empty(20_000, device="meta")  # not the CPU: no CPU-only constant may be reached
    assert gelu_tanh(meta).device.type == "meta"
    tiny = torch.tensor([-1.5, 0.25, 3.0], requires_grad=True)
    assert type(gelu_tanh(tiny).grad_fn).__name__ == "_GeluTanhFunctionBackward"
    big = torch.randn(20_000, generator=torch.Generator().manual_seed(9))
    assert not torch.equal(gelu_tanh(big), F.gelu(big, approximate="tanh"))  # the exp2 form ran


@pytest.mark.parametrize("pieces", [1000, None], ids=["many_pieces", "one_piece"])
def test_values_do_not_depend_on_grad_mode_or_batch_size(pieces, monkeypatch):
    """Bitwise: tether's exact first epoch (ratio 1) scores a batch without a graph and updates
    on micro-batches with one, so the activation must give each element the same value either way
    (a size threshold for torch's kernel once broke tests/test_ppo.py's ratio-one test)."""
    if pieces:
        monkeypatch.setattr(activations, "CHUNK_ELEMENTS", pieces)
    x = torch.randn(12, 7, 256, generator=torch.Generator().manual_seed(6)) * 3  # [B, T, 4d]
    with torch.no_grad():
        whole = gelu_tanh(x)
    assert whole.grad_fn is None
    for micro in (x[:1], x[1:5], x[5:]):
        with_graph = gelu_tanh(micro.clone().requires_grad_(True))
        start = {1: 0, 4: 1, 7: 5}[micro.shape[0]]
        assert torch.equal(with_graph.detach(), whole[start:start + micro.shape[0]])


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
        assert type(model[name][0]) is TanhGELU, name
    for name, act in OTHERS.items():
        assert model[name][0] is act, name
    # ... and each swapped class is the same function (the erf GELU differs by ~1e-3).
    x = torch.linspace(-10, 10, 20_001)
    for name, act in TANH_GELUS.items():
        torch.testing.assert_close(act(x), gelu_tanh(x), rtol=0, atol=1e-6, msg=name)
    assert (OTHERS["gelu_erf"](x) - gelu_tanh(x)).abs().max() > 1e-4


def model_outputs(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(tokens, labels=tokens)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_fused_model_gives_the_same_logits_and_gradients(fixture, request, monkeypatch):
    monkeypatch.setattr(activations, "CHUNK_ELEMENTS", 3000)
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 24),
                           generator=torch.Generator().manual_seed(7))
    before = model_outputs(model, tokens)
    n_tanh = sum(type(m) in (hf.NewGELUActivation, hf.GELUTanh) for m in model.modules())
    fuse_gelu(model)
    assert sum(type(m) is TanhGELU for m in model.modules()) == n_tanh
    assert n_tanh == (model.config.n_layer if fixture == "tiny_model_dir" else 0)  # Llama: SiLU
    after = model_outputs(model, tokens)
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-5)
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=1e-5,
                                   atol=1e-5 * grad.abs().max().item())


def test_fused_gpt2_under_bf16_autocast_matches_the_unfused(tiny_model_dir):
    """Mixed precision: the MLP's matmul gives bf16, so the activation runs its bf16 path."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 24),
                           generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = model_outputs(model, tokens)
        fuse_gelu(model)
        seen = []
        for module in model.modules():
            if type(module) is TanhGELU:
                module.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        after = model_outputs(model, tokens)
    assert seen and set(seen) == {torch.bfloat16}
    scale = before[0].abs().max().item()
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0.02 * scale)
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=0,
                                   atol=0.02 * grad.abs().max().item())
