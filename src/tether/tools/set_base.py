"""`tether set-base ADAPTER --base PATH`: re-point a LoRA adapter directory at its base model
where it is now (a run directory copied to another machine, a base moved to another disk).

    the adapter's files checked                  adapter_checks.check_adapter_files
    the new base loaded and compared with the    adapter_checks.check_base (skipped for an
      adapter's record of its base                 adapter without one: peft's)
    adapter_config.json and tether_base.json     base_location.write_location, each file
      rewritten to name it                         replaced atomically

Nothing is written unless the base is the one the adapter was trained on, so a mistyped path or
another model leaves the adapter as it was. Afterwards tether and peft's
`AutoPeftModelForCausalLM.from_pretrained(ADAPTER)` both find the base (peft reads the name
relative to the current directory, as tether records it: docs/loading.md).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM

from tether.errors import TetherError
from tether.models.adapter_checks import (
    base_record,
    check_adapter_files,
    check_base,
    read_base_record,
)
from tether.models.base_location import portable_name, resolve_base, write_location
from tether.models.lora import is_adapter
from tether.models.pretrained import DTYPES, _check_exists, _from_pretrained
from tether.tools.config import SetBaseConfig


def set_base(adapter_dir: str | Path, base: str, trust_remote_code: bool = False) -> str:
    """Point the adapter at `adapter_dir` at the base model `base` (a directory or a hub name),
    after checking that `base` is the model its record says it was trained on; returns the name
    written into `adapter_config.json`."""
    adapter = Path(adapter_dir).expanduser()
    if not is_adapter(adapter):
        raise TetherError(f"{adapter_dir} is not a LoRA adapter directory (no "
                          "adapter_config.json); pass the final/ of a run trained with --lora-r")
    check_adapter_files(adapter)
    name = resolve_base(adapter, base)  # (an adapter given as the base is refused there)
    _check_exists(name)
    record = read_base_record(adapter)
    if record is not None:  # loaded as the record was made, so the comparison is exact
        dtype = record.get("dtype") if record.get("dtype") in DTYPES else "float32"
        model = _from_pretrained(AutoModelForCausalLM, "the base model", name, dtype,
                                 trust_remote_code)
        check_base(adapter, base_record(model, name), base)
        del model
    write_location(adapter, name)
    return portable_name(name)


def cli(argv: list[str]) -> int:
    """`tether set-base ADAPTER --base PATH`."""
    from tether.run.parse import parse_config

    cfg = parse_config(SetBaseConfig, argv, prog="tether set-base")
    written = set_base(cfg.adapter, cfg.base, cfg.trust_remote_code)
    checked = ("checked against its record" if read_base_record(cfg.adapter) is not None
               else "not checked: the adapter has no tether_base.json")
    print(f"{cfg.adapter}: base_model_name_or_path is now {written} ({checked})")
    return 0
