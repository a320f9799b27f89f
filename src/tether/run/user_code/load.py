"""The user's functions, loaded by name and named in error lines.

    fn = load_function("task.py:score", "reward function")   # or "module:function"
    function_name(fn)       # "task:score", what every error line calls it
    raised(exc, own_file(fn))   # "ValueError: bad row (at task.py:12)"
    defined_at(fn)          # "task.py:9", where it is written

Loading runs the named file's code, as `python` would: the current directory first on the
import path, as `python -m` puts it, so `--gold-fn task:gold` finds ./task.py from the `tether`
command too. Whatever the module raises while it loads (`sys.exit` included, Ctrl-C not) is one
line naming the file and line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tether.errors import TetherError


def load_function(spec: str, what: str) -> Callable:
    """Import `module:function` (or `file.py:function`) and return the callable (`what` names it
    in errors: a reward function, an environment factory, a tool).

    This runs the module's code. A module name is found as `python -m` finds one: the current
    directory first on the import path (the `tether` script's own path does not hold it), so
    ./task.py is `task:gold` from any launcher, and a file's own imports find its neighbours."""
    module_name, attr = check_spec(spec, what)
    _current_directory_first()
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TetherError:
        raise
    except (Exception, SystemExit) as exc:  # the user's module, whatever it raised (not Ctrl-C)
        own = str(Path(module_name).resolve()) if module_name.endswith(".py") else None
        raise TetherError(f"cannot import {module_name} for {what} {spec!r}: "
                          f"{raised(exc, own)}; fix the module (and check it is on the import "
                          "path: the current directory or PYTHONPATH)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TetherError(f"{module_name} has no callable named {attr!r}; fix the function name "
                          f"in {spec!r}")
    return fn


def check_spec(spec: str, what: str) -> tuple[str, str]:
    """`spec`'s form and, for a file, that it is there: what `load_function` checks before it runs
    any of the user's code, and the CLI before torch loads (`check_named_code`). Returns
    (module or file, function name)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TetherError(f"{what} {spec!r} must look like module:function or "
                          "path/to/file.py:function")
    if module_name.endswith(".py") and not Path(module_name).is_file():
        raise TetherError(f"{what} file {module_name} does not exist; fix the path")
    return module_name, attr


def check_named_code(cfg) -> None:
    """The functions a config names (--reward-fn, --gold-fn, --tools, an --env factory; not an
    adapter's `name:target`), each by `check_spec`: a typo in them is refused before torch and
    the model load (issue 47); importing them runs the user's code, which waits for the stage."""
    named = [(spec, "reward function") for field in ("reward_fn", "gold_fn")
             for spec in getattr(cfg, field, "").split(",")]
    named += [(spec, "tool") for specs in getattr(cfg, "tools", []) for spec in specs.split(",")]
    env = getattr(cfg, "env", "")
    if env and (":" not in env or env.partition(":")[0].endswith(".py")):
        named.append((env, "environment factory"))
    for spec, what in named:
        if spec.strip():
            check_spec(spec.strip(), what)


def _current_directory_first() -> None:
    """Put the current directory first on sys.path, as `python -m` does (the `tether` console
    script starts with its own bin directory there instead); kept, so that imports the function
    makes when called resolve as they did when it was loaded."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def raised(exc: BaseException, own_file: str | None = None) -> str:
    """`ValueError: message (at task.py:12)`: what the user's code raised and where, the one
    line of its traceback worth reading: the innermost in `own_file` (the function's own file),
    else the innermost of all. The whole traceback stays on the TetherError's __cause__."""
    what = (f"SystemExit({exc.code!r}): it called sys.exit" if isinstance(exc, SystemExit)
            else f"{type(exc).__name__}: {exc}")
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if own_file and f.filename == own_file]
    if own or frames:
        frame = (own or frames)[-1]
        what += f" (at {_shown(frame.filename)}:{frame.lineno})"
    return what


def _shown(path: str) -> str:
    """`path` relative to the current directory, unless it lies outside it."""
    where = os.path.relpath(path)
    return path if where.startswith("..") else where


def function_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _code(fn: Callable):
    """The code object of `fn`, or of a callable object's `__call__`; None for a builtin."""
    return (getattr(fn, "__code__", None)
            or getattr(vars(type(fn)).get("__call__"), "__code__", None))


def own_file(fn: Callable) -> str | None:
    """The file `fn` is written in (its traceback line worth naming, `raised`), or None."""
    return getattr(_code(fn), "co_filename", None)


def defined_at(fn: Callable) -> str:
    """`task.py:12`, where `fn` is written (the file as `raised` names it), or '?'."""
    code = _code(fn)
    return f"{_shown(code.co_filename)}:{code.co_firstlineno}" if code else "?"


def is_async_function(fn: Callable) -> bool:
    """`async def fn`, or an object whose `__call__` is one (a functools.partial of either)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return (inspect.iscoroutinefunction(fn)
            or inspect.iscoroutinefunction(vars(type(fn)).get("__call__")))
