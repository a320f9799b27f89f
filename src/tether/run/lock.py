"""One directory, one writer: an advisory lock file `<dir>/.lock` (a run directory, a sweep).

The lock is `flock(LOCK_EX | LOCK_NB)` on `.lock`, held through an open file for as long as the
writer lives; the file holds who took it (`{"pid", "host", "started"}`) for the error message
only. The kernel drops a flock when the last descriptor of the file is closed, so a process killed
with SIGKILL, or one that ran out of memory, can never leave a lock behind: a "stale" lock is just
a `.lock` whose flock is free, and the next writer takes it and rewrites the content. The file is
left in place after a run (removing it would race with a process that has it open).

Limits, said plainly:
- Advisory: it stops tether processes, not an `rm -r` or another program.
- Per process: inside one Python process a new lock on the same directory takes over from an
  earlier one (stages run one at a time; a run that raised can hold its lock through a traceback
  a notebook keeps). A process forked (not exec'd) from the writer shares its descriptor and so
  holds the lock until it exits too.
- Local filesystems: on a filesystem without flock (some NFS, FUSE or SMB mounts) or a platform
  without `fcntl` (Windows) the run goes on without a lock, after a one-line warning.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.run.atomic import read_record

try:
    import fcntl
except ImportError:  # Windows: no flock; `acquire` warns and the run goes on unlocked
    fcntl = None

LOCK_NAME = ".lock"
WAIT_S = 1.0  # a `probe` holds the flock for microseconds; a real writer holds it for the run
_HELD: dict[str, DirLock] = {}  # this process's locks, by lock file path


class DirLock:
    """A held lock; `release` (or the process ending) frees it. Idempotent."""

    def __init__(self, key: str, file):
        self.key, self.file = key, file

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor drops the flock
            self.file = None
        if _HELD.get(self.key) is self:
            del _HELD[self.key]


def _key(directory: Path) -> str:
    return str(directory.resolve() / LOCK_NAME)


def _flock(fd: int, wait_s: float) -> bool:
    """Try the exclusive flock for up to `wait_s` seconds: True when taken, False when another
    process holds it. Other OSErrors (no flock on this filesystem) propagate."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def probe(directory: str | Path, what: str, fix: str) -> None:
    """Raise the in-use error when another process holds `directory`'s lock; writes nothing (an
    absent `.lock` means no holder: every holder creates it). Free: nothing is kept."""
    directory = Path(directory)
    path = directory / LOCK_NAME
    if fcntl is None or _key(directory) in _HELD or not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unreadable: `acquire` says why, where it matters
    try:
        if not _flock(fd, WAIT_S):
            raise TetherError(in_use_message(directory, what, fix))
    except OSError:
        return  # no flock here (e.g. NFS refuses it on a read-only descriptor): `acquire` warns
    finally:
        os.close(fd)  # releases the probe's flock, if it got it


def acquire(directory: str | Path, what: str, fix: str) -> DirLock | None:
    """Take `directory`'s lock (it must exist) and record this process in `.lock`; raise the
    in-use error if another process holds it. None where flock is unavailable (warned)."""
    directory = Path(directory)
    path, key = directory / LOCK_NAME, _key(directory)
    if key in _HELD:  # an earlier run in this process (finished or raised): take over from it
        _HELD[key].release()
    if fcntl is None:
        _warn_unlocked(directory, "this platform has no fcntl.flock")
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise TetherError(f"cannot create the lock file {path}: {exc.strerror}; check the "
                          "permissions of the directory") from None
    file = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        taken = _flock(fd, WAIT_S)
    except OSError as exc:
        file.close()
        _warn_unlocked(directory, exc.strerror or errno.errorcode.get(exc.errno, "error"))
        return None
    if not taken:
        file.close()
        raise TetherError(in_use_message(directory, what, fix))
    file.seek(0)
    file.truncate()  # a stale holder's record goes: this process holds it now
    file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    file.flush()
    _HELD[key] = DirLock(key, file)
    return _HELD[key]


def _warn_unlocked(directory: Path, reason: str) -> None:
    print(f"warning: cannot lock {directory} ({reason}); nothing stops a second process from "
          "writing into it at the same time", file=sys.stderr)


def holder(directory: str | Path) -> dict[str, Any] | None:
    """Who `.lock` says holds the lock, or None (absent, unreadable, or not yet written)."""
    record = read_record(Path(directory) / LOCK_NAME, json.loads)
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:  # PermissionError: it exists, under another user
        return not isinstance(exc, ProcessLookupError)
    return True


def in_use_message(directory: Path, what: str, fix: str) -> str:
    """The one line for a held lock, naming the holder. A holder that took the lock a moment ago
    may not have written `.lock` yet (it still names a dead one, or nothing): read again briefly."""
    record, deadline = None, time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        record = holder(directory)
        if record and (record.get("host") != socket.gethostname() or _alive(record["pid"])):
            break
        time.sleep(0.05)
    if record is None:
        return f"{what} {directory} is in use by another process; {fix}"
    return (f"{what} {directory} is in use by pid {record['pid']} (host {record.get('host')}, "
            f"since {record.get('started')}); {fix}")
