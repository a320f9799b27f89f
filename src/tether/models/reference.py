"""The frozen reference of the KL penalty (PPO) and of DPO's implicit one, chosen in one place.

    --ref-model given      that model, checked to share the policy's vocabulary (the reference
                           scores the policy's token ids)
    LoRA                   the policy's own base with the adapter off, or with the frozen copy of
                           the starting adapter when training starts from a LoRA SFT run (never
                           the bare base then: the KL at step 0 is exactly 0 either way)
    otherwise              a frozen deep copy of the starting policy (it shares no tensor with it)

The reference only runs forward passes: frozen (`tether.models.prepare.freeze`), detached.
"""

from __future__ import annotations

from torch import nn

from tether.models.lora import AdapterView
from tether.models.prepare import freeze, frozen_copy
from tether.models.pretrained import (
    TrainableLM,
    check_same_vocabulary,
    load_causal_lm,
    load_tokenizer,
)


def reference_model(lm: TrainableLM, ref_model: str, tokenizer, dtype: str = "float32",
                    trust_remote_code: bool = False) -> nn.Module:
    """The reference of the policy `lm` (tokenizer: the policy's), frozen and in eval mode, on
    the device it was loaded to (a view of the LoRA base sits on the policy's)."""
    if ref_model:
        ref_tokenizer = load_tokenizer(ref_model, trust_remote_code=trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (ref_tokenizer, None)})
        reference = load_causal_lm(ref_model, ref_tokenizer, dtype, trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (None, reference)})
        return freeze(reference)
    if lm.peft is not None:
        return freeze(AdapterView(lm.peft, lm.reference_adapter))
    return frozen_copy(lm.model)


def check_reference(ref_model: str, tokenizer, trust_remote_code: bool = False) -> None:
    """`--ref-model`'s path and vocabulary, from its tokenizer alone: a stage calls this before
    any weights load, so a missing path or another vocabulary fails in seconds."""
    if ref_model:
        ref_tokenizer = load_tokenizer(ref_model, trust_remote_code=trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (ref_tokenizer, None)})
