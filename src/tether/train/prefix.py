"""Preference pairs with a shared prompt: run the prompt once, continue chosen and rejected from
its KV cache.

A pair's two sequences share their prompt, so the plain concatenated batch (`collate_pairs`,
[2B, P+R]) runs every prompt token through the model twice. Here the prompts go through once
([B, P], left-padded so every cache ends at the same column), the cache is repeated for the two
responses, and both responses go through together ([2B, R]); gradients flow back through the
cache into the prompt pass. The log-probs equal the concatenated pass (up to float rounding);
the saving is the prompt's share of the tokens plus less padding. Prefix sharing for DPO is
described by Wang et al. 2024, "Accelerating Direct Preference Optimization with Prefix Sharing".
"""

from __future__ import annotations

import inspect

import torch

from tether.data import Encoded
from tether.logprobs import token_logprobs


def collate_shared(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts `[B, P]` (left-padded) and responses `[2B, R]` (right-padded; row 2i is pair i's
    chosen response, row 2i+1 its rejected one)."""
    n = len(examples)
    p_len = max(len(e.prompt) for e in examples)
    r_len = max(len(r) for e in examples for r in e.responses)
    prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    response_ids = torch.full((2 * n, r_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((2 * n, r_len), dtype=torch.long)
    for i, ex in enumerate(examples):
        if ex.prompt:
            prompt_ids[i, p_len - len(ex.prompt):] = torch.tensor(ex.prompt)
            prompt_mask[i, p_len - len(ex.prompt):] = 1
        for j, response in enumerate(ex.responses):
            response_ids[2 * i + j, : len(response)] = torch.tensor(response)
            response_mask[2 * i + j, : len(response)] = 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "response_ids": response_ids, "response_mask": response_mask}


def can_share(examples: list[Encoded]) -> bool:
    """Every prompt needs at least one token: its last logit predicts the response's first."""
    return all(len(e.prompt) > 0 for e in examples)


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache`; accept either spelling.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def shared_pair_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Summed response log-probs and response lengths: (chosen, rejected, chosen_len, rejected_len),
    each `[B]`."""
    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"]
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
    key = _cache_kwarg(model)
    out = model(input_ids=batch["prompt_ids"], attention_mask=prompt_mask, position_ids=positions,
                use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    cache.batch_repeat_interleave(2)  # prompt i serves rows 2i (chosen) and 2i+1 (rejected)
    prompt_mask2 = prompt_mask.repeat_interleave(2, dim=0)  # [2B, P]
    r_len = response_mask.shape[1]
    response_positions = prompt_mask2.sum(-1, keepdim=True) + torch.arange(r_len, device=prompt_mask.device)
    cont = model(input_ids=batch["response_ids"], attention_mask=torch.cat([prompt_mask2, response_mask], 1),
                 position_ids=response_positions, use_cache=False, **{key: cache})
    # logits predicting response token t: the prompt's last position for t = 0, else response t-1
    first = out.logits[:, -1:].repeat_interleave(2, dim=0)  # [2B, 1, V]
    logits = torch.cat([first, cont.logits[:, :-1]], dim=1)  # [2B, R, V]
    mask = response_mask.to(torch.float32)
    summed = (token_logprobs(logits, batch["response_ids"]) * mask).sum(-1)  # [2B]
    lengths = mask.sum(-1)
    return summed[0::2], summed[1::2], lengths[0::2], lengths[1::2]
