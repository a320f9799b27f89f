"""Forwards on packed rows: a padded batch's real tokens run as n < B rows [n, S] of several
sequences each, `position_ids` restarting per sequence (`tether.data.packing`), the outputs put back in the padded layout, so
every caller downstream (the chunked LM head, the masks, the loss) reads what the padded forward
gives.

Notation: B rows, L padded width, n packed rows of S slots, N real tokens, d hidden size,
V vocabulary.

How the model keeps the sequences apart, checked once per model (`packing_mode`):
- "positions": `attention_mask=None`, the restarting `position_ids` and no cache. transformers 5
  then finds the sequence boundaries itself (`masking_utils.find_packed_sequence_indices`: a
  position that is not the previous one + 1 opens a sequence) and builds the block-diagonal
  causal mask for sdpa and eager; flash-attention kernels take the same positions as varlen
  boundaries. Verified on GPT-2 (absolute positions) and Llama (rotary) in tests/data/test_packing.py.
  A cache disables the detection (`use_cache=False` is passed for that reason).
- "block_mask": an explicit [n, 1, S, S] block-diagonal causal mask in the attention
  implementation's own form (bool for sdpa, 0 / -inf added for eager), for a model whose
  attention does not read the positions that way.
A model for which neither gives what its padded forward gives is refused (`--pack`).
"""

from __future__ import annotations

import torch
from torch import nn

from tether.data.packing import Packing, pack_rows
from tether.errors import TetherError
from tether.models.forward import probing

# (model class, its part, config class, attention implementation, hidden) -> "positions",
# "block_mask" or None: how a kind of model keeps packed sequences apart depends on its code and
# its attention implementation, not on its weights; a LoRA role's view is a fresh module per call
_MODES: dict[tuple, str | None] = {}


def block_causal_mask(packing: Packing, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    """[n, 1, S, S] the causal mask of packed sequences: in each packed row, slot i sees slot j
    when both hold one sequence and j <= i. `boolean`: True where seen (sdpa's form); else 0 where
    seen and the dtype's lowest value elsewhere (eager's additive form)."""
    sequence = packing.sequence_ids  # [n, S]
    order = torch.arange(packing.packed_width, device=sequence.device)
    seen = (sequence[:, :, None] == sequence[:, None, :]) & (order[None, :] <= order[:, None])
    if boolean:
        return seen[:, None]
    low = torch.finfo(dtype).min
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, low)[:, None]


def _packed_call(model: nn.Module, mode: str, input_ids: torch.Tensor, packing: Packing,
                 **kwargs):
    """`model` on the packed tokens of `input_ids`, keeping the sequences apart by `mode`."""
    mask = None
    if mode == "block_mask":
        dtype = model.get_input_embeddings().weight.dtype
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        mask = block_causal_mask(packing, dtype, boolean=implementation != "eager")
    return model(input_ids=packing.pack(input_ids), attention_mask=mask,
                 position_ids=packing.position_ids, use_cache=False, **kwargs)


def _output(out, hidden: bool) -> torch.Tensor:
    if hidden:
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.hidden_states[-1]
    return out.logits


def _probe(model: nn.Module, mode: str, hidden: bool) -> bool:
    """Do two packed sequences give what each gives alone? One no-grad forward of 7 tokens and
    two of 4 and 3, eval mode (modes restored), autocast off."""
    embeddings = model.get_input_embeddings()  # a LoRA role's view registers no parameters
    device, vocab = embeddings.weight.device, embeddings.num_embeddings
    ids = (torch.arange(7, device=device) * 5 + 3) % vocab
    alone = [ids[None, :4], ids[None, 4:]]
    with probing(model, device):
        expected = torch.cat([_output(model(input_ids=part, use_cache=False), hidden)[0]
                              for part in alone])
        padded = torch.stack([ids[:4], torch.cat([ids[4:], ids[:1]])])  # [2, 4]
        real = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], device=device)
        got = _output(_packed_call(model, mode, padded, pack_rows(real, width=7)), hidden)[0]
    tolerance = 2e-2 if expected.dtype in (torch.float16, torch.bfloat16) else 1e-4
    scale = max(1.0, float(expected.abs().max()))
    return expected.shape == got.shape and bool((expected - got).abs().max() <= tolerance * scale)


def packing_mode(model: nn.Module, hidden: bool) -> str:
    """How `model` keeps packed sequences apart ("positions" or "block_mask"), found by a probe
    once per kind of model (class, config class, attention implementation) and remembered; a
    model for which neither works is refused. `hidden`: the model is a
    trunk returning `last_hidden_state` (else a causal LM returning logits)."""
    config = getattr(model, "config", None)
    key = (type(model), getattr(model, "part", None), type(config),
           getattr(config, "_attn_implementation", None), hidden)
    if key not in _MODES:
        _MODES[key] = next((mode for mode in ("positions", "block_mask")
                            if _probe(model, mode, hidden)), None)
    if _MODES[key] is None:
        raise TetherError(f"--pack: {type(model).__name__} does not keep packed sequences apart "
                          "(neither restarting position ids nor a block-diagonal mask give its "
                          "padded outputs); drop --pack for this model")
    return _MODES[key]


def packed_final_hidden(trunk: nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """The trunk's final normed hidden state at every slot of the padded batch, [B, L, d] (zeros in
    the padding), computed on the packed rows [n, S, d]: what `final_hidden` gives with positions
    from the mask, without the padding's FLOPs."""
    packing = pack_rows(attention_mask)
    out = _packed_call(trunk, packing_mode(trunk, hidden=True), input_ids, packing)
    return packing.unpack(_output(out, hidden=True))


def packed_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  with_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A causal LM's logits at every slot of the padded batch, [B, L, V] (zeros in the padding),
    and with `with_hidden` its last hidden states [B, L, d], from one forward over the packed rows:
    the plain path's counterpart of `packed_final_hidden` (it unpacks the full logits, so it
    saves the trunk's FLOPs, not the logits' memory)."""
    packing = pack_rows(attention_mask)
    out = _packed_call(model, packing_mode(model, hidden=False), input_ids, packing,
                       output_hidden_states=with_hidden)
    hidden = packing.unpack(out.hidden_states[-1]) if with_hidden else None
    return packing.unpack(out.logits), hidden
