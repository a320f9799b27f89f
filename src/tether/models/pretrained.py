"""Loading Hugging Face models: tokenizers (pad is not EOS), causal LMs resized to their
tokenizer, the trainable LM of a stage (full weights or a LoRA adapter), and the checks that two
models share one vocabulary and a set of EOS ids.

Everything is read with `from_pretrained` (and written with `save_pretrained`, safetensors:
`tether.models.saving`), so a tether output loads with plain transformers. `trust_remote_code` is
off unless the caller asks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.errors import TetherError
from tether.models.adapter_checks import (
    base_record,
    check_adapter_files,
    check_base,
    check_embedding_rows,
    remember_base,
)
from tether.models.base_location import local_or_hub
from tether.models.lora import (
    TRAINED,
    LoraSpec,
    adapter_base,
    add_adapter,
    is_adapter,
    load_adapter,
    set_trainable,
)
from tether.run.paths import check_local_path

PAD_TOKEN = "<|pad|>"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_exists(name_or_path: str) -> None:
    """Local paths first (`check_local_path`). A hub name in offline mode (HF_HUB_OFFLINE=1) must
    be in the local cache, or loading it would only fail after retries and a page of log lines."""
    check_local_path(name_or_path)
    if Path(name_or_path).expanduser().exists():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    except ValueError:  # not a valid repo id either: loading reports it in its own words
        cached = False
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise TetherError(f"{name_or_path} is not a local directory and HF_HUB_OFFLINE is set, "
                              "and the hub cache has no copy of it; pass a local model directory "
                              "or download it first")
        return
    from tether.run.hub import go_offline, hub_reachable

    if hub_reachable():
        return
    if not cached:  # else huggingface_hub retries for 27-51 s before failing (issue 13)
        raise TetherError(f"{name_or_path} is not a local directory, the hub cache has no copy of "
                          "it, and the hub cannot be reached (no network?); pass a local model "
                          "directory, or download it on a machine with network first")
    go_offline()  # the cached copy, without a round of retries per file


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, base: str = ""):
    """Load a tokenizer and make sure its pad token is no EOS id (its own EOS, or one the model's
    config or `generation_config` declares, like Qwen2.5-Instruct's `<|endoftext|>`); see
    `choose_pad` for how a missing or EOS pad is replaced. `base`: for an adapter directory, its
    base model where its records say otherwise (`--base`).

    Pad must not be EOS: masking pads would then also mask the real EOS the model must learn to
    emit, a sampled EOS would not stop generation, and the reward would be read at the wrong
    position.
    """
    _check_exists(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise TetherError(f"cannot load tokenizer from {name_or_path}: {str(exc).splitlines()[0]}") from None
    # A directory with a model but no tokenizer files still "loads" an empty tokenizer from the
    # config alone, which then encodes every text to no tokens: training would run on nothing.
    if len(tokenizer) < 8 or not tokenizer("a b c", add_special_tokens=False)["input_ids"]:
        raise TetherError(f"{name_or_path} has no usable tokenizer (vocabulary of {len(tokenizer)} "
                          "tokens); save the tokenizer beside the model (tokenizer.save_pretrained)")
    # An adapter directory holds no model config: its base's says what the model declares.
    model_dir = adapter_base(name_or_path, base) if is_adapter(name_or_path) else name_or_path
    configs = _saved_configs(model_dir, trust_remote_code)
    choose_pad(tokenizer, eos_token_ids(tokenizer, *configs), _embedding_rows(configs))
    return tokenizer


# Pad tokens a vocabulary may hold without its tokenizer naming one: Llama 3.1 ships
# `<|finetune_right_pad_id|>` for this and leaves `pad_token` unset.
KNOWN_PADS = ("<|finetune_right_pad_id|>", "<pad>", "[PAD]", PAD_TOKEN)


def choose_pad(tokenizer, eos_ids: list[int], rows: int | None) -> None:
    """Give `tokenizer` a pad token that is no id of `eos_ids`, growing the vocabulary only when
    the model (`rows` embedding rows; None when unknown) has no room for one. The first that
    applies:

    1. the tokenizer's own pad token, when it is no EOS id: kept;
    2. a token of `KNOWN_PADS` the vocabulary already holds, when it is no EOS id;
    3. a spare embedding row (`rows` > len(tokenizer); Qwen2 has 151936 rows for 151665 tokens):
       `PAD_TOKEN` is added on it, and no row is added;
    4. the unknown token, when it is neither EOS nor BOS (Llama 2 and Mistral practice): safe
       because tether derives every mask from lengths, never from `ids == pad_token_id`;
    5. else (GPT-2: no spare row, no unknown token) `PAD_TOKEN` is added on a new row: the model
       grows by one (`grow_embeddings`), and a LoRA adapter is saved with its embeddings
       (`tether.models.saving.save_model`), so standard loaders see the same numbers.
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id not in eos_ids:
        return
    vocab = tokenizer.get_vocab()
    for name in KNOWN_PADS:
        if name in vocab and vocab[name] not in eos_ids and (rows is None or vocab[name] < rows):
            tokenizer.pad_token = name
            return
    unk = tokenizer.unk_token_id
    spare = rows is not None and rows > len(tokenizer)
    if not spare and unk is not None and unk not in eos_ids and unk != tokenizer.bos_token_id:
        tokenizer.pad_token = tokenizer.unk_token
        return
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def _embedding_rows(configs: list) -> int | None:
    """The embedding rows a saved model has (its text config's `vocab_size`), None if unknown."""
    for config in configs:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        rows = getattr(text, "vocab_size", None)
        if isinstance(rows, int):
            return rows
    return None


def _saved_configs(name_or_path: str, trust_remote_code: bool) -> list:
    """The model's config and `generation_config` (where Qwen2.5-Instruct lists its second EOS),
    those that exist beside the tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    configs = []
    for loader in (AutoConfig, GenerationConfig):
        # none saved (e.g. a tokenizer-only directory)
        with contextlib.suppress(OSError, ValueError, KeyError):
            configs.append(loader.from_pretrained(name_or_path, trust_remote_code=trust_remote_code))
    return configs


def eos_token_ids(tokenizer, *configs) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and each `eos_token_id` (an int or a
    list) of the given model configs / generation configs (None entries are skipped)."""
    ids = {tokenizer.eos_token_id}
    for config in configs:
        value = getattr(config, "eos_token_id", None)
        ids |= set(value if isinstance(value, (list, tuple)) else [value])
    ids.discard(None)
    return sorted(ids)


def policy_eos_ids(tokenizer, model: nn.Module, name: str) -> list[int]:
    """Every EOS the tokenizer, the model config and its generation config declare; a model
    without one is refused (its responses would never end)."""
    eos = eos_token_ids(tokenizer, model.config, getattr(model, "generation_config", None))
    if not eos:
        raise TetherError(f"{name}: the tokenizer has no EOS token; set one in its config")
    return eos


def check_same_vocabulary(policy_tokenizer, others: dict[str, tuple[object, nn.Module | None]]
                          ) -> None:
    """PPO scores the policy's token ids with the reference and the reward model directly, so
    all must share one vocabulary; a mismatch would silently score different text."""
    policy_vocab = policy_tokenizer.get_vocab()
    for name, (tokenizer, model) in others.items():
        if tokenizer is not None and tokenizer.get_vocab() != policy_vocab:
            raise TetherError(f"the {name}'s tokenizer has a different vocabulary from the "
                              f"policy's ({len(tokenizer)} vs {len(policy_tokenizer)} tokens); "
                              f"train the {name} from the same SFT model")
        if model is not None:
            rows = model.get_input_embeddings().weight.shape[0]
            if rows < len(policy_tokenizer):
                raise TetherError(f"the {name} has {rows} embedding rows but the policy's "
                                  f"tokenizer has {len(policy_tokenizer)} tokens; train the "
                                  f"{name} from the same SFT model")


def grow_embeddings(model: nn.Module, rows: int) -> None:
    """Grow the embeddings (and an untied output layer) to `rows` when the model has fewer, as
    for ids past the model's rows (the pad token of `choose_pad`'s last rule); new rows start at
    the mean embedding (a neutral input that does not consume random numbers)."""
    old = model.get_input_embeddings().weight.shape[0]
    if rows <= old:
        return
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(0, keepdim=True)
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if out is not None and out.weight.data_ptr() != emb.data_ptr():
            out.weight[old:] = out.weight[:old].mean(0, keepdim=True)


def _load_for_tokenizer(auto_class, what: str, name_or_path: str, tokenizer, dtype: str,
                        trust_remote_code: bool, adapter_dir: str | None = None) -> nn.Module:
    """`auto_class.from_pretrained`, resized to the tokenizer, with `pad_token_id` set; a load
    failure becomes one TetherError line naming `what` could not be loaded.

    The model keeps the record of itself as read, before any pad row is added (`base_record`:
    an adapter trained on it saves it). As the base of the adapter at `adapter_dir` it is first
    checked against that adapter's record (or, without one, its tokenizer's vocabulary)."""
    _check_exists(name_or_path)
    model = _from_pretrained(auto_class, what, name_or_path, dtype, trust_remote_code)
    record = base_record(model, name_or_path)
    if adapter_dir is not None:
        check_base(adapter_dir, record, name_or_path)
        check_embedding_rows(adapter_dir, model, tokenizer, name_or_path)
    remember_base(model, record)
    grow_embeddings(model, max(len(tokenizer), (tokenizer.pad_token_id or 0) + 1))
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _from_pretrained(auto_class, what: str, name_or_path: str, dtype: str,
                     trust_remote_code: bool, **kwargs) -> nn.Module:
    """`auto_class.from_pretrained` (with `kwargs`, e.g. `num_labels`); a missing, truncated or
    corrupt weight file, or a pickle payload that torch's safe loader refuses, becomes one
    TetherError line."""
    from pickle import UnpicklingError

    from safetensors import SafetensorError

    if dtype not in DTYPES:
        raise TetherError(f"dtype must be one of: {', '.join(DTYPES)} (got {dtype!r})")
    try:
        return auto_class.from_pretrained(name_or_path, dtype=DTYPES[dtype],
                                          trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, SafetensorError, UnpicklingError, EOFError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        fix = ("it holds a pickle that torch's safe loader refuses: convert it to safetensors "
               "from a trusted copy" if isinstance(exc, UnpicklingError) else
               "the weight files are missing or damaged: copy or save the model again")
        raise TetherError(f"cannot load {what} from {name_or_path} ({type(exc).__name__}: "
                          f"{first}); {fix}") from None


def load_adapter_base(adapter_dir: str, tokenizer, dtype: str, trust_remote_code: bool,
                      what: str = "the adapter's base model", base: str = ""
                      ) -> tuple[nn.Module, str]:
    """(the base of the adapter at `adapter_dir`, its name), loaded for `tokenizer`, after the
    adapter's own files are checked (nothing is read from the base before) and checked against
    the adapter (`_load_for_tokenizer`); the adapter itself is not applied. The base is where
    the adapter's records say (`base_location.resolve_base`), or `base` when given."""
    check_adapter_files(adapter_dir)
    base_name = adapter_base(adapter_dir, base)
    return _load_for_tokenizer(AutoModelForCausalLM, what, base_name, tokenizer, dtype,
                               trust_remote_code, adapter_dir=adapter_dir), base_name


def load_causal_lm(name_or_path: str, tokenizer, dtype: str = "float32",
                   trust_remote_code: bool = False, base: str = ""):
    """A causal LM from a name or path, resized to the tokenizer, with `pad_token_id` set.

    A LoRA adapter directory (from a `--lora-r` run) gives its base (`base` when given, see
    `load_adapter_base`) with the adapter merged in: a plain model, for stages that train every
    weight or only score.
    """
    if is_adapter(name_or_path):
        model, _ = load_adapter_base(name_or_path, tokenizer, dtype, trust_remote_code, base=base)
        merged = load_adapter(model, local_or_hub(name_or_path), TRAINED).merge_and_unload()
        return merged.requires_grad_(True)  # peft froze the base when it wrapped it
    return _load_for_tokenizer(AutoModelForCausalLM, "a causal LM", local_or_hub(name_or_path),
                               tokenizer, dtype, trust_remote_code)


@dataclass
class TrainableLM:
    """A causal LM ready to train: `model` is what the loop calls (a transformers model, with LoRA
    layers injected when `peft` is set); `peft` is the PeftModel that owns the adapters (None for
    full fine-tuning); `reference_adapter` is the adapter that reproduces the starting model
    ("reference" when it was a LoRA adapter, None when the bare base is the start)."""

    model: nn.Module
    peft: nn.Module | None = None
    reference_adapter: str | None = None
    base: str = ""  # the base model's path or name, to tell whether another adapter shares it


def load_trainable_lm(name_or_path: str, tokenizer, lora: LoraSpec | None, dtype: str = "float32",
                      trust_remote_code: bool = False) -> TrainableLM:
    """The model a stage trains: every weight (`lora` None), or a LoRA adapter on a frozen base.

    Starting from a LoRA adapter directory, that adapter goes on training (its own r, alpha and
    targets win over `lora`'s) and a frozen copy of it is kept as "reference", so the reference
    is the starting model itself, not the bare base.
    """
    if lora is None:
        return TrainableLM(load_causal_lm(name_or_path, tokenizer, dtype, trust_remote_code),
                           base=local_or_hub(name_or_path))
    if is_adapter(name_or_path):
        base, base_name = load_adapter_base(name_or_path, tokenizer, dtype, trust_remote_code)
        peft = load_adapter(base, local_or_hub(name_or_path), TRAINED)
        load_adapter(peft, local_or_hub(name_or_path), "reference")
        reference = "reference"
    else:
        base_name = name_or_path
        base = load_causal_lm(name_or_path, tokenizer, dtype, trust_remote_code)
        peft = add_adapter(base, lora, TRAINED)
        reference = None
    set_trainable(peft, [TRAINED])
    return TrainableLM(peft.get_base_model(), peft, reference, base=local_or_hub(base_name))
