"""Outputs follow the umask like any file a user creates (issue 23): the temp names behind the
atomic writes are owner-only (mkstemp 0600, mkdtemp 0700, and safetensors writes 0600 itself),
so on a shared machine teammates could not read the models until the modes were set back.

Every entry of a finished run directory (config, metrics, TensorBoard, checkpoints, final/,
merged/) is checked against the mode `open` / `mkdir` give under umask 022 and 027. The umask is
the process's: each test restores it.
"""

from __future__ import annotations

import os
import stat

import pytest
from offline_fixtures import sft_rows, write_jsonl

from tether.cli import main
from tether.run.atomic import atomic_write_bytes, created_mode, replace_dir


@pytest.fixture
def umask():
    """Set the process umask for one test (and put the old one back)."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def _modes(root):
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755),
                                                       (0o027, 0o640, 0o750)],
                         ids=["umask022", "umask027"])
def test_every_entry_of_a_finished_run_follows_the_umask(mask, file_mode, dir_mode, umask,
                                                         tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    umask(mask)
    assert created_mode() == file_mode and created_mode(directory=True) == dir_mode
    out = tmp_path / "runs"
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "m",
                 "--output-dir", str(out), "--max-steps", "3", "--batch-size", "4", "--device",
                 "cpu", "--save-every", "1", "--lora-r", "4", "--merge-lora"]) == 0
    modes = _modes(out)
    # what the owner-only temp names used to leave: final/ and merged/ 0700 with a 0600
    # model inside, checkpoint directories 0700, config.yaml 0600
    for name in ("m/final", "m/merged", "m/checkpoints/step_1", "m/final/adapter_model.safetensors",
                 "m/merged/model.safetensors", "m/config.yaml", "m/metrics.jsonl"):
        assert name in modes
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (dir_mode if (out / name).is_dir() else file_mode)}
    assert not wrong
    assert len(modes) > 20  # every entry was looked at, not just the top


def test_atomic_writes_keep_a_replaced_file_mode_else_follow_the_umask(umask, tmp_path):
    umask(0o027)
    new = tmp_path / "new.json"
    atomic_write_bytes(new, b"{}")
    assert stat.S_IMODE(new.stat().st_mode) == 0o640
    private = tmp_path / "private.json"
    private.write_bytes(b"")
    private.chmod(0o600)  # the user's choice stands when the file is written again
    atomic_write_bytes(private, b"{}")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_bytes() == b"{}"


def test_replace_dir_gives_the_umask_modes_to_a_whole_tree(umask, tmp_path):
    import tempfile

    umask(0o002)  # a group-writable project directory
    tmp = tempfile.mkdtemp(dir=tmp_path)
    (tmp_path / tmp / "sub").mkdir()
    fd, _ = tempfile.mkstemp(dir=tmp_path / tmp / "sub")
    os.close(fd)
    replace_dir(tmp_path / tmp, tmp_path / "out")
    modes = _modes(tmp_path / "out") | {".": stat.S_IMODE((tmp_path / "out").stat().st_mode)}
    assert sorted(modes.values()) == [0o664, 0o775, 0o775]


def test_a_tiny_model_saved_for_the_demo_follows_the_umask(umask, tmp_path):
    """The demo writes its base model with `save_tiny` (runs/demo/base): transformers'
    save_pretrained leaves model.safetensors 0600 there unless the modes are set."""
    from tether.models.tiny import save_tiny

    umask(0o022)
    out = save_tiny(tmp_path / "base", ["the movie was good", "a dull plot"] * 20, vocab_size=280)
    modes = _modes(out)
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}
