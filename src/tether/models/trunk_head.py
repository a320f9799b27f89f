"""A causal LM as trunk + LM head: the split, its check, and the forwards that score response
tokens through the chunked head (`tether.lm_head`) instead of full logits.

Notation: B batch, P context width, R response width, d hidden size, V vocabulary.

    logits = head(trunk(input_ids).last_hidden_state)

holds for most causal LMs, with trunk = `model.base_model` (its `last_hidden_state` is the final,
normed hidden state) and head = `model.get_output_embeddings()`. Where a model transforms its
logits after the head, the transform goes into the head (`LogitTransformHead`); where the split
cannot be trusted, callers fall back to the plain path (`chunked_split` returns None).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tether import logprobs as logprobs_lib
from tether.lm_head import (
    head_exact_kl,
    head_logprobs_and_entropy,
    head_token_logprobs,
    masked_head_token_logprobs,
    vocab_size,
)
from tether.models.forward import (
    position_ids_from_mask,
    probing,
    response_logits,
    shared_response_hidden,
    shared_response_logits,
    sharing,
)
from tether.models.packed import packed_final_hidden, packed_logits


class LogitTransformHead(nn.Module):
    """The LM head followed by a model's fixed transform of its logits, written as the model
    writes it, so each chunk sees the logits the model itself returns.

    softcap (Gemma 2/3, config `final_logit_softcapping` c): c * tanh(logits / c)
    multiply (Cohere, config `logit_scale` s): logits * s
    divide (Granite, config `logits_scaling` s): logits / s
    """

    def __init__(self, head: nn.Module, kind: str, value: float):
        super().__init__()
        self.head, self.kind, self.value = head, kind, float(value)
        self.out_features = vocab_size(head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.kind == "softcap":
            return torch.tanh(logits / self.value) * self.value
        return logits * self.value if self.kind == "multiply" else logits / self.value


# (config field, the transform it sets, the value that sets none): see LogitTransformHead
LOGIT_TRANSFORMS = (("final_logit_softcapping", "softcap", 0), ("logit_scale", "multiply", 1),
                    ("logits_scaling", "divide", 1))


def _logits_match(model: nn.Module, trunk: nn.Module, head: nn.Module) -> bool:
    """Does head(trunk(ids)) give model(ids).logits? One forward of 4 tokens in eval mode (modes
    restored), which catches a logit transform the config lookup does not know about."""
    device = next(model.parameters()).device
    ids = (torch.arange(4, device=device) % model.get_input_embeddings().num_embeddings)[None]
    mask = torch.ones_like(ids)
    with probing(model, device):
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = head(final_hidden(trunk, ids, mask))
    return expected.shape == got.shape and torch.allclose(expected.float(), got.float(),
                                                          rtol=1e-4, atol=1e-5)


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None or why not


def trunk_and_head(model) -> tuple[nn.Module, nn.Module]:
    """Split a causal LM into its trunk (returns `last_hidden_state`, the final normed hidden
    state) and its head (`head(hidden)` is the model's logits).

    Accepts a transformers causal LM (trunk `model.base_model`, head `get_output_embeddings()`,
    wrapped in `LogitTransformHead` for softcapping or logit scaling), a peft PeftModel (its base
    model, whose layers carry the active adapters), or any object with `tether_trunk_and_head()`,
    which is trusted as is. The split of a model is checked once against its own logits.

    Raises:
        ValueError: the model's logits are not head(trunk(...)) (say why); use the plain path.
    """
    from peft import PeftModel

    if hasattr(model, "tether_trunk_and_head"):
        return model.tether_trunk_and_head()
    if isinstance(model, PeftModel):
        model = model.get_base_model()
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    trunk, head = model.base_model, model.get_output_embeddings()
    # the known transforms between head(hidden) and the logits, read from the config: the first
    # field of `LOGIT_TRANSFORMS` that holds a number other than its no-op value
    for field, kind, none in LOGIT_TRANSFORMS:
        value = getattr(model.config, field, None)
        if isinstance(value, (int, float)) and value != none:
            head = LogitTransformHead(head, kind, value)
            break
    if model not in _VERDICTS:
        try:
            matches = trunk is not model and _logits_match(model, trunk, head)
            _VERDICTS[model] = None if matches else "head(trunk(ids)) differs from its logits"
        except (AttributeError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            _VERDICTS[model] = f"splitting it failed ({type(exc).__name__}: {exc})"
    if _VERDICTS[model] is not None:
        raise ValueError(f"{type(model).__name__}: {_VERDICTS[model]}")
    return trunk, head


def chunked_split(model, chunked: bool) -> tuple[nn.Module, nn.Module] | None:
    """(trunk, head) when the chunked head is asked for and applies to `model`; None means the
    plain path (full logits), with a warning when it was asked for but cannot be used."""
    if not chunked:
        return None
    try:
        return trunk_and_head(model)
    except ValueError as exc:
        warnings.warn(f"chunked LM head off for this model, using full logits: {exc}", stacklevel=2)
        return None


def final_hidden(trunk: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The trunk's final normed hidden state at every position: [B, L, d]."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    return trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                 **extra).last_hidden_state


def response_hidden(trunk: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    context_length: int, packed: bool = False) -> torch.Tensor:
    """Hidden states at the positions that predict the response (P - 1 + t for token t): [B, R, d].

    Positions come from the mask (tether.models.forward.position_ids_from_mask), as in the plain
    path, so left padding does not move them. Rows that repeat a prompt run it once
    (tether.models.forward). `packed`: the batch's real tokens run as packed rows without
    padding (tether.models.packed), which gives the same states.
    """
    if packed:
        return packed_final_hidden(trunk, input_ids, attention_mask)[:, context_length - 1:-1]
    if (groups := sharing(trunk, input_ids, attention_mask, context_length)) is not None:
        return shared_response_hidden(trunk, input_ids, attention_mask, context_length, groups)
    hidden = final_hidden(trunk, input_ids, attention_mask, position_ids_from_mask(attention_mask))
    return hidden[:, context_length - 1:-1]


@dataclass
class ResponseScores:
    """What one forward pass says about the response tokens of a rollout batch."""

    logprobs: torch.Tensor  # [B, R] log pi(y_t) at the temperature, fp32
    entropy: torch.Tensor | None  # [B, R] H(pi(. | s_t)), when asked for
    hidden: torch.Tensor | None  # [B, R, d] final normed hidden states, when asked for


def score_responses(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    context_length: int, temperature: float, *, chunked: bool,
                    entropy: bool = False, hidden: bool = False,
                    mask: torch.Tensor | None = None, packed: bool = False) -> ResponseScores:
    """Log-probs (and entropies, hidden states) of the response tokens in rollout layout.

    chunked: hidden states through the LM head in chunks (no [B, R, V] tensor); else the plain
    path, `response_logits` and the full [B, R, V] logits. Both give the same numbers. Rows that
    repeat a prompt (k samples per prompt) run it once in either path (tether.models.forward).
    `mask` [B, R]: score only these positions (the tokens the policy sampled), 0 elsewhere: only
    they go through the LM head, so the other positions cost nothing there and whatever their
    logits would be (an environment's observation, padding; NaN included) reaches no number and
    no gradient. `packed`: the forward runs on the batch's real tokens as packed rows, without
    padding (tether.models.packed; prompts are then not shared); the same numbers.
    """
    tokens = input_ids[:, context_length:]  # [B, R]
    split = chunked_split(model, chunked)
    if split is None:
        if packed:
            logits, states = packed_logits(model, input_ids, attention_mask, with_hidden=hidden)
            logits = logits[:, context_length - 1:-1]  # [B, R, V]
            states = states[:, context_length - 1:-1] if hidden else None
        elif (groups := sharing(model, input_ids, attention_mask, context_length)) is not None:
            logits, states = shared_response_logits(model, input_ids, attention_mask,
                                                    context_length, groups, with_hidden=hidden)
        else:
            logits, states = response_logits(model, input_ids, attention_mask, context_length,
                                             with_hidden=hidden)  # [B, R, V]
        if mask is not None:  # selected, not multiplied: 0 x NaN would be NaN, also in backward
            logits = torch.where(mask.bool()[..., None], logits, 0.0)
        return ResponseScores(_masked(logprobs_lib.token_logprobs(logits, tokens, temperature),
                                      mask),
                              _masked(logprobs_lib.entropy(logits, temperature), mask)
                              if entropy else None, states)
    trunk, head = split
    states = response_hidden(trunk, input_ids, attention_mask, context_length, packed)  # [B, R, d]
    picked, targets = (states, tokens) if mask is None else (states[mask.bool()],
                                                             tokens[mask.bool()])
    if entropy:
        logprobs, entropies = head_logprobs_and_entropy(picked, head, targets, temperature)
    else:
        logprobs, entropies = head_token_logprobs(picked, head, targets, temperature), None
    if mask is not None:  # [M] -> [B, R], 0 at the positions not scored
        logprobs = placed_at(logprobs, mask)
        entropies = placed_at(entropies, mask) if entropies is not None else None
    return ResponseScores(logprobs, entropies, states if hidden else None)


def placed_at(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[M] values of the true positions of `mask` [B, R] as [B, R], zeros elsewhere."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.index_put((mask.bool(),), values)


def _masked(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return values if mask is None else torch.where(mask.bool(), values, 0.0)


def response_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], chunked: bool = True,
                      packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token of the response and the mask of those tokens.

    Logits at position t predict token t+1, so both outputs are `[N, T-1]`: `logprobs[:, t]` is
    log p(input_ids[:, t+1]) where `mask[:, t]` (= response_mask[:, t+1]) is 1, and 0 elsewhere.
    `chunked`: only the response positions' hidden states go through the LM head, in chunks
    (tether.lm_head; no [N, T, V] logits); else the plain path through the full logits.
    `packed`: the rows' real tokens run as packed rows without padding (tether.models.packed).
    """
    mask = batch["response_mask"][:, 1:]
    tokens = batch["input_ids"][:, 1:]  # [N, T-1]
    ids, real = batch["input_ids"], batch["attention_mask"]
    split = chunked_split(model, chunked)
    if split is None:
        logits = (packed_logits(model, ids, real)[0] if packed
                  else model(input_ids=ids, attention_mask=real).logits)
        logprobs = logprobs_lib.token_logprobs(logits[:, :-1], tokens) * mask  # [N, T-1]
    else:
        trunk, head = split
        hidden = (packed_final_hidden(trunk, ids, real) if packed
                  else final_hidden(trunk, ids, real))  # [N, T, d]
        logprobs = masked_head_token_logprobs(hidden[:, :-1], head, tokens, mask)
    return logprobs, mask.to(logprobs.dtype)


def exact_kl_at(policy: nn.Module, reference: nn.Module, hidden: torch.Tensor | None,
                ref_hidden: torch.Tensor | None, temperature: float,
                mask: torch.Tensor | None = None, rows=None) -> torch.Tensor | None:
    """Exact KL(pi || ref) over the vocabulary at each response position, [B, R], from the two
    models' hidden states through their LM heads in chunks; None when a model's logits are not
    head(hidden) (tether.lm_head.trunk_and_head says why). `mask` [B, R]: only those positions
    (the others 0), as in `score_responses`. `rows`: another divergence (`tether.kl.exact`)."""
    if hidden is None or ref_hidden is None:
        return None
    try:
        _, head = trunk_and_head(policy)
        _, ref_head = trunk_and_head(reference)
    except ValueError:
        return None
    if mask is None:
        return head_exact_kl(hidden, head, ref_hidden, ref_head, temperature, rows)
    picked = mask.bool()
    return placed_at(head_exact_kl(hidden[picked], head, ref_hidden[picked], ref_head, temperature,
                                   rows), mask)
