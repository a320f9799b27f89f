"""The policy's weights as an engine is sent them. Under FSDP2 each parameter is a shard,
gathered whole first (`tether.run.checkpoint.whole`: a collective, so every rank calls these in
the same order).

    trainable, flatten, unflatten_into   the generator process's copy (--max-staleness,
                                         `tether.rl.engines.ahead`): the trainable parameters,
                                         one flat CPU tensor per dtype, and back into the copy
    hf_weights, adapter_tensors          vLLM's (`tether.rl.engines.vllm_engine`): the model
                                         under its transformers checkpoint's names, or the LoRA
                                         adapter's tensors under peft's
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tether.run.checkpoint import whole


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the trainer changes, in the model's order: what a sync sends."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten(params: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """One flat CPU copy per dtype of `params` (in order): one shared-memory block each. An
    FSDP2 shard is gathered whole first (a collective: every rank flattens its params in the
    same order)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(whole(p).detach().reshape(-1).cpu())
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def unflatten_into(params: list[torch.Tensor], flat: dict[torch.dtype, torch.Tensor]) -> None:
    """Copy `flatten`'s output back into `params` (the same order, shapes and dtypes)."""
    offsets = dict.fromkeys(flat, 0)
    with torch.no_grad():
        for p in params:
            start = offsets[p.dtype]
            p.copy_(flat[p.dtype][start:start + p.numel()].view_as(p))
            offsets[p.dtype] = start + p.numel()


def hf_weights(model: nn.Module, merge_adapter: str | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `model` under its transformers checkpoint's names and layouts. LoRA
    layers give their base weight under the original name (`q_proj.base_layer.weight` ->
    `q_proj.weight`) and no adapter tensors, or, with `merge_adapter`, W + (alpha / r) B A of that
    adapter (peft's own delta, Conv1D layouts included). Under FSDP2 every rank must call this:
    each shard is gathered whole."""
    merged = {} if merge_adapter is None else {
        f"{name}.base_layer.weight": module for name, module in model.named_modules()
        if merge_adapter in getattr(module, "lora_A", {}) and hasattr(module, "get_delta_weight")}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        value = whole(value).detach()
        if key in merged:
            value = value + whole(merged[key].get_delta_weight(merge_adapter)).detach()
        yield key.replace(".base_layer.", "."), value


def adapter_tensors(peft_model: nn.Module, adapter: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(the adapter's tensors under peft's saved names, its config as a dict): what
    `save_pretrained` would write, without writing it."""
    from peft import get_peft_model_state_dict

    # The embeddings tether resized for its pad token are the base's, pushed with it; peft would
    # otherwise add them to the adapter, which vLLM refuses.
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter,
                                      save_embedding_layers=False)
    config = peft_model.peft_config[adapter].to_dict()
    if isinstance(config.get("target_modules"), set | frozenset):
        config["target_modules"] = sorted(config["target_modules"])
    return {k: whole(v).detach().clone() for k, v in state.items()}, config
