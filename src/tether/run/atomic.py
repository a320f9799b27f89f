"""Atomic writes: a crash mid-write never leaves a half-written file where a good one was.

Every file goes to a temp name in the same directory, is fsynced, then `os.replace`d; a directory
(a checkpoint, a final model) is written whole under a temp name and renamed once complete.
The reading side of such a record (a config.yaml, a state.json, a lock's `.lock`) is
`read_record`: a file that is missing, cut off or garbled reads as None, for the caller to judge.

Modes: a temp name is created owner-only (mkstemp 0600, mkdtemp 0700, and safetensors writes its
files 0600 too), so every file and directory is given the mode a plain `open` or `mkdir` would
give it under the process umask before it is renamed into place (`created_mode`): on a shared
machine the group reads a run's models as it reads its metrics.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from safetensors import SafetensorError


def _fsync_dir(path: Path) -> None:
    # some platforms cannot open (or fsync) directories; the rename is still atomic
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it: Linux says it in /proc/self/status; elsewhere
    it is set and put back, once (the only way there), and remembered."""
    global _UMASK_FALLBACK
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    if _UMASK_FALLBACK is None:
        _UMASK_FALLBACK = os.umask(0o077)
        os.umask(_UMASK_FALLBACK)
    return _UMASK_FALLBACK


_UMASK_FALLBACK: int | None = None


def created_mode(directory: bool = False) -> int:
    """The mode `open` (0o666) or `mkdir` (0o777) gives a new file or directory under the umask."""
    return (0o777 if directory else 0o666) & ~_umask()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, fsync, then rename. The file
    keeps the mode of the one it replaces, else gets `created_mode` (not mkstemp's 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = created_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


# What a user fixes on their side (space, quota, permissions), not a bug: one line, not a traceback.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG)


def write_failure(exc: BaseException) -> str | None:
    """Why a write failed when it is the disk's fault ("No space left on device"), else None.
    safetensors raises its own SafetensorError, not an OSError, for the same failure
    ("Error while serializing: I/O error: No space left on device (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.strerror if exc.errno in WRITE_ERRNOS else None
    found = re.search(r"os error (\d+)", str(exc)) if isinstance(exc, SafetensorError) else None
    code = int(found.group(1)) if found else None
    return os.strerror(code) if code in WRITE_ERRNOS else None


def follow_umask(root: str | Path) -> None:
    """Give `root` and every file and directory under it the modes of `created_mode` (a tree
    written under a temp name, or by a library that writes owner-only, like safetensors).
    Symbolic links are left alone (chmod would follow them out of the tree)."""
    root = Path(root)
    file_mode, dir_mode = created_mode(), created_mode(directory=True)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, dir_mode if path.is_dir() else file_mode)
    os.chmod(root, dir_mode)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a fully written `tmp` directory to `out`: fsync its files, give them and `tmp` the
    modes of `created_mode` (mkdtemp made it 0700), rename, fsync the parent.

    An old `out` is moved aside first and deleted only once the new one is in place, so a crash
    leaves either the old directory or the new one, never a half-written one.
    """
    for path in tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    follow_umask(tmp)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: Path, prefix: str | None = None) -> Iterator[Path]:
    """A temporary directory beside `out` to write a model or a checkpoint into (named `prefix`
    and a random tail; by default `.<out's name>.tmp-`): renamed to `out` when the block ends
    without an error (`replace_dir`: never a half-written `out`), deleted either way."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_record(path: str | Path, loads: Callable[[str], Any] = yaml.safe_load) -> Any:
    """`loads` of the file's text (YAML by default; `json.loads` for JSON), or None when it
    cannot be read or parsed (absent, unreadable, cut off by a kill, not UTF-8)."""
    try:
        return loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # (UnicodeDecodeError is a ValueError)
        return None


def json_lines(path: Path) -> list[tuple[str, Any]]:
    """(line, its JSON) for each line of a JSONL file that parses: an empty line, or one cut off
    by a kill, is left out."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append((line, json.loads(line)))
    return out
