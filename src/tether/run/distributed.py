"""Data parallelism on torch.distributed: the process group, the model wrapper, global statistics.

Under `torchrun --nproc-per-node N` every rank runs the same loop on its own slice of each global
batch. The pieces here keep that loop equal to the one-process loop at the same global batch:

- `setup` joins the process group torchrun describes in the environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR/PORT): gloo on CPU, nccl on CUDA, one device per rank. Outside torchrun
  it returns the one-process `Dist` and nothing here communicates.
- `wrap` puts a model under DDP (replicated; gradients all-reduced in buckets) or FSDP2
  (`fully_shard` on each transformer layer and the root: parameters, gradients and optimizer
  state sharded). The wrapper is a `Parallel` module whose forward runs any function of the inner
  model, `parallel(fn, *args)` = `fn(model, *args)`: the loops compute log-probs through the trunk
  and the LM head separately (chunked head), generate token by token, and switch LoRA adapters,
  none of which is one `model(...)` call; running them inside the wrapper's forward is what lets
  DDP prepare its gradient reduction and FSDP2 gather the root's parameters.
- Gradients: DDP and FSDP2 average over ranks. Every loss in tether is a sum over the step's rows
  or tokens divided by the step's global count (`global_sum`), so each rank multiplies its part by
  `world_size` (`Dist.grad_scale`) and the averaged gradient is the one-process gradient.
- Statistics that shape an update (token counts, loss means, score normalisation, whitening, the
  KL fed to the controller) go through `all_reduce_sum` / `global_mean` / `all_gather_rows`; with
  one process they return their input.
- Only rank 0 writes (`Dist.is_main`); checkpoints hold full (unsharded) tensors, so a run
  resumes at any world size.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tether.errors import TetherError

TIMEOUT_S = 600  # a rank stuck this long in a collective fails instead of hanging forever


@dataclass(frozen=True)
class Dist:
    """Where this process sits: `rank` of `world_size`, its `device`, and the wrapping mode."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    fsdp: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True under torchrun with more than one rank (collectives communicate)."""
        return self.world_size > 1

    @property
    def grad_scale(self) -> float:
        """Factor on each rank's loss so the wrapper's gradient average is the global sum."""
        return float(self.world_size)


def launched() -> bool:
    """True when torchrun (or another launcher) set the distributed environment."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def setup(device: torch.device, fsdp: bool = False, timeout_s: int = TIMEOUT_S) -> Dist:
    """Join torchrun's process group (once) and return this rank's `Dist`.

    `device` is the resolved `--device`; on CUDA each rank takes `cuda:LOCAL_RANK`. Outside
    torchrun: the one-process `Dist` (and `--fsdp` is refused: FSDP2 needs a process group).
    """
    if not launched():
        if fsdp:
            raise TetherError("--fsdp needs several processes: launch with torchrun "
                              "--nproc-per-node N (or drop --fsdp)")
        return Dist(device=device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # torch.distributed.nn.functional binds `group.WORLD` into its functions' defaults when
        # first imported (torch._dynamo imports it, DDP imports that). Imported after the group
        # exists, it keeps the group alive past `teardown`, and with it gloo's worker threads,
        # until interpreter exit; a worker still letting go of the last collective's tensors
        # then needs the GIL while the interpreter finalizes and aborts the rank ("terminate
        # called without an active exception"), after all its work. Imported first, it binds None.
        importlib.import_module("torch.distributed.nn.functional")

        # CUDA: NCCL for tensors on the GPU, gloo for the CPU tensors of the statistics helpers
        # below (counts, global sums), which NCCL alone would refuse.
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    **({"device_id": device} if device.type == "cuda" else {}))
        except (RuntimeError, ValueError) as exc:  # DistNetworkError and friends are RuntimeErrors
            reason = (str(exc).splitlines() or [""])[0][:160]
            raise TetherError(f"rank {rank} cannot reach the other ranks at "
                              f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                              f"({reason}); check --master-addr/--master-port and the network"
                              ) from None
    return Dist(rank=rank, world_size=world, device=device, fsdp=fsdp)


def teardown() -> None:
    """Leave the process group (at the end of a run, and after an error: no rank left waiting).

    After a DDP run the group's last reference goes here, not at interpreter exit: a model
    wrapper (DDP holds the group) left in a reference cycle is collected now, and the group's
    destructor joins its gloo worker threads. See `setup` for why a worker alive at exit can
    abort a finished rank; FSDP2's DTensor keeps the group anyway, hence `exit_process`.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def exit_process(code: int) -> NoReturn:
    """End this rank with `code`: what interpreter exit runs first (non-daemon threads joined,
    `atexit` handlers, standard streams flushed), then `os._exit`, without the finalization.

    A rank that used a process group can abort in finalization after finishing all its work:
    gloo's worker threads can outlive `teardown` (FSDP2's DTensor keeps the group in its
    sharding caches), and a worker still letting go of the last collective's tensors needs the
    GIL, which a finalizing interpreter answers by ending the thread inside a C++ destructor:
    "terminate called without an active exception", SIGABRT, and torchrun fails the whole job
    (`bench/scale/torchrun_exit.py` counts it; docs/scaling.md has the figures). The `tether`
    command ends every torchrun rank here; a script of your own that runs a stage under torchrun
    can too. tether's own files are closed by then (run directories write each line in a `with`).
    """
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own exit step; a tracker's upload may be waiting here
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to keep
            stream.flush()
    os._exit(code)


def current() -> Dist:
    """The `Dist` of an already joined group (rank and size only), or the one-process one."""
    if dist.is_available() and dist.is_initialized():
        return Dist(rank=dist.get_rank(), world_size=dist.get_world_size())
    return Dist()


def on_device(device: torch.device) -> Dist:
    """`current()` on `device`: a tool that runs frozen models where it was started."""
    return replace(current(), device=device)


# ----------------------------------------------------------------------------- statistics

def all_reduce_sum(t: torch.Tensor, d: Dist | None = None) -> torch.Tensor:
    """Sum of `t` over ranks (a new tensor; `t` itself is unchanged). No grad flows through."""
    d = d or current()
    out = t.detach().clone()
    if d.active:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def global_sum(x: float | int, d: Dist | None = None) -> float:
    """A Python number summed over ranks (token counts, row counts, loss parts)."""
    return float(all_reduce_sum(torch.tensor(float(x), dtype=torch.float64), d))


def global_max(x: int, d: Dist | None = None) -> int:
    """A Python integer's maximum over ranks (the rollout width every rank pads to)."""
    d = d or current()
    out = torch.tensor(int(x), dtype=torch.int64)
    if d.active:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out)


def global_mean(total: float, count: float, d: Dist | None = None) -> float:
    """sum_r total_r / sum_r count_r: a mean over all ranks' rows, not a mean of rank means."""
    both = all_reduce_sum(torch.tensor([float(total), float(count)], dtype=torch.float64), d)
    return float(both[0] / both[1].clamp(min=1.0))


def all_gather_rows(t: torch.Tensor, d: Dist | None = None) -> torch.Tensor:
    """Concatenate every rank's `t` along dim 0 in rank order (the global batch's row order).

    Ranks may hold different numbers of rows (a short last batch); the other dims must agree.
    A bool tensor travels as uint8 (gloo has no bool)."""
    d = d or current()
    if not d.active:
        return t
    if t.dtype == torch.bool:
        return all_gather_rows(t.to(torch.uint8), d).bool()
    counts = [torch.zeros((), dtype=torch.long) for _ in range(d.world_size)]
    dist.all_gather(counts, torch.tensor(t.shape[0], dtype=torch.long))
    most = int(max(counts))
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t.detach()
    parts = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts, strict=True)])


def broadcast_object(obj: Any, d: Dist | None = None) -> Any:
    """Rank 0's `obj` on every rank (a decision only rank 0 can take, e.g. after reading files)."""
    d = d or current()
    if not d.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(items: list[Any], d: Dist | None = None) -> list[Any]:
    """Every rank's list `items` joined in rank order, on every rank (e.g. the texts of each
    rank's rows of a global batch)."""
    d = d or current()
    if not d.active:
        return list(items)
    box: list[Any] = [None] * d.world_size
    dist.all_gather_object(box, list(items))
    return [item for part in box for item in part]


def gather_objects(obj: Any, d: Dist | None = None) -> list[Any] | None:
    """Every rank's `obj` on rank 0, in rank order (None on the other ranks); `[obj]` alone."""
    d = d or current()
    if not d.active:
        return [obj]
    box: list[Any] | None = [None] * d.world_size if d.is_main else None
    dist.gather_object(obj, box, dst=0)
    return box


def all_agree(flag: bool, d: Dist | None = None) -> bool:
    """True on every rank iff `flag` is true on every rank (e.g. "my step was finite")."""
    return global_sum(0.0 if flag else 1.0, d) == 0.0


def barrier(d: Dist | None = None) -> None:
    d = d or current()
    if d.active:
        dist.barrier()


# ----------------------------------------------------------------------------- models

class Parallel(nn.Module):
    """The module DDP or FSDP2 wraps: `self(fn, *args, **kw)` runs `fn(self.module, *args, **kw)`
    inside the wrapper's forward (see the module docstring for why)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return fn(self.module, *args, **kwargs)


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the members of the longest `nn.ModuleList`
    (GPT-2's `h`, Llama's `layers`; with peft the same list under its wrappers), and of every
    other list as long (several models under one wrapper: PPO's policy, critic, reference)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    longest = max((len(m) for m in lists), default=0)
    return [layer for m in lists if len(m) == longest > 0 for layer in m]


def wrap(model: nn.Module, d: Dist) -> nn.Module:
    """`model` under DDP or, with `d.fsdp`, FSDP2; unchanged (inside `Parallel`) for one process.

    The returned module is called as `wrapped(fn, *args)`. Frozen parameters (a LoRA base, a
    frozen reference inside the same model) are not reduced by DDP; FSDP2 shards them too.
    """
    inner = Parallel(model)
    if not d.active:
        return inner
    if d.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(d.device.type, (d.world_size,))
        for layer in transformer_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(inner, mesh=mesh)
        _say_layout(inner, d, "FSDP2")
        return inner
    ids = [d.device.index] if d.device.type == "cuda" else None
    wrapped = DistributedDataParallel(inner, device_ids=ids)
    _say_layout(inner, d, "DDP")
    return wrapped


def wrap_frozen(model: nn.Module, d: Dist) -> nn.Module:
    """A model that is only scored with (a reference, a reward model) in the form the loops call
    it, `wrapped(fn, *args)`: sharded under FSDP2 like the trained one (it would not fit either),
    plain otherwise (DDP has nothing to reduce for it and refuses a model without gradients)."""
    return wrap(model, d) if d.fsdp else Parallel(model)


def _say_layout(model: nn.Module, d: Dist, mode: str) -> None:
    """Rank 0's start-up line: the mode and the share of the parameters it holds, measured on
    the wrapped model (so a run asked for --fsdp that replicated instead shows it).

    The share is local / total with local = sum over parameters of the rank's own elements: an
    FSDP2 parameter is a DTensor whose `to_local()` is this rank's shard (~1 / world_size of it),
    a DDP or single-process parameter is whole (share 1).
    """
    from torch.distributed.tensor import DTensor

    if d.is_main:
        local = total = 0
        for param in model.parameters():
            total += param.numel()
            local += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
        print(f"{mode} over {d.world_size} ranks: rank 0 holds {local / max(total, 1):.2f} of "
              f"{total:,} parameters", flush=True)


def unwrap(wrapped: nn.Module) -> nn.Module:
    """The user's model inside `wrap`'s result, a DDP or `Parallel` wrapper (a plain module as it
    is): for saving, LoRA adapters, config; its parameter names are the one-process names, the
    same at every world size."""
    inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
    return inner.module if isinstance(inner, Parallel) else inner


@contextlib.contextmanager
def no_sync(wrapped: nn.Module, skip: bool) -> Iterator[None]:
    """Skip the gradient reduction of this backward when `skip` (all but the last micro-batch of
    an accumulated step: the reduction of the summed gradients happens once, at the last)."""
    if skip and hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
    elif skip and hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dict(wrapped: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """The unwrapped model's full state dict on the CPU (rank 0 gets it; with FSDP2 every rank
    must call this: it gathers the shards). Keys are those of `unwrap(wrapped).state_dict()`."""
    model = unwrap(wrapped)
    if not d.fsdp:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
