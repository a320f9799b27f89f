"""Forward-pass helpers every model call in tether shares: position ids from the attention mask,
the logits at the positions that predict a response, transformers' cache under either of its
names, and bf16 autocast.

Notation: B batch, P prompt (context) width, R response width, V vocabulary, d hidden size.

Every forward pass computes position ids from the attention mask, so a left-padded row gets the
same positions, hence the same log-probs, as the same row alone (batch invariance).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from tether.logprobs import token_logprobs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, 2, ... over the real tokens of each row; pads get 0 (they are masked).

    GPT-2-style models with absolute positions otherwise give a left-padded prompt positions that
    start past 0, and its log-probs change with the amount of padding.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def cache_name(model: nn.Module) -> str:
    # transformers 5.x renamed `past_key_values` to `cache`; accept either so both versions work.
    # A peft PeftModel's forward takes **kwargs and passes them on: ask the model under it.
    get_base = getattr(model, "get_base_model", None)
    params = inspect.signature((get_base() if callable(get_base) else model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def response_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    context_length: int, with_hidden: bool = False):
    """Logits (and optionally last hidden states) at the positions that predict the response.

    Position P - 1 + t predicts response token t, so we keep R + 1 positions and drop the last.
    Only those positions go through the LM head (`logits_to_keep`), sparing a [B, P, V] tensor.

    Returns:
        logits: [B, R, V]; hidden: [B, R, d] (the final, normed hidden state) or None.
    """
    keep = input_ids.shape[1] - context_length + 1
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), logits_to_keep=keep,
                output_hidden_states=with_hidden, use_cache=False)
    logits = out.logits[:, :-1]
    hidden = out.hidden_states[-1][:, context_length - 1:-1] if with_hidden else None
    return logits, hidden


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_t | x_<t) / T-scaled for every token t >= 1 of any padding layout: [B, L - 1].

    Used to check batch invariance under right padding, and by callers whose responses do not
    start at one shared column.
    """
    logits, _ = response_logits(model, input_ids, attention_mask, context_length=1)
    return token_logprobs(logits, input_ids[:, 1:], temperature)


def autocast(mixed_precision: str, device: torch.device):
    """`torch.autocast` in bfloat16 when asked, else a no-op context."""
    if mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

