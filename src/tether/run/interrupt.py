"""Ctrl-C and SIGTERM stop a run at the next safe point, with a checkpoint and one line.

The CLI installs the handlers (`install`); a training loop calls `requested()` after each step
(once its optimizer step and any checkpoint are done) and, when a stop was asked for, saves a
checkpoint and raises `Interrupted`. A second Ctrl-C quits at once (the default KeyboardInterrupt),
for a run that is stuck. From Python nothing is installed and `requested()` is always False, so
a notebook's own Ctrl-C handling is untouched.
"""

from __future__ import annotations

import signal
import sys

from tether.errors import TetherError

_received: list[int] = []


class Interrupted(TetherError):
    """A run stopped by a signal after saving a checkpoint; the CLI exits with 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def _handler(signum, frame) -> None:
    if _received and signum == signal.SIGINT:
        raise KeyboardInterrupt  # the second Ctrl-C: quit now
    _received.append(signum)
    print(f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint "
          "(Ctrl-C again to quit at once)", file=sys.stderr, flush=True)


def install() -> None:
    """Catch SIGINT and SIGTERM for the rest of the process (the CLI calls this)."""
    _received.clear()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _handler)


def requested() -> bool:
    """True once a stop was asked for."""
    return bool(_received)


def between_steps() -> Interrupted | None:
    """For a caller that runs whole stages, not steps (the demo): once a stop was asked for, the
    exception to raise before it starts another; None until then."""
    if not _received:
        return None
    return Interrupted(f"{signal.Signals(_received[0]).name}: stopped", _received[0])


def stop(step: int, where: str) -> Interrupted:
    """The exception a loop raises once it has saved its checkpoint at `step` in `where`."""
    signum = _received[0]
    return Interrupted(f"{signal.Signals(signum).name}: stopped at step {step} with a checkpoint "
                       f"in {where}; continue with --resume", signum)
