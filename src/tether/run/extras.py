"""The optional extras a run may need, and the one line that installs each: read before torch
loads (`tether.cli.preflight`), so a missing one is named in a fraction of a second."""

from __future__ import annotations

import importlib.util

from tether.errors import TetherError

VLLM_HINT = ("pip install -e '.[vllm]' (vLLM's CPU build), or on a GPU `pip install vllm` "
             "matching your CUDA torch (docs/engine.md)")


def require_engine(engine: str) -> None:
    """A one-line error when `--engine` names an engine whose package is not installed."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise TetherError(f"--engine vllm needs vLLM, which is not installed; {VLLM_HINT}")
