"""The tanh-approximate GELU (GPT-2's activation), fast on the CPU, forward and backward.

Hendrycks & Gimpel 2016 (arXiv:1606.08415, sec. 2), with c = sqrt(2/pi):

    gelu(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
            = x sigmoid(w),       w = 2c (x + 0.044715 x^3)   since 0.5 (1 + tanh z) = sigmoid(2z)
            = x / (1 + 2^u),      u = -log2(e) w              since sigmoid(w) = 1 / (1 + e^-w)

    d gelu / dx = s + x w' s (1 - s),   s = sigmoid(w),  w' = 2c (1 + 3 * 0.044715 x^2)
                = s (1 + x w' (1 - s)),  with 1 - s = 2^u s

Why not torch's own kernel on the CPU: torch 2.13's CPU `tanh` (and so `F.gelu(approximate="tanh")`
and its backward) runs at ~3.5 ns an element with one thread, while `exp2` runs at ~0.6 ns. The
forms above take one `exp2` and a few multiply-adds: 5 passes over memory forward, 11 backward,
against torch's one (bench/gelu.py, 1 thread, [1344, 1024] fp32: forward 2.1-2.6x faster, forward
+ backward 1.5-1.6x; the backward alone gains least, and less when other processes contend for
memory bandwidth). Large tensors go in pieces that stay in cache (`_piecewise`). They are the same
function to fp32 rounding: max abs error against a float64 reference 5e-7 (<= 6 ulps of the value)
forward and 2e-7 backward, where torch's own kernel has 4e-7 (400 ulps for x < 0, where 1 + tanh
cancels) and 1e-6; `1 - s` is taken as 2^u s, not by subtraction, so the backward keeps full
precision where s rounds to 1.

Only x is saved for the backward pass (as torch's kernel does): s is recomputed there, so a model's
activation memory is unchanged. CUDA and every other device get torch's fused kernel, as does
float64. bfloat16/float16 inputs are computed in fp32 and returned in their own dtype, as torch's
CPU kernel does internally.

Which form runs never depends on a tensor's size or on whether autograd records the call: tether's
first PPO epoch is exactly on-policy (ratio 1) because scoring without a graph and the update's
forward with one, in micro-batches of another size, give bitwise the same log-probs. A size
threshold (torch's kernel for small tensors, where the extra launches cost more) broke that, so
small tensors pay ~10 us a call, and ~100 us under autograd (autograd.Function's Python): a
tiny-model cost, break-even near 32768 elements with a graph, 6000 without. As for torch's own
kernels, bitwise holds where rows are a multiple of 32 elements wide (any real model's MLP) and
torch runs one thread: its loops compute the last (size mod 16 or 32) elements of each thread's
share with scalar code, and several threads split a tensor at size-dependent points.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715
_LOG2_E = 1.0 / math.log(2.0)
# u = x (_U0 + _U2 x^2): the exponent of 2 in gelu(x) = x / (1 + 2^u).
_U0 = -2.0 * _SQRT_2_OVER_PI * _LOG2_E
_U2 = _U0 * _CUBIC
# addcmul takes its constant term as a tensor; fp32 on the CPU whatever torch's defaults are.
_U0_TENSOR = torch.tensor(_U0, dtype=torch.float32, device="cpu")
# x w' = _XW_SCALE (x + _XW_FROM_U u): x w' from x and u in one kernel, without recomputing x^2.
_XW_FROM_U = 3.0 / (2.0 * _SQRT_2_OVER_PI * 2.0 * _LOG2_E)
_XW_SCALE = -4.0 * _SQRT_2_OVER_PI
# The backward clamps x to +-8, where s (or 1 - s) is below 4e-22: gelu' is then exactly 1 in fp32
# above, and below -8 it is -5e-20 instead of ~0. Unclamped, 2^u overflows below x = -10.06 (inf *
# 0 = nan), x w' overflows beyond |x| = 1.5e13, and products fall into slow denormals.
_X_CLAMP = 8.0
# Elements per piece in `_piecewise`: 1 MiB of fp32 per tensor, so that the backward's working set
# (x, grad, the output and three temporaries) stays in cache while its 11 kernels pass over it.
# Measured with a cold cache on [1344, 1024]: 2^18 a little faster than 2^17 or 2^19, 2^15 slower.
# Read at call time, so tests can shrink it to force many pieces.
CHUNK_ELEMENTS = 1 << 18


def gelu_tanh_forward(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x) = x / (1 + 2^u), u = x (_U0 + _U2 x^2), computed in x's dtype (fp32 on the CPU).

    Five kernels on one temporary, reused as the output. No overflow trouble at large |x|: above
    x = 4.96, 1 + 2^u rounds to 1 and the result is x; below x = -10.06, 2^u = inf and the result
    is -0, as torch's kernel gives (infinite x too: inf -> inf, -inf -> nan, as there).

    Args:
        x: any shape, float32.
    Returns:
        gelu(x), x's shape and dtype.
    """
    denominator = torch.addcmul(_U0_TENSOR, x, x, value=_U2, out=out)  # _U0 + _U2 x^2
    denominator.mul_(x).exp2_().add_(1.0)  # 1 + 2^u
    return torch.div(x, denominator, out=denominator)


def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / dx = grad * s (1 + x w' (1 - s)), s = 1 / (1 + 2^u), 1 - s = 2^u s (module doc),
    with x clamped to +-8 first (see _X_CLAMP): no inf or nan for any finite or infinite x.

    Args:
        grad: d loss / d gelu(x), broadcastable to x (autograd may pass an expanded tensor).
        x: the forward's input, float32.
    Returns:
        d loss / dx, x's shape, float32.
    """
    x = x.clamp(-_X_CLAMP, _X_CLAMP)
    u = torch.addcmul(_U0_TENSOR, x, x, value=_U2).mul_(x)
    x_dw = torch.add(x, u, alpha=_XW_FROM_U)  # x w' / _XW_SCALE
    two_u = u.exp2_()
    s = torch.add(two_u, 1.0, out=x).reciprocal_()  # x (the clamped copy) is done with
    one_minus_s = two_u.mul_(s)
    x_dw.mul_(one_minus_s)
    grad_s = s.mul_(grad)
    return torch.addcmul(grad_s, grad_s, x_dw, value=_XW_SCALE, out=x_dw if out is None else out)


def _piecewise(kernel, *tensors: torch.Tensor) -> torch.Tensor:
    """kernel(*pieces, out=) over flat pieces of CHUNK_ELEMENTS, so that its temporaries stay in
    cache and are not fresh pages (a tensor of many MiB costs a page fault per 4 KiB); a new
    output of the last tensor's shape and dtype (contiguous when cut into pieces). bf16/fp16
    pieces are computed in fp32.

    Args:
        kernel: gelu_tanh_forward or gelu_tanh_backward.
        tensors: same shape (a non-contiguous one is copied once by reshape).
    """
    if tensors[-1].numel() <= CHUNK_ELEMENTS and all(t.dtype == torch.float32 for t in tensors):
        return kernel(*tensors)  # one piece: skip the ~30 us of Python below (a decode step)
    # Pieces of a multiple of 64 elements: torch's elementwise loops run 2 SIMD vectors (<= 32
    # floats) at a time and the scalar code on the remainder, whose exp2 may round differently;
    # aligned pieces put every element on the path it takes without pieces (module doc: bitwise).
    step = max(64, CHUNK_ELEMENTS - CHUNK_ELEMENTS % 64)
    flats = [tensor.reshape(-1) for tensor in tensors]
    out = torch.empty_like(flats[-1])
    in_place = out.dtype == torch.float32
    for start in range(0, out.numel(), step):
        piece = slice(start, start + step)
        pieces = [flat[piece].float() for flat in flats]  # .float() is a no-op on fp32
        if in_place:
            kernel(*pieces, out=out[piece])
        else:
            out[piece].copy_(kernel(*pieces))
    return out.view(tensors[-1].shape)


class _GeluTanhFunction(torch.autograd.Function):
    """Autograd for the CPU path: saves x alone and recomputes s in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _piecewise(gelu_tanh_forward, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return _piecewise(gelu_tanh_backward, grad.expand_as(x), x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), elementwise; x's shape and dtype.

    Decided per call by x's device and dtype, never its size (module doc): the exp2 form on CPU
    tensors of float32, bfloat16 or float16; torch's fused `F.gelu(approximate="tanh")` otherwise
    (one kernel on CUDA, fast there)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return F.gelu(x, approximate="tanh")
    if torch.is_grad_enabled() and x.requires_grad:
        return _GeluTanhFunction.apply(x)
    return _piecewise(gelu_tanh_forward, x)  # no graph: skip autograd.Function's overhead


class TanhGELU(nn.Module):
    """`nn.GELU(approximate="tanh")`, the same function, faster on the CPU (`gelu_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x)

    def extra_repr(self) -> str:
        return "approximate='tanh'"
