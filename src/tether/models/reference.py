"""The frozen reference of the KL penalty (PPO) and of DPO's implicit one, chosen in one place.

    --ref-model given      that model, checked to share the policy's vocabulary (the reference
    or --teacher           scores the policy's token ids); an output layer with more rows than
                           the policy's (a vocabulary padded past the tokenizer) is cut to the
                           policy's, so both distributions are over the same tokens
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
                    trust_remote_code: bool = False, what: str = "reference model") -> nn.Module:
    """The reference of the policy `lm` (tokenizer: the policy's), frozen and in eval mode, on
    the device it was loaded to (a view of the LoRA base sits on the policy's). `what`: its name
    in an error ("teacher" for --teacher)."""
    if ref_model:
        ref_tokenizer = load_tokenizer(ref_model, trust_remote_code=trust_remote_code)
        check_same_vocabulary(tokenizer, {what: (ref_tokenizer, None)})
        reference = load_causal_lm(ref_model, ref_tokenizer, dtype, trust_remote_code)
        check_same_vocabulary(tokenizer, {what: (None, reference)})
        rows = lm.model.get_input_embeddings().weight.shape[0]
        if reference.get_input_embeddings().weight.shape[0] > rows:  # padded past the tokenizer
            reference.resize_token_embeddings(rows)
        return freeze(reference)
    if lm.peft is not None:
        return freeze(AdapterView(lm.peft, lm.reference_adapter))
    return frozen_copy(lm.model)


def check_reference(ref_model: str, tokenizer, trust_remote_code: bool = False,
                    what: str = "reference model") -> None:
    """`--ref-model`'s (or `--teacher`'s) path and vocabulary, from its tokenizer alone: a stage
    calls this before any weights load, so a missing path or another vocabulary fails in
    seconds."""
    if ref_model:
        ref_tokenizer = load_tokenizer(ref_model, trust_remote_code=trust_remote_code)
        check_same_vocabulary(tokenizer, {what: (ref_tokenizer, None)})
