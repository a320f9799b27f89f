"""Saving Hugging Face models: a model and its tokenizer written atomically in the format plain
transformers loads (safetensors), a LoRA adapter as its adapter (PEFT format) with the record of
its base, and the end of a stage with the sampling tether trained under.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tether.models.adapter_checks import remembered_base
from tether.models.base_location import named_portably, write_location
from tether.models.lora import TRAINED
from tether.models.pretrained import TrainableLM, eos_token_ids
from tether.run.atomic import atomic_dir
from tether.run.checkpoint import check_finite_weights


def save_model(model: nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Save model + tokenizer in Hugging Face format (safetensors), atomically (temp dir, rename).

    A PeftModel is saved as its trained adapter (PEFT format: `adapter_config.json`,
    `adapter_model.safetensors`, see `save_adapter`), loadable with peft's
    `PeftModel.from_pretrained(base, dir)` and `AutoPeftModelForCausalLM.from_pretrained(dir)`.
    """
    from peft import PeftModel

    check_finite_weights(model, "the model")
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        if isinstance(model, PeftModel):
            save_adapter(model, tmp, home=out)
        else:
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def save_adapter(peft: nn.Module, out_dir: str | Path, adapter: str = TRAINED,
                 home: str | Path | None = None, embedding_layers: bool | None = None) -> None:
    """Write `peft`'s adapter `adapter` to `out_dir` (PEFT format), with the embedding and output
    layers only when tether grew them for its pad token (`embeddings_grew`; `embedding_layers`
    decides instead when given: a reward adapter never saves them).

    tether never trains the embeddings under LoRA, so an adapter on an unchanged base needs none
    of them; on a grown base a standard loader needs the new row's values (the pad row enters
    the softmax normaliser): `AutoPeftModelForCausalLM` resizes the base to the adapter's
    tokenizer with random rows, which the saved layers then overwrite.

    Beside it goes `tether_base.json`, the record of the base as loaded (`adapter_checks`): a
    later load refuses another base with one line. peft's loaders ignore the file. The base is
    named portably in both (`base_location`; `home`: where `out_dir` will be renamed to).
    """
    if embedding_layers is None:
        embedding_layers = embeddings_grew(peft, adapter)
    with named_portably(peft, adapter) as loaded:
        peft.save_pretrained(out_dir, selected_adapters=[adapter],
                             save_embedding_layers=embedding_layers)
    write_location(out_dir, loaded, home, remembered_base(peft))


def embeddings_grew(peft: nn.Module, adapter: str = TRAINED) -> bool:
    """True when the base under `peft` has more embedding rows than its saved config declares
    (or that config cannot be read: saving the layers is then the safe choice)."""
    from transformers import PreTrainedConfig

    rows = peft.get_base_model().get_input_embeddings().weight.shape[0]
    base = peft.peft_config[adapter].base_model_name_or_path
    try:  # the raw dict: no model class (nor remote code) needed to read one number
        saved, _ = PreTrainedConfig.get_config_dict(base)
    except (OSError, ValueError, TypeError):
        return True
    declared = saved.get("vocab_size") or saved.get("text_config", {}).get("vocab_size")
    return not isinstance(declared, int) or rows > declared


def save_trained_lm(lm: TrainableLM, tokenizer, final_dir: Path, merged_dir: Path | None,
                    temperature: float = 1.0) -> None:
    """The end of a stage: the model (or the LoRA adapter) to `final_dir`; with `merged_dir`, also
    the adapter merged into its base as a plain model loadable with AutoModelForCausalLM. Both
    carry `plain_sampling`'s generation_config at `temperature` (the online stages' --temperature;
    1 after SFT and DPO)."""
    set_plain_sampling(lm.model, tokenizer, temperature)
    save_model(lm.peft if lm.peft is not None else lm.model, tokenizer, final_dir)
    if lm.peft is not None and merged_dir is not None:
        merged = lm.peft.merge_and_unload(adapter_names=[TRAINED])  # last use: merges in place
        set_plain_sampling(merged, tokenizer, temperature)
        save_model(merged, tokenizer, merged_dir)


def set_plain_sampling(model: nn.Module, tokenizer, temperature: float = 1.0) -> None:
    """Make `model.generation_config` the distribution tether samples and scores: softmax(z / T)
    with no other logits processor, stopping at tether's EOS set, padding with its pad token.

    A base model's saved sampling (Llama 3's temperature 0.6 and top-p 0.9; transformers' own
    default top-k 50) would make a plain `model.generate(do_sample=True)` draw from another
    distribution than the one the KL, the ratio and the reward were measured on. Other fields
    (max_length, bos_token_id, ...) are kept."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    config.do_sample = True
    config.temperature = float(temperature)
    config.top_k, config.top_p, config.min_p, config.typical_p = 0, 1.0, None, 1.0
    config.repetition_penalty, config.num_beams = 1.0, 1
    config.eos_token_id = eos_token_ids(tokenizer, model.config, config)
    config.pad_token_id = tokenizer.pad_token_id
