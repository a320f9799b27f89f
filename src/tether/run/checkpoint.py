"""Training checkpoints (weights, optimizer, scheduler, RNG, trainer state, the run's config).

A checkpoint is a whole directory written under a temp name and renamed to `step_<N>` only once
complete (`tether.run.atomic`, which also holds the atomic file writes). Weights
are safetensors; optimizer and scheduler state use `torch.save` and are read back with
`weights_only=True`.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save
from torch import nn

from tether.errors import TetherError
from tether.run import distributed
from tether.run.atomic import atomic_dir, read_record
from tether.run.distributed import unwrap

STEP_PREFIX = "step_"
TEMP_PREFIX = ".tmp-"  # a checkpoint being written; one left behind was cut off by a kill


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python, NumPy and torch RNG states as (JSON-safe dict, tensors)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return meta, {"torch_cpu": torch.get_rng_state()} | {f"torch_cuda_{i}": state
                                                          for i, state in enumerate(cuda)}


def set_rng_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def require_finite_weight(what: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse to save a weight holding NaN or inf: such a model is lost, and a checkpoint of it
    would only be resumed into more NaN."""
    if not bool(torch.isfinite(tensor).all()):
        raise TetherError(f"{what} has non-finite weights ({name}); nothing was saved over the "
                          "last good checkpoint. Lower the learning rate or clip gradients "
                          "harder, then --resume")


def check_finite_weights(model: nn.Module, what: str) -> None:
    """`require_finite_weight` on every weight of `model` that training writes (all of them when
    none is frozen; a frozen LoRA base is not checked)."""
    # A parameter that takes no gradient (a LoRA base) is frozen: such a model's checkpoint, like
    # every model's, holds its trainable tensors only (the frozen base is reloaded from its source).
    frozen = any(not p.requires_grad for p in model.parameters())
    for name, param in model.named_parameters():
        if param.requires_grad or not frozen:
            require_finite_weight(what, name, param.detach())


def remove_temp_dirs(directory: str | Path) -> list[Path]:
    """Delete the temporary directories a killed run left in `directory` (a checkpoint cut off
    mid-write, `.tmp-step_N-*`, or a final model, `.final.tmp-*`); returns what was removed."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir()
               if p.is_dir() and p.name.startswith(".") and TEMP_PREFIX in p.name]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def reshard(model: nn.Module) -> nn.Module:
    """Put every FSDP2 unit in `model` back to its sharded parameters. FSDP2 keeps the root unit
    gathered after a forward (its backward would need it again), so after a no-grad forward
    (evaluation, a reference pass) the module holds plain gathered tensors, not the shards the
    optimizer steps, until the next backward. No-op without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor) all-gathered (every rank calls this, in the same order); a
    plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def placed_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor as `param` holds it: this rank's own part under FSDP2 (no communication),
    else `value` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value


def trainable_tensors(model: nn.Module, keep: bool, what: str) -> dict[str, torch.Tensor]:
    """The parameters that take gradients, by name, as whole tensors on the CPU (each shared
    tensor once). Under FSDP2 the shards are gathered: every rank calls this, and a rank with
    `keep` False gets {} (no whole CPU copy of the model on every rank). A tensor holding NaN or
    inf raises the same TetherError on every rank (each sees the whole tensor)."""
    out = {}
    for name, param in unwrap(reshard(model)).named_parameters():
        if not param.requires_grad:
            continue
        full = whole(param.detach())  # every rank gathers a shard, in the same order
        require_finite_weight(what, name, full)
        if keep:
            out[name] = full.contiguous().cpu()
    return out


def load_trainable_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy whole `tensors` into the trainable parameters of `model` (each FSDP2 shard takes its
    own part, no communication); the names must match exactly (`_read_checkpoint` checked them,
    on every rank, before anything is restored)."""
    params = {name: p for name, p in unwrap(reshard(model)).named_parameters()
              if p.requires_grad}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(placed_like(tensors[name].to(param.dtype), param))


def _optimizer_owner(models: dict[str, nn.Module]) -> nn.Module:
    """One module holding every model under its checkpoint name: optimizer state is keyed by
    parameter name through it (`policy.transformer.h.0...`), not by position."""
    return nn.ModuleDict({name: unwrap(reshard(m)) for name, m in models.items()})


def optimizer_state(models: dict[str, nn.Module], optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole tensors on the CPU: the same file at
    any world size, with DDP or FSDP2 (torch.distributed.checkpoint's full optimizer state dict;
    under FSDP2 every rank calls this and rank 0 receives the state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(_optimizer_owner(models), optimizer,
                                    options=StateDictOptions(full_state_dict=True,
                                                             cpu_offload=True))


def load_optimizer_state(models: dict[str, nn.Module], optimizer, state: dict[str, Any]) -> None:
    """Restore `optimizer_state`'s output on every rank (FSDP2 ranks keep their own shards)."""
    if any(isinstance(k, int) for k in state.get("state", {})):  # a checkpoint from before names
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(_optimizer_owner(models), optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first; temp dirs are ignored."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted((int(path.name[len(STEP_PREFIX):]), path) for path in root.iterdir()
                  if path.is_dir() and path.name.startswith(STEP_PREFIX)
                  and path.name[len(STEP_PREFIX):].isdigit())


def save_checkpoint(ckpt_root: str | Path, step: int, models: dict[str, nn.Module], optimizer,
                    scheduler, state: dict[str, Any], keep: int = 2,
                    config: dict[str, Any] | None = None,
                    tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `ckpt_root/step_<step>/` atomically and keep only the newest `keep` checkpoints.

    Contents: `<name>.safetensors` per model (its trainable parameters, whole tensors, by their
    one-process names), `optimizer.pt` (state keyed by parameter name), `scheduler.pt`,
    `rng.safetensors`, and `state.json` (the trainer's `state`, the RNG metadata, and `config`:
    the run's recorded config, so a resume can be checked even without config.yaml); and
    `tensors.safetensors` when the trainer has other `tensors` to keep (rank 0's). Nothing but
    the RNG states depends on the world size, so a run resumes on any number of ranks.

    Under torchrun every rank calls this (FSDP2 gathers the shards); rank 0 alone writes, and
    every rank returns once the checkpoint is complete. `models` may be wrapped (DDP, FSDP2).
    Each rank's RNG state is kept (rank r's as `rank<r>/...` tensors and `rng_ranks[r - 1]`):
    dropout draws as many numbers as its tensor has elements, so ranks with rows of other
    lengths end a step with other states, and only their own make a resume bit-exact.
    """
    d = distributed.current()
    # every rank gathers and checks the same tensors (one error on all); rank 0 keeps them
    weights = {name: trainable_tensors(model, keep=d.is_main, what=f"the {name} at step {step}")
               for name, model in models.items()}
    optim = optimizer_state(models, optimizer) if optimizer is not None else None
    rngs = distributed.gather_objects(rng_state(), d)  # [(meta, tensors)] by rank, on rank 0
    if d.is_main:
        rng_tensors = dict(rngs[0][1])
        for rank, (_, tensors) in enumerate(rngs[1:], start=1):
            rng_tensors |= {f"rank{rank}/{key}": value for key, value in tensors.items()}
        payload = {"step": step, "state": state, "config": config, "world_size": d.world_size,
                   "rng": rngs[0][0], "rng_ranks": [meta for meta, _ in rngs[1:]]}
        _write_checkpoint(Path(ckpt_root), step, weights | ({"tensors": tensors} if tensors else {}),
                          optim, scheduler, rng_tensors, payload, keep)
    distributed.barrier(d)
    return Path(ckpt_root) / f"{STEP_PREFIX}{step}"


def _write_checkpoint(root: Path, step: int, weights: dict[str, dict[str, torch.Tensor]], optim,
                      scheduler, rng_tensors: dict[str, torch.Tensor], payload: dict[str, Any],
                      keep: int) -> None:
    out = root / f"{STEP_PREFIX}{step}"
    with atomic_dir(out, prefix=f"{TEMP_PREFIX}{STEP_PREFIX}{step}-") as tmp:
        for name, tensors in weights.items():
            (tmp / f"{name}.safetensors").write_bytes(save(tensors))
        if optim is not None:
            torch.save(optim, tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "rng.safetensors").write_bytes(save(rng_tensors))
        (tmp / "state.json").write_text(json.dumps(payload), encoding="utf-8")
    for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load_latest_checkpoint(ckpt_root: str | Path, models: dict[str, nn.Module], optimizer,
                           scheduler) -> dict[str, Any] | None:
    """Restore the newest intact checkpoint into `models`, `optimizer`, `scheduler` and the RNGs.

    A damaged checkpoint (truncated weights, a garbage optimizer file, a cut `state.json`: a disk
    that filled up, a copy that broke off), or one whose tensors do not match the models, is
    skipped with one line on stderr, and the one before it is used. Every file is read before
    anything is restored, so nothing of a damaged checkpoint reaches the models.

    Under torchrun every rank calls this and reads the same files (the run directory must be
    visible to every rank, e.g. a shared filesystem across machines); rank 0 chooses the
    checkpoint, every rank restores it (FSDP2: each its own shards), and every rank's RNGs take
    its own saved state when the world size is the one that wrote it (`own_rng_state`), rank 0's
    otherwise. Returns the trainer `state` saved with it (with `step` added, and `tensors`: the
    other tensors saved with it, when there are any), or None when there is none.
    """
    d = distributed.current()
    # rank 0's view decides (another node may not see the directory: that is an error below)
    found = distributed.broadcast_object(list_checkpoints(ckpt_root) if d.is_main else None, d)
    if not found:
        return None
    chosen, contents = None, None
    for index in reversed(range(len(found))) if d.is_main else ():
        try:
            contents = _read_checkpoint(found[index][1], models, optimizer, scheduler)
            chosen = index
            break
        except Exception as exc:  # noqa: BLE001 - any failure to read it means it is unusable
            reason = (str(exc).splitlines() or [""])[0][:200]
            print(f"warning: checkpoint {found[index][1]} is damaged ({type(exc).__name__}: "
                  f"{reason}); falling back to the one before it", file=sys.stderr)
    chosen = distributed.broadcast_object(chosen, d)
    if chosen is None:
        raise TetherError(f"no checkpoint in {ckpt_root} can be read (all {len(found)} are "
                          "damaged); delete the directory to start the run afresh")
    if contents is None:  # the other ranks read what rank 0 chose
        try:
            contents = _read_checkpoint(found[chosen][1], models, optimizer, scheduler)
        except (OSError, RuntimeError, ValueError) as exc:
            raise TetherError(f"rank {d.rank} cannot read the checkpoint {found[chosen][1]} that "
                              f"rank 0 chose ({type(exc).__name__}); on several machines the run "
                              "directory must be on a filesystem every node sees") from None
    for name, model in models.items():
        load_trainable_tensors(model, contents["weights"][name])
    if optimizer is not None:
        load_optimizer_state(models, optimizer, contents["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(contents["scheduler"])
    payload = contents["payload"]
    set_rng_state(*own_rng_state(payload, contents["rng"], d.rank, d.world_size))
    state = dict(payload["state"])
    state.setdefault("step", payload["step"])
    if contents["tensors"]:
        state["tensors"] = contents["tensors"]
    return state


def own_rng_state(payload: dict[str, Any], tensors: dict[str, torch.Tensor], rank: int,
                  world_size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(meta, tensors) of `rank`'s RNG state in a checkpoint written at `world_size` ranks; at
    another world size (or from a checkpoint that kept rank 0's alone) rank 0's, for every rank:
    the ranks' rows, hence their dropout draws, differ from the uninterrupted run's anyway."""
    ranks = payload.get("rng_ranks") or []
    if rank == 0 or len(ranks) + 1 != world_size:
        return payload["rng"], {k: v for k, v in tensors.items() if "/" not in k}
    prefix = f"rank{rank}/"
    return ranks[rank - 1], {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def recorded_config(ckpt_root: str | Path) -> dict[str, Any] | None:
    """The config the newest checkpoint in `ckpt_root` whose `state.json` can be read records;
    None when there is no checkpoint, {} when it records none (written before tether did)."""
    for _, path in reversed(list_checkpoints(ckpt_root)):
        payload = read_record(path / "state.json", json.loads)
        if payload is None:
            continue  # damaged: the resume falls back past it too
        config = payload.get("config") if isinstance(payload, dict) else None
        return config if isinstance(config, dict) else {}
    return None


def _read_checkpoint(path: Path, models: dict[str, nn.Module], optimizer, scheduler
                     ) -> dict[str, Any]:
    """Every file of one checkpoint that the caller restores, read, and the weights checked
    against `models`' trainable parameters."""
    payload = json.loads((path / "state.json").read_text(encoding="utf-8"))
    weights = {name: load_file(str(path / f"{name}.safetensors")) for name in models}
    for name, model in models.items():
        names = {n for n, p in unwrap(model).named_parameters() if p.requires_grad}
        if names != set(weights[name]):
            missing, extra = sorted(names - set(weights[name])), sorted(set(weights[name]) - names)
            raise RuntimeError(f"checkpoint does not match the model's trainable parameters "
                               f"(missing {missing[:3]}, unexpected {extra[:3]})")
    extra = path / "tensors.safetensors"
    return {"payload": payload, "weights": weights,
            "tensors": load_file(str(extra)) if extra.exists() else {},
            "rng": load_file(str(path / "rng.safetensors")),
            "optimizer": None if optimizer is None else
            torch.load(path / "optimizer.pt", weights_only=True),
            "scheduler": None if scheduler is None else
            torch.load(path / "scheduler.pt", weights_only=True)}
