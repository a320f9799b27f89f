"""Log-probs, entropy and exact KL from final hidden states through the LM head, chunk by chunk.

Notation: N positions (B * R flattened), d hidden size, V vocabulary, T_s sampling temperature.
h [N, d] the final (normed) hidden states, W [V, d] and b [V] the head, y [N] the tokens,

    x = (h W^T + b) / T_s                      the logits, [N, V]
    log p(y) = x_y - logsumexp(x)              per position, as tether.logprobs.token_logprobs

The logits of a training batch are the largest tensor in the update: at B=8, R=1024, V=128256 they
take 4 GiB in fp32, and the plain path keeps them for the backward pass and builds a gradient of
the same size. Here no [N, V] tensor ever exists. An nn.Linear head goes over chunks of the
vocabulary, all positions at once (~16 MiB of fp32 logits a chunk, [N, V_c]), keeping a running
logsumexp per position; chunks of the vocabulary rather than of positions, because a chunk of 32
positions at V=128256 makes a matmul that streams all of W for little work (3x slower on CPU).

Backward, with g = d loss / d log p(y) [N]:

    d log p(y) / d x = onehot(y) - p,  p = softmax(x)
    G = g (onehot(y) - p) / T_s        [N, V], one chunk at a time
    dh = G W,   dW = G^T h,   db = sum_n G_n

Two exact ways to get there, picked by what needs a gradient:
- head frozen (LoRA elsewhere, or the reference): dh_n = g_n * a_n with a = (onehot(y) - p) W / T_s
  [N, d], which does not depend on g, so the forward pass accumulates it while each chunk's logits
  are at hand. Backward is a multiplication: 2 matmuls of [N, d] x [d, V] in all, as the plain path.
- head trainable (full fine-tuning, tied embeddings): the forward keeps only lse = logsumexp(x)
  [N]; the backward recomputes each vocabulary chunk's logits (p = exp(x - lse)) and takes dh,
  dW and db from it. 4 matmuls against the plain path's 3: exactness costs one recompute.
Any other head module (a peft LoRA-wrapped lm_head, a head with a logit transform) goes through
`torch.utils.checkpoint` per chunk of positions: chunked, exact, gradients reach every parameter.
Splitting a model into trunk and head, and the forwards that use it: `tether.models.trunk_head`.
Everything runs in fp32 after the matmul; under autocast the matmuls run in bf16, as in the plain path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tether import kl as kl_lib
from tether import logprobs as logprobs_lib
from tether.choices import positive

# Logit elements per chunk: 2^22 fp32 = 16 MiB, the scratch size of tether.logprobs. Read at call
# time, so tests can shrink it to force many chunks.
CHUNK_ELEMENTS = 1 << 22


def _slices(total: int, across: int) -> list[slice]:
    """Chunks of `total` rows (or vocabulary entries), each with ~CHUNK_ELEMENTS logits `across`
    the other dimension: tether.logprobs.chunk_slices' rule, and `_scaled` its `scaled`, kept
    here so that a batch through the LM head reads one file, not two (tests/audit/online_path)."""
    step = max(1, CHUNK_ELEMENTS // max(1, across))
    return [slice(start, min(start + step, total)) for start in range(0, total, step)]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T_s in fp32; a fresh fp32 matmul output is used in place when T_s = 1."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _token_hits(tokens: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns within the chunk) of the positions whose token lies in `cols`."""
    rows = ((tokens >= cols.start) & (tokens < cols.stop)).nonzero().squeeze(-1)
    return rows, tokens[rows] - cols.start


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, out fp32: in place (no [N, d] temporary) when a and b are fp32 too."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        out.add_((a @ b).float())


def _vocab_pass(h, w, b, tokens, temperature, keep_direction=False, with_entropy=False) -> dict:
    """One pass over vocabulary chunks with a running logsumexp; returns lse, log p(y) and, when
    asked, the gradient direction a [N, d] and the entropy H [N].

    Per position, over chunks: m = running max of x, s = sum_v exp(x_v - m), rescaled by
    exp(m_old - m_new) when m grows (Milakov & Gimelshein 2018, "Online normalizer calculation
    for softmax"); lse = m + log s. For a frozen head, also s' = sum_{v != y} exp(x_v - m) and
    A = sum_{v != y} exp(x_v - m) w_v, rescaled alike, and

        a = d log p(y) / dh = (w_y (1 - p_y) - sum_{v != y} p_v w_v) / T_s = (s' w_y - A) / (s T_s)

    which never subtracts two nearly equal numbers, even when p_y -> 1. Entropy: with
    u = sum_v exp(x_v - m) (x_v - m), H = lse - E_p[x] = log s - u / s.
    """
    n_rows, vocab = h.shape[0], w.shape[0]
    f32 = {"dtype": torch.float32, "device": h.device}
    token_x = torch.empty(n_rows, **f32)  # x_y
    running_max = torch.full((n_rows,), float("-inf"), **f32)  # m
    sum_exp, sum_exp_other, sum_exp_x = (torch.zeros(n_rows, **f32) for _ in range(3))  # s, s', u
    weighted = torch.zeros(h.shape, **f32) if keep_direction else None  # A, [N, d]
    for cols in _slices(vocab, n_rows):
        # [N, Vc] fp32: the only tensor with a vocabulary dimension
        x = _scaled(F.linear(h, w[cols], None if b is None else b[cols]), temperature)
        hit_rows, hit_cols = _token_hits(tokens, cols)
        token_x[hit_rows] = x[hit_rows, hit_cols]
        new_max = torch.maximum(running_max, x.amax(dim=-1))
        rescale = torch.exp(running_max - new_max)  # [N], 0 on the first chunk
        if with_entropy:  # u in the new max's frame: rescale * (u - (m_new - m_old) s)
            shifted = rescale * (sum_exp_x - (new_max - running_max) * sum_exp)
            sum_exp_x = torch.where(rescale > 0, shifted, 0.0)
        running_max = new_max
        z = x.sub_(new_max[:, None])  # x - m, in place
        if with_entropy:
            sum_exp_x.add_((z.exp() * z).sum(-1))
        exp_z = z.exp_()
        sum_exp.mul_(rescale).add_(exp_z.sum(-1))
        if keep_direction:
            exp_z[hit_rows, hit_cols] = 0.0  # the token's own term is w_y (1 - p_y) above
            sum_exp_other.mul_(rescale).add_(exp_z.sum(-1))
            # Rescale only the rows whose max grew (few after the first chunks), and accumulate
            # in place: a full [N, d] pass and temporary per chunk cost more than the matmul.
            grown = (rescale < 1).nonzero().squeeze(-1)
            weighted[grown] *= rescale[grown, None]
            _accumulate_mm(weighted, exp_z.to(w.dtype), w[cols])
    lse = running_max + sum_exp.log()
    out = {"lse": lse, "logprobs": token_x - lse}
    if keep_direction:
        out["direction"] = ((sum_exp_other[:, None] * w[tokens].float() - weighted)
                            .div_(sum_exp[:, None] * temperature))
    if with_entropy:
        out["entropy"] = sum_exp.log() - sum_exp_x / sum_exp
    return out


def _cast(hidden, weight, bias):
    """h, W, b in the dtype the matmuls run in (one cast of W per call, not one per chunk):
    autocast's when it is on for this device (bf16 matmul, softmax still in fp32, as under
    autocast in the plain path), else the hidden states' own."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _linear_forward(ctx, hidden, weight, bias, tokens, temperature, keep_direction):
    """log p(y) by `_vocab_pass`, keeping lse [N] (trainable head) or a [N, d] (frozen head)."""
    h, w, b = _cast(hidden, weight, bias)
    result = _vocab_pass(h, w, b, tokens, temperature, keep_direction)
    ctx.save_for_backward(hidden, weight, bias, tokens, result["lse"], result.get("direction"))
    ctx.temperature, ctx.keep_direction = temperature, keep_direction
    return result["logprobs"]


def _linear_backward(ctx, grad_out):
    """dh from the kept direction, or one pass over vocabulary chunks for dh, dW, db."""
    hidden, weight, bias, tokens, lse, direction = ctx.saved_tensors
    g = grad_out.reshape(-1).float()  # [N]
    if ctx.keep_direction:
        return (g[:, None] * direction).to(hidden.dtype), None, None, None, None, None
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    temperature = ctx.temperature
    h, w, b = _cast(hidden, weight, bias)  # custom_bwd restored the forward's autocast state
    n_rows, vocab = h.shape[0], w.shape[0]
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
    grad_w = torch.empty(w.shape, dtype=torch.float32, device=h.device) if need_w else None
    grad_b = torch.empty(vocab, dtype=torch.float32, device=h.device) if need_b else None
    # Chunks of the vocabulary, all positions at once, as in the forward pass: each slice of dW
    # is written once (row chunks would rewrite all of dW, 1 GiB at V=128256, d=2048, per chunk).
    for cols in _slices(vocab, n_rows):
        # [N, Vc]
        x = _scaled(F.linear(h, w[cols], None if b is None else b[cols]), temperature)
        # G = g (onehot(y) - p) / T_s with p = exp(x - lse), lse from the forward pass
        grad_x = x.sub_(lse[:, None]).exp_().mul_(-g[:, None])
        hit_rows, hit_cols = _token_hits(tokens, cols)
        grad_x[hit_rows, hit_cols] += g[hit_rows]
        if temperature != 1.0:
            grad_x.div_(temperature)
        grad_chunk = grad_x.to(w.dtype)
        if need_h:
            _accumulate_mm(grad_h, grad_chunk, w[cols])
        if need_w:
            grad_w[cols] = grad_chunk.t() @ h
        if need_b:
            grad_b[cols] = grad_x.sum(0)
    return (None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


@functools.cache
def _linear_function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function for one device type: torch.amp.custom_fwd/custom_bwd need the type
    to carry the caller's autocast state into the backward pass. One per device type, made once."""
    class LinearHeadTokenLogprobs(torch.autograd.Function):
        forward = staticmethod(torch.amp.custom_fwd(_linear_forward, device_type=device_type))
        backward = staticmethod(torch.amp.custom_bwd(_linear_backward, device_type=device_type))

    return LinearHeadTokenLogprobs


def is_plain_linear(head: nn.Module) -> bool:
    """True when `head(h)` is exactly F.linear(h, head.weight, head.bias): an nn.Linear itself
    (not a subclass such as a quantised layer) with no hooks that calling it would run."""
    return (type(head) is nn.Linear and not head._forward_hooks
            and not head._forward_pre_hooks)


def vocab_size(head: nn.Module) -> int:
    """V of a head module: out_features (nn.Linear, peft LoRA layers, tether's wrappers)."""
    size = getattr(head, "out_features", None)
    if size is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(head).__name__}; give it an "
                         "`out_features` attribute")
    return int(size)


def _checkpointed_rows(fn, vocab: int, heads: tuple[nn.Module, ...], *tensors: torch.Tensor
                       ) -> torch.Tensor:
    """fn over matching row chunks of [N, ...] tensors, each chunk recomputed in backward."""
    run = (functools.partial(checkpoint, fn, use_reentrant=False)
           if _needs_grad(tensors, heads) else fn)
    parts = [run(*[t[rows] for t in tensors])
             for rows in _slices(tensors[0].shape[0], vocab)]
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=tensors[0].device)
    return torch.cat(parts)


def _flat_inputs(hidden, head, tokens, temperature):
    """Checked [N, d] hidden states, [N] long tokens and V."""
    positive("temperature", temperature)
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)} needs tokens of shape "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(tokens.shape)}")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1).long()  # [N, d], [N]
    vocab = vocab_size(head)
    if flat_y.numel() and (int(flat_y.min()) < 0 or int(flat_y.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}), the head's vocabulary")
    return flat_h, flat_y, vocab


def _needs_grad(tensors: tuple[torch.Tensor, ...], heads: tuple[nn.Module, ...]) -> bool:
    return torch.is_grad_enabled() and (any(t.requires_grad for t in tensors) or any(
        p.requires_grad for m in heads for p in m.parameters()))


def head_token_logprobs(hidden: torch.Tensor, head: nn.Module, tokens: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """log softmax(head(hidden) / T_s) at `tokens`, without a [N, V] logits tensor.

        log p(y) = x_y - logsumexp(x),  x = head(h) / T_s

    Args:
        hidden: [..., d] final hidden states (the positions that predict `tokens`).
        head: the LM head. An nn.Linear (bias optional; its weight may be the tied input
            embedding) takes the fused path above; any other module is checkpointed per chunk.
        tokens: [...] integer ids in [0, V), same leading shape as `hidden`.
        temperature: T_s > 0, the sampling temperature (docs/design.md, pitfalls).

    Returns:
        [...] fp32 log-probs, differentiable with respect to `hidden` and the head's parameters.
    """
    flat_h, flat_y, vocab = _flat_inputs(hidden, head, tokens, temperature)
    if is_plain_linear(head):
        weight, bias = head.weight, head.bias
        trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
        keep_direction = torch.is_grad_enabled() and flat_h.requires_grad and not trainable
        function = _linear_function(flat_h.device.type)
        out = function.apply(flat_h, weight, bias, flat_y, float(temperature), keep_direction)
    else:
        out = _checkpointed_rows(lambda h, y: logprobs_lib.token_logprobs(head(h), y, temperature),
                                 vocab, (head,), flat_h, flat_y)
    return out.reshape(tokens.shape)


def masked_head_token_logprobs(hidden: torch.Tensor, head: nn.Module, tokens: torch.Tensor,
                               mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`head_token_logprobs` at the positions where `mask` is true, 0 elsewhere.

    Only the masked positions go through the head: the offline stages score responses, and the
    prompt and padding positions of a batch would otherwise cost a third or more of the head's work.

    Args:
        hidden: [..., d]; tokens, mask: [...] (mask bool or 0/1); the rest as `head_token_logprobs`.

    Returns:
        [...] fp32, differentiable.
    """
    mask = mask.bool()
    picked = head_token_logprobs(hidden[mask], head, tokens[mask], temperature)  # [M]
    zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device)
    return zeros.index_put((mask,), picked)


def head_entropy(hidden: torch.Tensor, head: nn.Module, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(head(hidden) / T_s) per position, chunked (tether.logprobs.entropy).

        H = logsumexp(x) - sum_v softmax(x)_v x_v,  x = head(h) / T_s

    Args:
        hidden: [..., d]; head: the LM head; temperature: T_s > 0.

    Returns:
        [...] fp32 entropies in nats, differentiable (each chunk is recomputed in backward).
    """
    if is_plain_linear(head) and not _needs_grad((hidden,), (head,)):
        tokens = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
        return head_logprobs_and_entropy(hidden, head, tokens, temperature)[1]
    positive("temperature", temperature)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    out = _checkpointed_rows(lambda h: logprobs_lib.entropy_rows(head(h), temperature),
                             vocab_size(head), (head,), flat_h)
    return out.reshape(hidden.shape[:-1])


def head_logprobs_and_entropy(hidden: torch.Tensor, head: nn.Module, tokens: torch.Tensor,
                              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(head_token_logprobs, head_entropy) of the same positions, in one pass over the vocabulary
    when nothing needs a gradient and the head is an nn.Linear (rollout scoring, evaluation): the
    logits are computed once, as the plain path computes them once for both.

    The log-probs are bitwise those of `head_token_logprobs` (same code, same chunks), which the
    PPO update relies on for its first-epoch ratio of exactly 1.

    Returns:
        ([...], [...]) fp32 log-probs and entropies.
    """
    if _needs_grad((hidden,), (head,)) or not is_plain_linear(head):
        return (head_token_logprobs(hidden, head, tokens, temperature),
                head_entropy(hidden, head, temperature))
    flat_h, flat_y, _ = _flat_inputs(hidden, head, tokens, temperature)
    h, w, b = _cast(flat_h, head.weight, head.bias)
    result = _vocab_pass(h, w, b, flat_y, float(temperature), with_entropy=True)
    return result["logprobs"].reshape(tokens.shape), result["entropy"].reshape(tokens.shape)


def head_exact_kl(hidden: torch.Tensor, head: nn.Module, ref_hidden: torch.Tensor,
                  ref_head: nn.Module, temperature: float = 1.0, rows=None) -> torch.Tensor:
    """Exact KL(pi || ref) over the vocabulary per position, chunked (tether.kl.exact).

        KL = sum_v p_v (log p_v - log q_v),  p = softmax(head(h) / T), q = softmax(ref_head(h_ref) / T)

    `ref_head` is called again in the backward pass (chunks are recomputed), so it must give the
    reference's logits whenever it is called: a frozen module, not one whose adapter is switched
    off only around this call.

    Args:
        hidden: [..., d] policy hidden states; head: the policy's LM head.
        ref_hidden: [..., d_ref] reference hidden states at the same positions; ref_head: its head.
        temperature: T > 0, applied to both.
        rows: another divergence over the vocabulary (`tether.kl.exact`'s; default the KL).

    Returns:
        [...] fp32, differentiable with respect to the policy side (and the reference's, if it
        has gradients).
    """
    positive("temperature", temperature)
    if hidden.shape[:-1] != ref_hidden.shape[:-1]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)} and ref_hidden "
                         f"{tuple(ref_hidden.shape)} must cover the same positions")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_ref = ref_hidden.reshape(-1, ref_hidden.shape[-1])

    rows = rows or kl_lib.exact_rows
    vocab = vocab_size(head)
    if vocab_size(ref_head) != vocab:
        raise ValueError(f"policy and reference heads have different vocabularies "
                         f"({vocab} vs {vocab_size(ref_head)})")
    out = _checkpointed_rows(lambda h, h_ref: rows(head(h), ref_head(h_ref), temperature), vocab,
                             (head, ref_head), flat_h, flat_ref)
    return out.reshape(hidden.shape[:-1])
