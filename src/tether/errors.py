"""The one exception type for problems the user can fix (bad input, bad config).

The CLI catches `TetherError`, prints `error: <message>` on one line and exits with code 2, so a
message must be a single line that names the problem and says how to fix it. Bugs in tether raise
ordinary exceptions and keep their traceback.
"""

from __future__ import annotations


class TetherError(Exception):
    """A user-facing input or configuration problem, described in one line."""

    def __init__(self, message: str):
        # One line is the contract with the CLI: fold any newline a caller let slip through.
        super().__init__(" ".join(str(message).split()))


class AlreadyFinished(TetherError):
    """`--resume` of a run that already finished: nothing to do (the CLI exits 0)."""
