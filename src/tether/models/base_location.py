"""Where a LoRA adapter's base model is: recorded so that a copied run directory still finds it,
found again on load, and re-pointed on request (issue 32).

peft reads `base_model_name_or_path` in `adapter_config.json` as `from_pretrained` does: a hub
name, an absolute path, or a path relative to the current directory. An absolute path breaks as
soon as the run directory is copied to another machine; so tether records a local base as a path
relative to the directory the training command ran in, when the base lies under it (what the user
typed there, normalised: `./models/llama` is `models/llama`), and as an absolute path only when
it lies elsewhere (`/data/models/llama`, `~/m`); a hub name stays a hub name. peft then loads the
copied directory from the copied project's root, as the run was made.

tether's own record of the base (`tether_base.json`, `adapter_checks`) also carries where the base
was, two ways, so that tether finds it from any directory:

    base               the name adapter_config.json was saved with (above)
    base_absolute      the base's absolute path when the adapter was saved (local bases only)
    base_from_adapter  the base's path relative to the adapter directory (local bases only)

Resolving, in order (`resolve_base`):

    1. an explicit base (`--base` of tether eval / generate): that;
    2. no record, or adapter_config.json names another base than the record's `base` (re-pointed
       by hand, as peft's docs suggest): that name, read as peft reads it;
    3. a hub name: that name;
    4. a local base: the first of base_from_adapter (against the adapter directory: right when
       the adapter and the base moved together), base_absolute (right when only the adapter
       moved), and the recorded name against the current directory, that exists;
    5. none exists: one line naming the fix (`--base`, or `tether set-base`).

Whichever is chosen, the base is then compared with the record's weights (`check_base`), so a
wrong model found at one of these places is refused, never applied.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from tether.errors import TetherError
from tether.models.adapter_checks import ADAPTER_CONFIG, BASE_RECORD, read_base_record, read_json
from tether.run.atomic import atomic_write_bytes

REPOINT = "tether set-base {adapter} --base PATH"  # the fix a missing or wrong base names


def local_or_hub(name_or_path: str) -> str:
    """An existing local path made absolute (symlinks resolved), else the name unchanged (a hub
    name, or a missing path whose loader error then names it)."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def portable_name(name_or_path: str, cwd: Path | None = None) -> str:
    """The name adapter_config.json records for a base loaded from `name_or_path`: relative to
    `cwd` (the current directory) when the base is a local path under it, else the absolute
    path; a hub name unchanged."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return name_or_path
    path, here = path.resolve(), (cwd or Path.cwd()).resolve()
    return path.relative_to(here).as_posix() if path.is_relative_to(here) else str(path)


def location(name_or_path: str, adapter_dir: Path) -> dict:
    """The record's location fields (module docstring) for a base loaded from `name_or_path`,
    for an adapter that will live at `adapter_dir`."""
    fields = {"base": portable_name(name_or_path)}
    path = Path(name_or_path).expanduser()
    if path.exists():
        absolute = path.resolve()
        fields |= {"base_absolute": str(absolute),
                   "base_from_adapter": os.path.relpath(absolute, adapter_dir.resolve())}
    return fields


def write_location(adapter_dir: str | Path, name_or_path: str, home: str | Path | None = None,
                   record: dict | None = None) -> None:
    """Record the base loaded from `name_or_path` in the adapter at `adapter_dir`:
    `adapter_config.json`'s `base_model_name_or_path` (its portable name) and, when there is a
    record (`record`, else the adapter's own), its location fields. `home` is where the adapter
    will live, when it is written in a temporary directory first (`save_model`).

    Each file is replaced atomically, the record first: a crash between the two leaves
    adapter_config.json naming the old base, which rule 2 then follows (the record's weights,
    which decide whether a base is right, never change here)."""
    adapter_dir = Path(adapter_dir)
    fields = location(name_or_path, Path(home) if home is not None else adapter_dir)
    record = record if record is not None else read_base_record(adapter_dir)
    if record is not None:
        record = {k: v for k, v in record.items() if k not in ("base_absolute", "base_from_adapter")}
        write_json(adapter_dir / BASE_RECORD, record | fields, indent=1)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    write_json(adapter_dir / ADAPTER_CONFIG, config | {"base_model_name_or_path": fields["base"]},
                indent=2)


@contextlib.contextmanager
def named_portably(peft, adapter: str):
    """While peft saves the adapter `adapter` of `peft` (a PeftModel), its base is named by
    `portable_name` in the adapter's config and in the base's (where peft's model card,
    README.md, reads its `base_model:`); the loaded names are put back afterwards. Yields the
    name the base was loaded by."""
    base = peft.get_base_model()
    # (object, attribute) pairs that name the base: the adapter's config, then where the card
    # reads its `base_model:` and its `base_model:adapter:` tag
    names = [(peft.peft_config[adapter], "base_model_name_or_path"),
             (getattr(base, "config", None), "_name_or_path"), (base, "name_or_path")]
    names = [(owner, attr) for owner, attr in names if isinstance(getattr(owner, attr, None), str)]
    before = [getattr(owner, attr) for owner, attr in names]
    loaded = peft.peft_config[adapter].base_model_name_or_path
    try:
        for owner, attr in names:
            setattr(owner, attr, portable_name(loaded))
        yield loaded
    finally:
        for (owner, attr), value in zip(names, before, strict=True):
            setattr(owner, attr, value)


def write_json(path: Path, obj: dict, indent: int) -> None:
    """`obj` as JSON (ending in a newline) in `path`, replaced atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def recorded_name(adapter_dir: str | Path) -> str:
    """`base_model_name_or_path` of the adapter's `adapter_config.json`, as written."""
    config_path = Path(adapter_dir).expanduser() / ADAPTER_CONFIG
    meta = read_json(config_path, "the adapter directory is damaged: train it again")
    base = meta.get("base_model_name_or_path") if isinstance(meta, dict) else None
    if not base or not isinstance(base, str):
        raise TetherError(f"{config_path} names no base model (base_model_name_or_path); "
                          f"set it to the model the adapter was trained on: "
                          f"{REPOINT.format(adapter=Path(adapter_dir).expanduser())}")
    return base


def resolve_base(adapter_dir: str | Path, base: str = "") -> str:
    """The base to load under the adapter at `adapter_dir` (the rules of the module docstring):
    an absolute path for a local base, a hub name otherwise. `base`: an explicit one (rule 1)."""
    if base:
        check_base_option(str(adapter_dir), base)
        return local_or_hub(base)
    adapter_dir = Path(adapter_dir).expanduser()
    name = recorded_name(adapter_dir)
    record = read_base_record(adapter_dir)
    if record is None or record.get("base") != name:
        return local_or_hub(name)
    places = _places(adapter_dir, record, name)
    if not places:  # a hub name
        return name
    for place in places:
        if place.exists():
            return str(place.resolve())
    tried = ", ".join(dict.fromkeys(str(p) for p in places))
    raise TetherError(f"the base model of the adapter {adapter_dir} is not where it was recorded "
                      f"(tried {tried}); pass where it is now with --base PATH (tether eval, "
                      f"generate), or re-point the adapter once: "
                      f"{REPOINT.format(adapter=adapter_dir)}")


def _places(adapter_dir: Path, record: dict, name: str) -> list[Path]:
    """Where a local base may be now, in rule 4's order; [] for a hub name. A record from before
    the location fields holds the absolute path in `base`, the same as adapter_config.json."""
    places = []
    if isinstance(record.get("base_from_adapter"), str):
        # both ends were resolved when it was computed, so `..` here is plain text again
        places.append(Path(os.path.normpath(adapter_dir.resolve() / record["base_from_adapter"])))
    if isinstance(record.get("base_absolute"), str):
        places.append(Path(record["base_absolute"]))
    if places or Path(name).is_absolute():
        places.append(Path(name).expanduser())
    return places


def check_base_option(model: str, base: str) -> None:
    """`--base` names the base of an adapter directory (tether eval, generate, set-base; `base` of
    `resolve_base`): refused, before anything loads, with a `--model` that is none (a full model
    has no base to replace), and when it is an adapter directory itself: transformers would load
    the base that adapter names instead, from the hub when that name is a path from elsewhere
    (after its retries)."""
    if base and not (Path(model).expanduser() / ADAPTER_CONFIG).is_file():
        raise TetherError(f"--base applies to a LoRA adapter directory, and --model {model} is "
                          f"not one (no {ADAPTER_CONFIG}); drop --base")
    if base and (Path(base).expanduser() / ADAPTER_CONFIG).is_file():
        raise TetherError(f"--base {base} is a LoRA adapter directory (it has {ADAPTER_CONFIG}), "
                          f"not a base model; point --base at the base model the adapter {model} "
                          f"was trained on (its {ADAPTER_CONFIG} names {recorded_name(model)})")
