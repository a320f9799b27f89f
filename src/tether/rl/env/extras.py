"""The packages the environment adapters need, installed as extras of tether (pyproject.toml):
imported when an adapter is used, never when tether is, so tether runs without them.

    EXTRAS   import name -> (distribution, extra): what to install and how
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tether.errors import TetherError

EXTRAS = {
    "reasoning_gym": ("reasoning-gym", "reasoning-gym"),
    "openenv": ("openenv-core", "openenv"),
}


def require(module: str, needed_by: str) -> ModuleType:
    """`import module` (one of EXTRAS), or one line naming what needs it and the extra that
    installs it. `needed_by` names the user's request (`--env reasoning-gym:leg_counting`)."""
    top = module.split(".")[0]
    distribution, extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:  # the package, or one of its own dependencies (named)
        missing = "" if (exc.name or "").split(".")[0] == top else f" ({exc})"
        raise TetherError(f"{needed_by} needs the {distribution} package{missing}; "
                          f"pip install 'tether[{extra}]'") from exc
