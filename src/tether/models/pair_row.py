"""Preference pairs with a shared prompt: prompt, chosen and rejected in one row.

A pair's two sequences share their prompt, so the plain concatenated batch (`collate_pairs`,
[2B, P+R]) runs every prompt token through the model twice and pads 2B rows. Here each pair is
one row `[prompt | chosen | rejected]` ([B, P+C+R]) with a custom attention mask: prompt tokens
see earlier prompt tokens, chosen tokens see the prompt and earlier chosen tokens, rejected tokens
see the prompt and earlier rejected tokens (never the chosen ones), and the rejected positions
restart where the prompt ends. Every response token thus has exactly the context it has in its
own sequence, so log-probs and gradients equal the concatenated pass (up to float rounding),
with fewer token slots: the prompt once, and padding to one sum of lengths per pair instead of
two. Prefix sharing for DPO: Wang et al. 2024, "Accelerating Direct Preference Optimization with
Prefix Sharing".

A custom mask replaces the model's own, so it must also carry the model's sliding window
(Mistral, Qwen2 with `use_sliding_window`): in the concatenated pass transformers lets query i see
key j only when i - W < j <= i (`masking_utils.sliding_window_overlay`); here the same rule is
applied to position ids, which in the shared row are exactly the positions each token has in its
own sequence. Models whose layers mix full and windowed attention (Qwen2's `max_window_layers`)
get one mask per layer type, as transformers' `generate` passes them.

Notation: B pairs, L row length, R longest response, V vocabulary.
"""

from __future__ import annotations

import torch

from tether.data.encoding import Encoded
from tether.lm_head import masked_head_token_logprobs
from tether.logprobs import token_logprobs
from tether.models.trunk_head import chunked_split, final_hidden

PAD, PROMPT, CHOSEN, REJECTED = -1, 0, 1, 2
# Layer kinds whose concatenated-pass mask this file reproduces.
KNOWN_LAYERS = {"full_attention", "sliding_attention"}


def attention_layout(config) -> tuple[set[str], int | None]:
    """(the layer kinds the model uses, its sliding window or None), read as transformers does:
    `layer_types` when the config lists them, else every layer is windowed exactly when
    `sliding_window` is set (Mistral)."""
    window = getattr(config, "sliding_window", None)  # Qwen2 sets None without use_sliding_window
    layer_types = getattr(config, "layer_types", None)
    kinds = (set(layer_types) if layer_types
             else {"sliding_attention" if window is not None else "full_attention"})
    return kinds, (window if "sliding_attention" in kinds else None)


def can_share(model, examples: list[Encoded]) -> bool:
    """The model takes a custom 4D mask, its layers are full or sliding-window attention (the
    two this file can reproduce), and every prompt has a token (its last logit predicts the
    first token of both responses)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    # the attention back-ends that take a custom [B, 1, L, L] mask as given
    if impl not in ("sdpa", "eager") or not all(len(e.prompt) > 0 for e in examples):
        return False
    kinds, window = attention_layout(config)
    return kinds <= KNOWN_LAYERS and ("sliding_attention" not in kinds or window is not None)


def collate_shared(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """One row per pair, with what `shared_pair_logprobs` needs to mask and gather.

    Returns `input_ids`, `position_ids`, `segment` ([B, L]; segment is PAD/PROMPT/CHOSEN/REJECTED),
    and `predict_index`, `targets`, `response_mask` ([B, 2, R]): response token t of side j
    (0 chosen, 1 rejected) is `targets[:, j, t]`, predicted by the logits at `predict_index`.
    """
    n = len(examples)
    row_len = max(len(e.prompt) + len(e.responses[0]) + len(e.responses[1]) for e in examples)
    r_len = max(len(r) for e in examples for r in e.responses)
    input_ids = torch.full((n, row_len), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n, row_len), dtype=torch.long)
    segment = torch.full((n, row_len), PAD, dtype=torch.long)
    predict_index = torch.zeros((n, 2, r_len), dtype=torch.long)
    targets = torch.full((n, 2, r_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, 2, r_len), dtype=torch.long)
    for i, ex in enumerate(examples):
        p, (c, r) = len(ex.prompt), (len(ex.responses[0]), len(ex.responses[1]))
        input_ids[i, : p + c + r] = torch.tensor(ex.prompt + ex.responses[0] + ex.responses[1])
        position_ids[i, : p + c] = torch.arange(p + c)
        position_ids[i, p + c: p + c + r] = torch.arange(p, p + r)  # rejected restarts after the prompt
        segment[i, :p], segment[i, p: p + c], segment[i, p + c: p + c + r] = PROMPT, CHOSEN, REJECTED
        # chosen token t sits at p + t and is predicted at p + t - 1 (t = 0: the prompt's last token)
        predict_index[i, 0, :c] = torch.arange(p - 1, p - 1 + c)
        # rejected token t sits at p + c + t; t = 0 is predicted by the prompt's last token too
        predict_index[i, 1, :r] = torch.cat([torch.tensor([p - 1]), torch.arange(p + c, p + c + r - 1)])
        for j, response in enumerate(ex.responses):
            targets[i, j, : len(response)] = torch.tensor(response)
            response_mask[i, j, : len(response)] = 1
    return {"input_ids": input_ids, "position_ids": position_ids, "segment": segment,
            "predict_index": predict_index, "targets": targets, "response_mask": response_mask}


def shared_attention_mask(segment: torch.Tensor, position_ids: torch.Tensor | None = None,
                          sliding_window: int | None = None) -> torch.Tensor:
    """`[B, 1, L, L]` boolean mask (True: query may attend to key) from `segment` `[B, L]`.

    With `sliding_window` W, a query at position p also sees only keys at positions > p - W
    (`position_ids` `[B, L]`, as made by `collate_shared`), the window of the concatenated pass.
    """
    length = segment.shape[1]
    index = torch.arange(length, device=segment.device)
    causal = index[:, None] >= index[None, :]  # [L, L]
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]  # [B, L, 1], [B, 1, L]
    allowed = causal & (seg_k != PAD) & ((seg_k == PROMPT) | (seg_k == seg_q))
    if sliding_window is not None:
        pos_q, pos_k = position_ids[:, :, None], position_ids[:, None, :]  # [B, L, 1], [B, 1, L]
        allowed &= pos_k > pos_q - sliding_window
    # A padding query sees only itself, so no row of the softmax is empty (NaN-free).
    allowed |= torch.eye(length, dtype=torch.bool, device=segment.device) & (seg_q == PAD)
    return allowed[:, None]


def model_attention_mask(model, batch: dict[str, torch.Tensor]
                         ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The shared-row mask in the form `model` takes: `[B, 1, L, L]` (boolean for sdpa, additive
    for eager, which adds it to the scores), windowed where the model's layers are; a dict
    {layer kind: mask} when full and windowed layers are mixed."""
    kinds, window = attention_layout(model.config)
    masks = {kind: shared_attention_mask(batch["segment"], batch["position_ids"],
                                         window if kind == "sliding_attention" else None)
             for kind in kinds}
    if model.config._attn_implementation == "eager":
        dtype = model.dtype  # a LoRA view owns no parameters; it has a dtype
        masks = {kind: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                 for kind, m in masks.items()}
    return masks if len(masks) > 1 else next(iter(masks.values()))


def shared_pair_logprobs(model, batch: dict[str, torch.Tensor], chunked: bool = True
                         ) -> tuple[torch.Tensor, ...]:
    """Summed response log-probs and response lengths: (chosen, rejected, chosen_len, rejected_len),
    each `[B]`. `chunked`: the hidden states at `predict_index` go through the LM head in chunks
    (tether.lm_head; no [B, L, V] logits); else the plain path through the full logits."""
    mask = model_attention_mask(model, batch)
    n, _, r_len = batch["predict_index"].shape
    targets = batch["targets"].reshape(n, 2 * r_len)  # [B, 2R]
    response_mask = batch["response_mask"].to(torch.float32)  # [B, 2, R]
    split = chunked_split(model, chunked)
    if split is None:
        logits = model(input_ids=batch["input_ids"], attention_mask=mask,
                       position_ids=batch["position_ids"], use_cache=False).logits  # [B, L, V]
        index = batch["predict_index"].reshape(n, 2 * r_len, 1).expand(-1, -1, logits.shape[-1])
        logprobs = token_logprobs(logits.gather(1, index), targets)  # [B, 2R]
    else:
        trunk, head = split
        hidden = final_hidden(trunk, batch["input_ids"], mask, batch["position_ids"])  # [B, L, d]
        index = batch["predict_index"].reshape(n, 2 * r_len, 1).expand(-1, -1, hidden.shape[-1])
        logprobs = masked_head_token_logprobs(hidden.gather(1, index), head, targets,
                                              response_mask.reshape(n, 2 * r_len))  # [B, 2R]
    logprobs = logprobs.reshape(n, 2, r_len)
    summed, lengths = (logprobs * response_mask).sum(-1), response_mask.sum(-1)  # [B, 2]
    return summed[:, 0], summed[:, 1], lengths[:, 0], lengths[:, 1]
