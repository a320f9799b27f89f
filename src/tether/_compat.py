"""Hide PyTorch extensions built for another PyTorch, before transformers looks for them.

`pip install -e '.[vllm]'` on a CPU machine installs vLLM's CPU build, whose dependencies pull
torchvision, torchaudio and torchcodec wheels built for CUDA PyTorch (`0.28.0+cu130`). Against the
CPU torch they cannot load ("operator torchvision::nms does not exist"), and transformers, which
imports torchvision whenever it finds it installed, then fails to import even text models such as
`LlamaForCausalLM`. tether uses none of the three, so an extension whose build tag differs from
torch's (`+cu130` beside `+cpu`) is marked absent (`sys.modules[name] = None`): transformers and
vLLM then see it as not installed, which is what it is for this torch. The check reads the
packages' `version.py` files as text: nothing is imported, so `tether --help` stays fast.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

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
