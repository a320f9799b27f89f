"""Batches of encoded rows: right-padded prompt + response rows with their response masks, the
seeded order of an offline stage's steps, and the held-out split.

Notation: N rows, T the longest prompt + response.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.data.encoding import Encoded
from tether.errors import TetherError


def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                  loss_masks: list[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response rows: `input_ids`, `attention_mask`, `response_mask` (all [N, T]).

    `response_mask[i, t]` is 1 where token t of row i belongs to the response and carries loss:
    every response token, or where row i's `loss_masks[i]` (over its response) is 1 when it is
    given (a multi-turn chat: the assistant turns, not the user turns between them); prompt and
    padding are 0.
    """
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    n = len(prompts)
    loss_masks = [None] * n if loss_masks is None else loss_masks
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length), dtype=torch.long)
    for i, (p, r, m) in enumerate(zip(prompts, responses, loss_masks, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p): len(p) + len(r)] = 1 if m is None else torch.tensor(m, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


def collate_sft(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    return pad_sequences([e.prompt for e in examples], [e.responses[0] for e in examples], pad_id,
                         [e.loss_mask for e in examples])


def collate_pairs(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one batch `[2B, T]`, so one forward pass scores both."""
    prompts = [e.prompt for e in examples] * 2
    responses = [e.responses[0] for e in examples] + [e.responses[1] for e in examples]
    batch = pad_sequences(prompts, responses, pad_id)
    batch["margin"] = torch.tensor([e.margin for e in examples], dtype=torch.float32)
    return batch


def batch_order(n_rows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Row indices of optimizer step `step` (0-based): a fresh seeded shuffle each epoch.

    The order is a pure function of (seed, step), so a resumed run sees the same batches as an
    uninterrupted one without saving an iterator.
    """
    epoch, index = divmod(step, -(-n_rows // batch_size))  # (steps per epoch: ceil(n / b))
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n_rows, generator=generator).tolist()
    return perm[index * batch_size: (index + 1) * batch_size]


def split_holdout(items: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seeded (train, held-out) split; held-out gets round(fraction * n) items, at least 1 if > 0."""
    if fraction <= 0:
        return items, []
    n_eval = max(1, round(fraction * len(items)))
    if n_eval >= len(items):
        raise TetherError(f"eval_fraction={fraction} leaves no training rows out of {len(items)}; lower it")
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed + 7)).tolist()
    held = set(perm[:n_eval])
    return ([x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held])


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}

