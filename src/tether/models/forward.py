"""Forward-pass helpers every model call in tether shares: position ids from the attention mask,
the logits at the positions that predict a response, transformers' cache under either of its
names, bf16 autocast, and rows that repeat a prompt run with that prompt once.

Notation: B batch (rows), U distinct prompts among them, P prompt (context) width, R response
width, V vocabulary, d hidden size.

Every forward pass computes position ids from the attention mask, so a left-padded row gets the
same positions, hence the same log-probs, as the same row alone (batch invariance).

Rows that repeat a prompt: run each distinct prompt through the model once, then every response on
top of its keys and values. RLOO and GRPO answer each prompt k times (`--samples-per-prompt`), so
a rollout batch of B rows in the layout of `tether.rl.rollout` holds only U = B / k distinct
prompts, and a plain forward pass over the [B, P + R] batch computes every prompt's P columns k
times. Here a forward runs in two calls of the same model:

    1. the U distinct prompts [U, P], keeping their keys and values (a KV cache);
    2. the cache's rows copied out to the B rows (`Cache.batch_select_indices(inverse)`, a
       gather whose backward sums the k rows' gradients into their one prompt), and the
       responses [B, R] on top of it.

Each response token sees exactly what it sees in the plain pass: the same key and value columns,
the same position ids (from the whole row's mask), the same padding mask and sliding window
(transformers applies a window by column, in both passes). The outputs therefore equal the plain
pass's up to float rounding, and gradients flow to the prompt's columns as before. The pass saves
(B - U) * P token-forwards, and as many in the backward; with long prompts (a 500-token problem
statement, k = 8) that is most of the work. DPO's counterpart, prompt + chosen + rejected in one
masked row, is `tether.models.pair_row`.

Used by every forward over a rollout (`trunk_head.score_responses` in both its paths, the
separate critic, the reward model; the sampler's prefill groups rows by `prompt_groups` too),
automatically: a batch with no repeated prompt, a model
with gradient checkpointing on (transformers drops the cache then) or one sharded by FSDP2 takes
the plain single call.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, 2, ... over the real tokens of each row; pads get 0 (they are masked).

    GPT-2-style models with absolute positions otherwise give a left-padded prompt positions that
    start past 0, and its log-probs change with the amount of padding.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_real(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, d]`: each row's state in `hidden` `[B, T, d]` at its last real token of
    `attention_mask` `[B, T]` (left or right padding alike)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    last = (attention_mask.long() * positions).argmax(-1)  # [B] index of the last real token
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


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


def autocast(mixed_precision: str, device: torch.device):
    """`torch.autocast` in bfloat16 when asked, else a no-op context."""
    if mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def probing(model: nn.Module, device: torch.device):
    """The block's forward passes check `model` (`trunk_head.trunk_and_head`, `packed.packing_mode`)
    and must not change it: eval mode (every module's own mode put back after), no gradients,
    autocast off on `device`."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            yield
    finally:
        for module, training in modes.items():
            module.training = training


# ----------------------------------------------------------------------------- shared prompts

SWITCH = "tether_share_prompts"  # set False on a model's modules by `share_prompts`


def share_prompts(model: nn.Module, on: bool) -> nn.Module:
    """Let `model` share prompts (the default) or make it take the plain pass. A frozen
    reference follows its policy: when the policy cannot share, a reference that did would score
    the same weights by other code, and the first batch's KL would be ~1e-7 instead of 0."""
    for module in model.modules():
        setattr(module, SWITCH, on)
    return model


@dataclass
class PromptGroups:
    """Which rows share a prompt."""

    first: torch.Tensor  # [U] long, the first row holding each distinct prompt
    inverse: torch.Tensor  # [B] long, row b's prompt is distinct prompt inverse[b]


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  context_length: int) -> PromptGroups | None:
    """The distinct prompts (ids and mask of the first P columns) of a batch, or None when no
    prompt repeats (nothing to share) or there is no prompt column."""
    if context_length < 1:
        return None
    prompt = torch.cat([input_ids[:, :context_length],
                        attention_mask[:, :context_length].to(input_ids.dtype)], dim=1)
    distinct, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    if len(distinct) == len(prompt):
        return None
    rows = torch.arange(len(prompt), device=prompt.device)
    first = torch.full((len(distinct),), len(prompt), dtype=torch.long, device=prompt.device)
    first.scatter_reduce_(0, inverse, rows, reduce="amin")
    return PromptGroups(first=first, inverse=inverse)


def can_share(model: nn.Module) -> bool:
    """Whether `model` can run a batch as prompt-then-responses: it takes a KV cache, and no
    layer drops it or holds sharded parameters (FSDP2: the two calls would gather every layer
    twice). Transformers ignores the cache of a gradient-checkpointed model in training, so such
    a model takes the plain pass in eval mode too: its rollout scoring and its update must run
    the same code for the first epoch's ratio to be exactly 1."""
    # every module `model` runs: its own, and those of the shared model a LoRA role's view
    # (`tether.models.lora.AdapterView`) holds without registering it
    shared = model.__dict__.get("shared")
    for module in [*model.modules(), *(shared.modules() if isinstance(shared, nn.Module) else ())]:
        if (getattr(module, "gradient_checkpointing", False) is True
                or getattr(module, SWITCH, True) is False
                or any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False))):
            return False
    try:
        cache_name(model)
    except (TypeError, ValueError):
        return False
    return True


def shared_prompt_calls(model: nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, context_length: int, groups: PromptGroups,
                        prompt_kwargs: dict | None = None, response_kwargs: dict | None = None):
    """The two calls of `model` (a causal LM or its trunk): the distinct prompts with a cache,
    then the responses on the cache's rows copied out to every row. Returns their outputs
    (prompt call: U rows; response call: B rows, R columns); the caller reads what it needs and
    picks prompt rows with `groups.inverse`."""
    prompt_ids = input_ids[groups.first, :context_length]  # [U, P]
    prompt_mask = attention_mask[groups.first, :context_length]
    key = cache_name(model)
    first = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                  position_ids=position_ids_from_mask(prompt_mask), use_cache=True,
                  **(prompt_kwargs or {}))
    cache = output_cache(first)
    cache.batch_select_indices(groups.inverse)  # [U, ...] -> [B, ...], a differentiable gather
    rest = model(input_ids=input_ids[:, context_length:], attention_mask=attention_mask,
                 position_ids=position_ids_from_mask(attention_mask)[:, context_length:],
                 use_cache=True, **{key: cache}, **(response_kwargs or {}))
    return first, rest


def sharing(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            context_length: int) -> PromptGroups | None:
    """The groups to share when this batch and this model allow it, else None (plain pass)."""
    if input_ids.shape[1] <= context_length:
        return None
    groups = prompt_groups(input_ids, attention_mask, context_length)
    return groups if groups is not None and can_share(model) else None


def shared_response_hidden(trunk: nn.Module, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, context_length: int,
                           groups: PromptGroups) -> torch.Tensor:
    """`trunk_head.response_hidden` in two calls: the final hidden states at the positions that
    predict the response (P - 1 + t for token t), [B, R, d]."""
    first, rest = shared_prompt_calls(trunk, input_ids, attention_mask, context_length, groups)
    last_prompt = first.last_hidden_state[:, -1:][groups.inverse]  # [B, 1, d] predicts token 0
    return torch.cat([last_prompt, rest.last_hidden_state[:, :-1]], dim=1)


def shared_response_logits(model: nn.Module, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, context_length: int,
                           groups: PromptGroups, with_hidden: bool = False):
    """`rollout.response_logits` in two calls: logits [B, R, V] at the positions that predict the
    response, and the final hidden states there [B, R, d] when asked for (else None)."""
    width = input_ids.shape[1] - context_length
    extra = {"output_hidden_states": with_hidden}
    first, rest = shared_prompt_calls(model, input_ids, attention_mask, context_length, groups,
                                      {"logits_to_keep": 1, **extra},
                                      {"logits_to_keep": width, **extra})
    logits = torch.cat([first.logits[:, -1:][groups.inverse], rest.logits[:, :-1]], dim=1)
    hidden = (torch.cat([first.hidden_states[-1][:, -1:][groups.inverse],
                         rest.hidden_states[-1][:, :-1]], dim=1) if with_hidden else None)
    return logits, hidden


def shared_last_hidden(trunk: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       context_length: int, groups: PromptGroups) -> torch.Tensor | None:
    """The final hidden state at each row's last real token, [B, d], where that token is a
    response token in every row (where a reward model reads its score); None when some row's
    response is empty (the caller takes the plain pass)."""
    response_mask = attention_mask[:, context_length:].long()  # [B, R]
    if not bool((response_mask.sum(1) > 0).all()):
        return None
    _, rest = shared_prompt_calls(trunk, input_ids, attention_mask, context_length, groups)
    return last_real(rest.last_hidden_state, response_mask)  # at the last real response column
