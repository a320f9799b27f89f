"""A LoRA adapter directory checked before it is applied, and the record of the base it was
trained on (`tether_base.json`).

peft's adapter directory names its base by path or hub name only (`base_model_name_or_path` in
`adapter_config.json`), so a path that now holds another model, or an edited name, gets the
adapter applied to weights it was never trained with, and peft says nothing when the shapes fit.
Every adapter tether saves carries a record of its base beside `adapter_config.json`:

    tether_base.json
      format          "tether-base-v1"
      base            the base's name as adapter_config.json records it (`base_location`)
      base_absolute,  where a local base was when the adapter was saved: its absolute path,
      base_from_adapter  and its path relative to the adapter directory (`base_location`)
      architecture    its class, e.g. "LlamaForCausalLM"
      dtype           the dtype it was loaded in
      embedding_rows  its input embedding rows, as saved (before tether adds a pad row)
      parameters      its parameter count
      tensors         [name, shape, SAMPLES values] per parameter, in the model's order

The values are read at SAMPLES evenly spaced positions of each flattened weight: a content hash of
every weight would tell two bases apart too, but costs a pass over all of them on every load
(14 GB for a 7B model in bf16), where this reads 8 numbers per tensor (about 2,300 for a 7B
Llama's 291 tensors: milliseconds). Two bases of the same shape (a fine-tune of the other, or
another seed) differ at almost every position of almost every weight, so a sample of each weight
separates them; a weight that a fine-tune left untouched matches, which is the truth.

On load the base is compared with the record, if the adapter has one: the same shapes in the same
order, and values equal (exactly when loaded in the record's dtype; else to the coarser dtype's
rounding, since a bf16 load of a float32 checkpoint rounds every weight). Parameter names are not
compared (a transformers release may rename a module; the weights are what matter). Adapters
without a record (peft's, from the hub) are checked as far as their files allow.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tether.errors import TetherError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "tether_base.json"
RECORD_FORMAT = "tether-base-v1"
SAMPLES = 8  # values read per weight; see the module docstring
RESUME_KEY = "lora_base"  # in a LoRA run's checkpoint state: the record of its base
_ATTRIBUTE = "tether_base_record"  # where a loaded base keeps its record until an adapter is saved


def retarget(adapter_dir: str | Path) -> str:
    """The fix for an adapter applied to a base it was not trained on (docs/loading.md)."""
    return ("pass the model it was trained on with --base PATH (tether eval, generate), or "
            f"re-point the adapter at it: tether set-base {Path(adapter_dir).expanduser()} "
            "--base PATH")


# ----------------------------------------------------------------------------- the files


def check_adapter_files(adapter_dir: str | Path) -> None:
    """Refuse, before any base is read, an adapter directory whose weights are missing, pickled,
    truncated, hold NaN or inf, or disagree with `adapter_config.json`'s rank `r`."""
    adapter_dir = Path(adapter_dir).expanduser()
    damaged = "the adapter directory is damaged: copy it again or train it again"
    config = read_json(adapter_dir / ADAPTER_CONFIG, damaged)
    if not isinstance(config, dict):
        raise TetherError(f"{adapter_dir / ADAPTER_CONFIG} is not a JSON object; {damaged}")
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise TetherError(f"{adapter_dir} holds its weights as adapter_model.bin (a pickle), "
                              "which tether does not load; convert them to "
                              f"{ADAPTER_WEIGHTS} from a trusted copy")
        raise TetherError(f"{adapter_dir} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; the "
                          "adapter directory is incomplete: copy it again, or pass its base model")
    ranks = set()
    for name, tensor in _tensors(weights):
        if not bool(torch.isfinite(tensor).all()):
            raise TetherError(f"{weights} holds NaN or inf ({name}); the adapter is broken (saved "
                              "from a run that diverged, or damaged): use another copy or train "
                              "it again")
        if "lora_A" in name or "lora_embedding_A" in name:
            ranks.add(tensor.shape[0])  # A is [r, d_in] (Hu et al. 2021, eq. 3)
    r = config.get("r")
    plain_lora = config.get("peft_type", "LORA") == "LORA" and not config.get("rank_pattern")
    if plain_lora and isinstance(r, int) and ranks and ranks != {r}:
        found = ", ".join(str(k) for k in sorted(ranks))
        raise TetherError(f"{adapter_dir / ADAPTER_CONFIG} says r={r} but {ADAPTER_WEIGHTS} holds "
                          f"rank-{found} weights; the two files come from different adapters: "
                          "copy the directory again")


def read_json(path: Path, fix: str):
    """The JSON value in `path`; a file that cannot be read (missing, not UTF-8, not JSON) is one
    TetherError line, `cannot read PATH (ERROR TYPE); FIX`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TetherError(f"cannot read {path} ({type(exc).__name__}); {fix}") from None


def _tensors(weights: Path):
    """(name, tensor) for each tensor of a safetensors file, one at a time; a truncated or
    damaged file is one TetherError line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise TetherError(f"cannot read {weights} ({type(exc).__name__}: {first}); the file is "
                          "truncated or damaged: copy the adapter again") from None


# ----------------------------------------------------------------------------- the base's record


def base_record(model: nn.Module, name_or_path: str) -> dict:
    """The record of a base model as loaded from disk (before any pad row is added): see the
    module docstring for its fields."""
    tensors = []
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        flat = param.detach().reshape(-1)  # a view: parameters are contiguous
        n = flat.numel()
        positions = sorted({i * (n - 1) // (SAMPLES - 1) for i in range(SAMPLES)}) if n else []
        values = flat[torch.tensor(positions, dtype=torch.long, device=flat.device)]
        tensors.append([name, list(param.shape), values.float().cpu().tolist()])
    return {"format": RECORD_FORMAT, "base": name_or_path,
            "architecture": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
            "embedding_rows": _rows(model),
            "parameters": sum(p.numel() for p in model.parameters()), "tensors": tensors}


def _rows(model: nn.Module) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return None if embeddings is None else int(embeddings.weight.shape[0])


def remember_base(model: nn.Module, record: dict) -> None:
    """Keep `record` on the loaded base `model`, for the adapters saved from it (`save_adapter`):
    a plain attribute, not a buffer, so no state dict sees it."""
    model.__dict__[_ATTRIBUTE] = record


def remembered_base(model: nn.Module) -> dict | None:
    """The record `remember_base` kept on `model` (a transformers model or a PeftModel over
    one), or None."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return base.__dict__.get(_ATTRIBUTE)


def read_base_record(adapter_dir: str | Path) -> dict | None:
    """The adapter's `tether_base.json`, or None when it has none (peft's adapters)."""
    path = Path(adapter_dir).expanduser() / BASE_RECORD
    if not path.is_file():
        return None
    record = read_json(path, "it is damaged: copy the adapter again (or delete the file to apply "
                             "the adapter unchecked)")
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise TetherError(f"{path} is not a {RECORD_FORMAT} record; copy the adapter again (or "
                          "delete the file to apply the adapter unchecked)")
    return record


def check_base(adapter_dir: str | Path, record: dict, base_name: str) -> None:
    """Refuse `base_name` (whose `base_record` is `record`) as the base of the adapter at
    `adapter_dir` when the adapter's own record names another model; nothing to compare when the
    adapter has no record."""
    saved = read_base_record(adapter_dir)
    if saved is None:
        return
    what = (f"{base_name} is not the model the adapter {Path(adapter_dir).expanduser()} was "
            f"trained on ({saved.get('base')})")
    compare_records(saved, record, what, f"{retarget(adapter_dir)} (or delete {BASE_RECORD} to apply it "
                                         "anyway)")


def compare_records(saved: dict, record: dict, what: str, fix: str) -> None:
    """Refuse `record` (a base as loaded now) where `saved` (the record an adapter or checkpoint
    was made with) says another model: other shapes, or the same shapes with other values
    beyond the two dtypes' rounding. `what` opens the error line, `fix` ends it."""
    shapes = [shape for _, shape, _ in saved.get("tensors", [])]
    if shapes != [shape for _, shape, _ in record["tensors"]]:
        raise TetherError(f"{what}: that was a {_describe(saved)}, this is a {_describe(record)}; "
                          f"{fix}")
    tolerance = _tolerance(saved.get("dtype"), record["dtype"])
    for (name, _, before), (_, _, now) in zip(saved["tensors"], record["tensors"], strict=True):
        if not _close(before, now, *tolerance):
            raise TetherError(f"{what}: the same shapes but other weights ({name} differs), so "
                              "another model (a fine-tune, another seed, or one saved over that "
                              f"path); {fix}")


def _describe(record: dict) -> str:
    return (f"{record.get('architecture')} with {record.get('parameters')} parameters and "
            f"{record.get('embedding_rows')} embedding rows")


def _tolerance(saved_dtype: str | None, dtype: str) -> tuple[float, float]:
    """(relative, absolute) tolerance between the same checkpoint loaded in the two dtypes: none
    in one dtype; else the coarser dtype's rounding (its eps, and its smallest normal number below
    which float16 keeps fewer bits)."""
    if saved_dtype == dtype:
        return 0.0, 0.0
    dtypes = [getattr(torch, name or "", None) for name in (saved_dtype, dtype)]
    infos = [torch.finfo(d if isinstance(d, torch.dtype) else torch.bfloat16) for d in dtypes]
    coarse = max(infos, key=lambda info: info.eps)  # an unknown name: bf16, the coarsest
    return float(coarse.eps), float(coarse.tiny)


def _close(before: list[float], now: list[float], rtol: float, atol: float) -> bool:
    if len(before) != len(now):
        return False
    a, b = torch.tensor(before, dtype=torch.float64), torch.tensor(now, dtype=torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool((both_nan | ((a - b).abs() <= rtol * torch.maximum(a.abs(), b.abs()) + atol)).all())


def check_embedding_rows(adapter_dir: str | Path, model: nn.Module, tokenizer,
                         base_name: str) -> None:
    """A base with fewer embedding rows than the adapter's tokenizer has regular tokens was not
    the adapter's base (its tokenizer came from a model with another vocabulary): growing it
    would give the adapter rows it never saw. For adapters without a record, which
    `check_base` cannot compare."""
    rows, regular = _rows(model), getattr(tokenizer, "vocab_size", None)
    if rows is not None and isinstance(regular, int) and rows < regular:
        raise TetherError(f"{base_name} has {rows} embedding rows but the tokenizer of the adapter "
                          f"{Path(adapter_dir).expanduser()} has {regular} regular tokens: the "
                          f"adapter was trained on a model with another vocabulary; {retarget(adapter_dir)}")


def adapter_load_error(exc: Exception, adapter_dir: str | Path, base_name: str) -> Exception:
    """peft's error while applying an adapter to a base it does not fit, as one TetherError line;
    any other error is returned unchanged (the caller raises it)."""
    from peft.utils.error import NoMatchingPeftModuleError

    where = f"the adapter {Path(adapter_dir).expanduser()} does not fit {base_name}"
    if isinstance(exc, NoMatchingPeftModuleError):
        return TetherError(f"{where}: its target modules match no layer of it, so it was trained "
                           f"on a model of another architecture; {retarget(adapter_dir)}")
    mismatch = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
    if isinstance(exc, RuntimeError) and mismatch:
        return TetherError(f"{where}: {mismatch[0][:200]}; it was trained on another model "
                           f"(or its files were mixed up): {retarget(adapter_dir)}")
    return exc


# ----------------------------------------------------------------------------- on resume


def adapter_base_record(model: nn.Module) -> dict | None:
    """The record of the base under the LoRA adapters in `model` (a PeftModel, or a module
    holding one, such as a reward model), or None when it trains no adapters: a checkpoint of
    adapters holds no base weights, so a resume must load the same base again."""
    peft = next((m for m in model.modules() if hasattr(m, "peft_config")), None)
    return remembered_base(peft) if peft is not None else None


def with_base_record(state: dict, model: nn.Module) -> dict:
    """A checkpoint's trainer `state` with, when `model` (or a wrapper of it: DDP, FSDP2) trains
    LoRA adapters, the record of their base under RESUME_KEY, for `check_resumed_base`."""
    record = adapter_base_record(model)
    return state if record is None else {**state, RESUME_KEY: record}


def check_resumed_base(state: dict, model: nn.Module, checkpoints: str | Path) -> None:
    """Refuse to resume adapters (`model`) on a base other than the one the checkpoints in
    `checkpoints` were trained on (the record in their `state`; none in checkpoints made before
    tether kept one): the base's path may hold another model since, or a hub name a new
    revision."""
    saved, now = state.get(RESUME_KEY), adapter_base_record(model)
    if saved is None or now is None:
        return
    compare_records(saved, now, f"the base model {now.get('base')} is not the one the LoRA "
                                f"checkpoints in {checkpoints} were trained on ({saved.get('base')})",
                    "put that base back at its path (or pin the hub revision) and resume, or "
                    "start a new run under another --run-name")
