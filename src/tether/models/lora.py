"""LoRA adapters (peft) on one frozen base, and the views that let several roles share that base.

A LoRA layer replaces W x by W x + (alpha / r) * B A x with A [r, d_in], B [d_out, r] trained and W
frozen (Hu et al. 2021, "LoRA", eq. 3). B starts at zero, so a fresh adapter leaves the model's
outputs exactly unchanged. tether keeps one base in memory and gives each role an adapter on it:

    role        adapter on the shared base          trainable
    policy      "default"                           yes
    reference   none (adapters disabled), or        no
                "reference" when training starts from a LoRA SFT adapter
    critic      "critic" (+ its own value head)     yes
    reward      "reward" (+ its scalar head)        no

When training starts from a LoRA adapter (say a LoRA SFT run), that adapter is loaded twice: as
"default", which goes on training, and as the frozen "reference". The reference is then the SFT
model itself, never the bare base (a reference without the SFT delta starts the KL far from zero).

Roles other than the policy see the shared model through an `AdapterView`, which switches the
active adapter around its own forward pass and restores the policy's afterwards. Switching sets
peft's per-layer `_active_adapter` / `_disable_adapters` directly: peft's own `set_adapter` and
`disable_adapter` also flip `requires_grad`, which would freeze the critic while the policy runs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tether.errors import TetherError
from tether.models.adapter_checks import ADAPTER_CONFIG, adapter_load_error
from tether.models.base_location import resolve_base

TRAINED = "default"  # the adapter a stage trains; peft saves "default" at the directory's root


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings of a run (`--lora-r`, `--lora-alpha`, `--lora-dropout`,
    `--lora-target-modules`)."""

    r: int
    alpha: float
    dropout: float
    target_modules: str

    @classmethod
    def from_config(cls, cfg) -> LoraSpec | None:
        """None when the run trains every weight (`lora_r` = 0)."""
        if not cfg.lora_r:
            return None
        return cls(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)

    def peft_config(self, model: nn.Module):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=resolve_targets(model, self.target_modules), bias="none")


def is_adapter(path: str | Path) -> bool:
    """True for a directory holding a PEFT adapter (`adapter_config.json`)."""
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path, base: str = "") -> str:
    """The base model to load under the adapter directory `path`: `base` when given (--base),
    else where the adapter's records say it is now (`base_location.resolve_base`)."""
    return resolve_base(path, base)


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (e.g. q_proj, c_attn, lm_head): the
    names `--lora-target-modules` accepts."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    types = (nn.Linear, Conv1D)
    # A layer that already carries an adapter (a second role's adapter on a shared base, e.g. the
    # critic's beside the policy's) is a peft layer holding the linear as `base_layer`.
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and name.rsplit(".", 1)[-1] != "base_layer"
                   and isinstance(getattr(module, "base_layer", module), types)})


def resolve_targets(model: nn.Module, target_modules: str) -> str | list[str]:
    """`all-linear` as is (every linear layer of the trunk, peft's rule: not the output layer),
    or the comma-separated names, each checked to match a linear layer of `model`."""
    names = [n.strip() for n in target_modules.split(",") if n.strip()]
    if names == ["all-linear"]:
        return "all-linear"
    if not names:
        raise TetherError("--lora-target-modules is empty; pass all-linear or layer names")
    known = linear_layer_names(model)
    missing = [n for n in names if n not in known]
    if missing:
        raise TetherError(f"--lora-target-modules {', '.join(missing)} matches no linear layer of "
                          f"the model; its linear layers are: {', '.join(known)}")
    return names


# ----------------------------------------------------------------------------- building


def add_adapter(model: nn.Module, spec: LoraSpec, name: str = TRAINED):
    """A fresh adapter `name` (B = 0: outputs unchanged) on `model`; returns the PeftModel.

    `model` is a transformers model (wrapped now) or a PeftModel (the adapter is added to it).
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        model.add_adapter(name, spec.peft_config(model.get_base_model()))
        return model
    with peft_quietly():
        return get_peft_model(model, spec.peft_config(model), adapter_name=name)


@contextlib.contextmanager
def peft_quietly():
    """Wrapping a model, peft reads its `is_gradient_checkpointing`, which transformers has
    deprecated: the FutureWarning is about peft's code, not the user's, and would print on every
    LoRA load, so it is not shown (other warnings are)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        yield


def load_adapter(model: nn.Module, adapter_dir: str | Path, name: str):
    """Load a saved adapter as `name` into `model` (wrapping a plain model); returns the PeftModel.

    Its files are the caller's to check first (`adapter_checks.check_adapter_files`); an adapter
    that does not fit the model (another architecture, other shapes) is one TetherError line."""
    from peft import PeftModel

    try:
        if isinstance(model, PeftModel):
            model.load_adapter(str(adapter_dir), adapter_name=name)
            return model
        with peft_quietly():
            return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=name)
    except (RuntimeError, ValueError) as exc:
        base_name = getattr(getattr(model, "config", None), "_name_or_path", "") or "its base"
        error = adapter_load_error(exc, adapter_dir, base_name)
        if error is exc:
            raise
        raise error from None


def set_trainable(model: nn.Module, adapters: Iterable[str]) -> None:
    """Gradients on the LoRA weights of `adapters` only; the base and every other adapter are
    frozen. Modules outside the peft model (heads) are the caller's to set."""
    keys = tuple(f".{name}." for name in adapters)
    for param_name, param in model.named_parameters():
        param.requires_grad_(any(key in param_name for key in keys))


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _layer_state(layers: list[nn.Module]) -> list[tuple[object, bool]]:
    return [(layer._active_adapter, layer._disable_adapters) for layer in layers]


@contextlib.contextmanager
def _layers_in(layers: list[nn.Module], state: list[tuple[object, bool]]) -> Iterator[None]:
    """Run the block with each layer's (active adapter, adapters disabled) set to `state`, then
    put back what they were."""
    saved = _layer_state(layers)
    try:
        for layer, (active, disabled) in zip(layers, state, strict=True):
            layer._active_adapter, layer._disable_adapters = active, disabled
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved, strict=True):
            layer._active_adapter, layer._disable_adapters = active, disabled


@contextlib.contextmanager
def use_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run the block with adapter `name` active on every LoRA layer of `model` (None: all adapters
    off, the bare base, each layer's active adapter kept); restore the previous state afterwards.
    `requires_grad` is left alone."""
    layers = _tuner_layers(model)
    state = [(layer._active_adapter, True) if name is None else ([name], False)
             for layer in layers]
    with _layers_in(layers, state):
        yield


def _of_shared(name: str) -> property:
    """A read-only attribute of a view: the shared transformers model's `name` (None when it has
    none, as for a model without a `generation_config`)."""
    return property(lambda view: getattr(view.shared.get_base_model(), name, None))


class AdapterView(nn.Module):
    """One role's view of the shared model: its forward runs with adapter `adapter` (None: the
    base alone), on the whole causal LM (`part="lm"`) or on its trunk (`part="trunk"`, which returns
    the final hidden states, for reward and value heads).

    The shared model is held but not registered as a submodule: its weights belong to the policy,
    so `parameters()`, `state_dict()` and `.to()` of a view see none of them.
    """

    def __init__(self, shared: nn.Module, adapter: str | None, part: str = "lm"):
        super().__init__()
        if part not in ("lm", "trunk"):
            raise ValueError(f"part must be 'lm' or 'trunk', got {part!r}")
        self.__dict__["shared"] = shared  # a plain attribute, not a submodule
        self.adapter = adapter
        self.part = part

    def _target(self) -> nn.Module:
        lm = self.shared.get_base_model()  # the transformers model with LoRA layers injected
        return lm.base_model if self.part == "trunk" else lm

    # what callers read off a model, read off the shared transformers model
    config = _of_shared("config")
    generation_config = _of_shared("generation_config")
    dtype = _of_shared("dtype")
    device = _of_shared("device")
    get_input_embeddings = _of_shared("get_input_embeddings")
    get_output_embeddings = _of_shared("get_output_embeddings")

    def forward(self, *args, **kwargs):
        with use_adapter(self.shared, self.adapter):
            return self._target()(*args, **kwargs)

    def tether_trunk_and_head(self):
        """(trunk, head) for the chunked LM head: the trunk runs under this view's adapter; the
        head is wrapped the same way only when LoRA layers sit on it."""
        from tether.models.trunk_head import trunk_and_head

        trunk = AdapterView(self.shared, self.adapter, part="trunk")
        # The base's own split: it applies any logit transform (softcapping, scaling) and checks
        # head(trunk(x)) against the model's logits once.
        _, head = trunk_and_head(self.shared.get_base_model())
        if _tuner_layers(head):
            head = _HeadView(self.shared, self.adapter, head)
        return trunk, head


class _HeadView(AdapterView):
    """An LM head with LoRA layers, run under one adapter: an `AdapterView` whose target is the
    head (held, like the shared model, as a plain attribute)."""

    def __init__(self, shared: nn.Module, adapter: str | None, head: nn.Module):
        super().__init__(shared, adapter)
        self.__dict__["head"] = head

    def _target(self) -> nn.Module:
        return self.head


# ----------------------------------------------------------------------------- checkpointing


def adapter_recompute_context(model: nn.Module):
    """A `context_fn` for non-reentrant activation checkpointing: the recomputation in the
    backward pass runs under the adapter that was active in the forward pass.

    Without it, a critic layer checkpointed under the "critic" adapter would be recomputed under
    whatever adapter is active when `backward()` runs (the policy's), and get wrong gradients.
    """
    def context_fn():
        layers = _tuner_layers(model)
        return contextlib.nullcontext(), _layers_in(layers, _layer_state(layers))
    return context_fn


def check_targets(name_or_path: str, lora: LoraSpec | None, trust_remote_code: bool = False) -> None:
    """Check `--lora-target-modules` against the model's layers before anything is written: the
    model is built from its config on the meta device (no weights are read). An adapter directory
    brings its own targets and is not checked."""
    if lora is None or is_adapter(name_or_path):
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return  # the model load that follows reports it in its own words
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    resolve_targets(model, lora.target_modules)
