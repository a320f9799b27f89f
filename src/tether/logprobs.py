"""Log-probabilities and entropies from logits, without a second [B, T, V] tensor.

Notation: B batch, T positions, V vocabulary; `logits` is [..., V] (usually [B, T, V]) and
`tokens` is [...] (usually [B, T]). T_s is the sampling temperature.

The textbook code takes `log_softmax(logits / T_s)` and gathers the sampled tokens. That builds
two full copies of the logits (the division and the log-softmax), each as large as the logits
themselves: 0.5 GB at B=8, T=512, V=32000 in fp32. Here the work goes over chunks of positions, so
the extra memory is one [chunk, V] block, and a custom backward rebuilds the softmax chunk by
chunk instead of keeping it. Everything is computed in fp32, so bf16 logits give fp32-accurate
log-probs.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from tether.choices import positive

# Rows of [V] logits processed at once: 2^22 fp32 elements = 16 MiB of scratch per chunk.
CHUNK_ELEMENTS = 1 << 22


def chunk_slices(total: int, across: int) -> list[slice]:
    """Chunks of `total` rows (or vocabulary entries), each with ~CHUNK_ELEMENTS values `across`
    the other dimension (read at call time; `tether.lm_head` keeps its own copy of the rule)."""
    step = max(1, CHUNK_ELEMENTS // max(1, across))
    return [slice(start, min(start + step, total)) for start in range(0, total, step)]


def scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """chunk / T in fp32, without a copy when it is already fp32 and T = 1 (`tether.lm_head`
    then works in place on a fresh fp32 matmul output)."""
    chunk = chunk.float()
    return chunk if temperature == 1.0 else chunk / temperature


class _TokenLogprobs(torch.autograd.Function):
    """log p(token) = log_softmax(x)[token], x = logits / T_s, over row chunks.

    Backward: d log p / d logits = (onehot(token) - softmax(x)) / T_s, rebuilt chunk by chunk,
    so nothing of size [N, V] is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        flat_tokens = tokens.reshape(-1)  # [N]
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for rows in chunk_slices(flat.shape[0], flat.shape[-1]):
            x = scaled(flat[rows], temperature)  # [chunk, V]
            # log_softmax is one fused kernel; logsumexp runs as several passes on CPU and was
            # 3x slower here (docs/benchmarks.md).
            log_p = torch.log_softmax(x, dim=-1)  # [chunk, V] scratch
            out[rows] = log_p.gather(-1, flat_tokens[rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature = temperature
        return out.reshape(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens = ctx.saved_tensors
        temperature = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])
        flat_tokens = tokens.reshape(-1)
        flat_grad = grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        for rows in chunk_slices(flat.shape[0], flat.shape[-1]):
            g = flat_grad[rows, None]
            # One [chunk, V] buffer: softmax (a fused kernel, 2x faster here than exp(x - lse)),
            # then in place: times -g, plus g at the token, divided by T.
            chunk_grad = torch.softmax(scaled(flat[rows], temperature), dim=-1)
            chunk_grad.mul_(-g).scatter_add_(-1, flat_tokens[rows, None], g)
            if temperature != 1.0:
                chunk_grad.div_(temperature)
            grad[rows] = chunk_grad
        return grad.reshape(logits.shape), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under softmax(logits / temperature).

    log pi(y_t) = logits[y_t] / T_s - logsumexp(logits / T_s)

    Args:
        logits: [..., V], any float dtype (bf16 is upcast per chunk, so results are fp32-accurate).
        tokens: [...] integer ids, same leading shape as `logits`.
        temperature: T_s > 0, the temperature the tokens were sampled at; policy, old policy and
            reference must all use it, or the KL between them is wrong (docs/design.md, pitfalls).

    Returns:
        [...] fp32 log-probs, differentiable with respect to `logits`.
    """
    positive("temperature", temperature)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)} needs tokens of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise ValueError(f"token ids must lie in [0, {logits.shape[-1]}), the logits' vocabulary")
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature))


def map_row_chunks(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """Apply `fn` to matching chunks of rows of [..., V] tensors and join the [chunk] results.

    With autograd on, each chunk is recomputed in backward (activation checkpointing), so the
    saved state stays the inputs, never a [N, V] intermediate per chunk.
    """
    vocab = tensors[0].shape[-1]
    lead = tensors[0].shape[:-1]
    flats = [t.reshape(-1, vocab) for t in tensors]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    run = functools.partial(checkpoint, fn, use_reentrant=False) if grad else fn
    parts = [run(*[f[rows] for f in flats]) for rows in chunk_slices(flats[0].shape[0], vocab)]
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=tensors[0].device)
    return torch.cat(parts).reshape(lead)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position.

    H = logsumexp(x) - sum_v softmax(x)_v * x_v,  x = logits / T_s

    Args:
        logits: [..., V].
        temperature: T_s > 0.

    Returns:
        [...] fp32 entropies in nats.
    """
    positive("temperature", temperature)
    return map_row_chunks(lambda rows: entropy_rows(rows, temperature), logits)


def entropy_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`entropy`'s formula on rows taken whole, [N, V] -> [N] fp32: for callers that chunk the
    rows themselves (`entropy`; `tether.lm_head.head_entropy`, whose chunks come from the head)."""
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    return lse - (torch.softmax(x, dim=-1) * x).sum(-1)
