"""Where `tether eval`, `generate` and `report` may write their `--output`, checked before any
model is loaded, so a bad target costs no work and destroys nothing (docs/errors.md).

    an existing directory                       refused: name a file (inside it, say)
    a path under an existing file               refused
    a directory that cannot be written          refused
    one of the command's inputs                 refused: the prompts file, a reward function's
                                                file, a run's config.yaml or metrics.jsonl
    any file inside a model directory it reads  refused (eval, generate): the artefact read
                                                is never changed, not even by a new file
    an existing file inside a run directory     refused (report: a run's files are its own),
                                                except the command's own default file there
                                                (report.html); a new file is fine
    a missing parent directory                  created, as --output-dir is
    an earlier output                           replaced, atomically: until the new file is
                                                whole, the old one stays

`inputs` are (what the user calls it, path) pairs, `("--prompts", "p.jsonl")`; a name that is
no local path (a hub model) is no file here and is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tether.errors import TetherError


def check_output(output: str | Path, inputs: Iterable[tuple[str, str | Path]], example: str,
                 own_default: str = "") -> Path:
    """The `--output` file, or TetherError naming what is wrong and the fix. `example` is a
    file name to suggest inside a directory. `own_default` marks the input directories as run
    directories (report) and names the one file the command may replace there (its default
    output); without it they are models (eval, generate), which get no file at all."""
    out = Path(output)
    if out.is_dir():
        raise TetherError(f"--output {output} is a directory; name a file, e.g. "
                          f"--output {out / example}")
    # The nearest existing ancestor must be a writable directory (missing ones below it are
    # created when the file is written).
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise TetherError(f"--output {output}: {parent} is a file, not a directory; choose "
                          "another --output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TetherError(f"--output {output}: cannot write in {parent} (permission denied); "
                          "choose a writable --output")
    target = out.resolve()
    for what, source in inputs:
        path = Path(source)
        if not source or not path.exists():
            continue
        if path.is_file() and target == path.resolve():
            raise TetherError(f"--output {output} is the {what} file this command reads; writing "
                              "it would destroy it: choose another --output")
        inside = path.is_dir() and target.is_relative_to(path.resolve())
        if inside and not own_default:
            raise TetherError(f"--output {output} is inside {what} {source}, which this command "
                              "reads; it never writes into a model or data directory it reads: "
                              "write the output beside it, e.g. --output "
                              f"{path.absolute().with_name(path.absolute().name + '.' + example)}")
        if inside and out.exists() and out.name != own_default:
            raise TetherError(f"--output {output} would replace {out.name} of {what} {source}, "
                              "which this command reads; write the output elsewhere (or delete "
                              "that file first, if it is an old output)")
    return out


def function_file(spec: str) -> str:
    """The file of a `file.py:function` reward (an input); '' for `module:function` or none."""
    file, sep, _ = spec.rpartition(":")
    return file if sep and file.endswith(".py") else ""
