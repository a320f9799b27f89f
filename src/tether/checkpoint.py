"""Atomic writes and training checkpoints (weights, optimizer, scheduler, RNG, trainer state).

A crash mid-write must never leave a half-written file where a good one was: every file goes to a
temp name in the same directory, is fsynced, then `os.replace`d; a checkpoint is a whole directory
written under a temp name and renamed to `step_<N>` only once complete. Weights are safetensors;
optimizer and scheduler state use `torch.save` and are read back with `weights_only=True`.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save, save_model
from torch import nn

from tether.errors import TetherError

STEP_PREFIX = "step_"
TEMP_PREFIX = ".tmp-"  # a checkpoint being written; one left behind was cut off by a kill


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a fully written `tmp` directory to `out`: fsync its files, rename, fsync the parent.

    An old `out` is moved aside first and deleted only once the new one is in place, so a crash
    leaves either the old directory or the new one, never a half-written one.
    """
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Save tensors as safetensors, atomically."""
    atomic_write_bytes(path, save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write JSON, atomically."""
    atomic_write_bytes(path, json.dumps(obj, indent=2).encode("utf-8"))


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python, NumPy and torch RNG states as (JSON-safe dict, tensors)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    return meta, tensors


def set_rng_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def check_finite_weights(model: nn.Module, what: str) -> None:
    """Refuse to save weights holding NaN or inf: such a model is lost, and a checkpoint of it
    would only be resumed into more NaN. Frozen weights are not checked (training never writes
    them)."""
    for name, param in model.named_parameters():
        if (param.requires_grad or not has_frozen_parameters(model)) and not bool(
                torch.isfinite(param.detach()).all()):
            raise TetherError(f"{what} has non-finite weights ({name}); nothing was saved over "
                              "the last good checkpoint. Lower the learning rate or clip gradients "
                              "harder, then --resume")


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


def has_frozen_parameters(model: nn.Module) -> bool:
    """True when some parameter takes no gradient (a LoRA base): such a model is checkpointed as
    its trainable tensors only."""
    return any(not p.requires_grad for p in model.parameters())


def trainable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that take gradients, by name, on the CPU (each shared tensor once)."""
    return {name: p.detach().contiguous().cpu() for name, p in model.named_parameters()
            if p.requires_grad}


def load_trainable_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into the trainable parameters of `model`; the names must match exactly."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise RuntimeError(f"checkpoint does not match the model's trainable parameters "
                           f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first; temp dirs are ignored."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
            found.append((int(name[len(STEP_PREFIX):]), path))
    return sorted(found)


def save_checkpoint(ckpt_root: str | Path, step: int, models: dict[str, nn.Module], optimizer,
                    scheduler, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `ckpt_root/step_<step>/` atomically and keep only the newest `keep` checkpoints.

    Contents: `<name>.safetensors` per model, `optimizer.pt`, `scheduler.pt`, `rng.safetensors`,
    and `state.json` (the trainer's `state` plus the RNG metadata).
    """
    for name, model in models.items():
        check_finite_weights(model, f"the {name} at step {step}")
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{STEP_PREFIX}{step}-", dir=root))
    try:
        for name, model in models.items():
            if has_frozen_parameters(model):  # LoRA: the frozen base is reloaded from its source
                (tmp / f"{name}.safetensors").write_bytes(save(trainable_tensors(model)))
            else:
                save_model(model, str(tmp / f"{name}.safetensors"))  # handles tied weights
        if optimizer is not None:
            (tmp / "optimizer.pt").write_bytes(_torch_bytes(optimizer.state_dict()))
        if scheduler is not None:
            (tmp / "scheduler.pt").write_bytes(_torch_bytes(scheduler.state_dict()))
        rng_meta, rng_tensors = rng_state()
        (tmp / "rng.safetensors").write_bytes(save(rng_tensors))
        payload = {"step": step, "state": state, "rng": rng_meta}
        (tmp / "state.json").write_text(json.dumps(payload), encoding="utf-8")
        final = root / f"{STEP_PREFIX}{step}"
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest_checkpoint(ckpt_root: str | Path, models: dict[str, nn.Module], optimizer,
                           scheduler, restore_rng: bool = True) -> dict[str, Any] | None:
    """Restore the newest intact checkpoint into `models`, `optimizer`, `scheduler` and the RNGs.

    A damaged checkpoint (truncated weights, a garbage optimizer file, a cut `state.json`: a disk
    that filled up, a copy that broke off) is skipped with one line on stderr, and the one before
    it is used; loading it overwrites whatever the damaged one had already restored.

    Returns the trainer `state` saved with it (with `step` added), or None when there is none.
    """
    found = list_checkpoints(ckpt_root)
    if not found:
        return None
    for _, path in reversed(found):
        try:
            return _load_checkpoint(path, models, optimizer, scheduler, restore_rng)
        except Exception as exc:  # noqa: BLE001 - any failure to read it means it is unusable
            reason = (str(exc).splitlines() or [""])[0][:200]
            print(f"warning: checkpoint {path} is damaged ({type(exc).__name__}: {reason}); "
                  "falling back to the one before it", file=sys.stderr)
    raise TetherError(f"no checkpoint in {ckpt_root} can be read (all {len(found)} are damaged); "
                      "delete the directory to start the run afresh")


def _load_checkpoint(path: Path, models: dict[str, nn.Module], optimizer, scheduler,
                     restore_rng: bool) -> dict[str, Any]:
    payload = json.loads((path / "state.json").read_text(encoding="utf-8"))
    rng_tensors = load_file(str(path / "rng.safetensors"))
    for name, model in models.items():
        if has_frozen_parameters(model):
            load_trainable_tensors(model, load_file(str(path / f"{name}.safetensors")))
        else:
            load_model(model, str(path / f"{name}.safetensors"), strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if restore_rng:
        set_rng_state(payload["rng"], rng_tensors)
    state = dict(payload["state"])
    state.setdefault("step", payload["step"])
    return state
