"""The optional extras a run may need, and the one line that installs each: read before torch
loads (`tether.cli.preflight`), so a missing one is named in a fraction of a second.

The core install (`pip install -e .`) trains, evaluates and generates. Everything else is an extra
of pyproject.toml, and this module is the one place that maps a package to the extra that
installs it:

    EXTRAS        import name -> (distribution, extra)
    STAGE_NEEDS   stage -> the packages it imports beyond the core (checked before it starts)

An engine's package is a fact of its entry in `tether.choices.ENGINES` (`require_engine`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from tether.choices import ENGINES, entry
from tether.errors import TetherError

EXTRAS = {
    "matplotlib": ("matplotlib", "report"),  # the plots of `tether report`, the sweep's, the demo's
    "vaderSentiment": ("vaderSentiment", "demo"),  # the demo's gold reward (ships its lexicon)
    # --report-to tensorboard (through torch.utils.tensorboard), wandb, mlflow (mlflow-skinny)
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow-skinny", "mlflow"),
    # the environment adapters (docs/agents.md): imported when one is used, never with tether
    "reasoning_gym": ("reasoning-gym", "reasoning-gym"),
    "openenv": ("openenv-core", "openenv"),
    "uvicorn": ("uvicorn", "serve-rm"),  # the server of `tether serve-rm`
}

# The demo extra holds the report extra too (pyproject.toml): one install for `tether demo`.
STAGE_NEEDS = {
    "demo": ("matplotlib", "vaderSentiment"),
    "report": ("matplotlib",),
    "sweep": ("matplotlib",),  # its runs need nothing more, but its report page does
    "serve-rm": ("uvicorn",),
}


def install_line(extra: str) -> str:
    """The command that installs `extra` into a checkout's environment (as the README does)."""
    return f"pip install -e '.[{extra}]'"


def installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (no seconds of import)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # a module in sys.modules without a spec (set up by a test or a shim)
        return True


def require_stage(stage: str) -> None:
    """A one-line error, before anything runs or is written, when `tether <stage>` needs an
    extra that is not installed."""
    missing = [p for p in STAGE_NEEDS.get(stage, ()) if not installed(p)]
    if missing:
        # the demo needs both; the demo extra installs both (it includes report)
        extra = stage if stage == "demo" else EXTRAS[missing[0]][1]
        raise TetherError(f"tether {stage} needs the {extra} extra ({', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed): "
                          f"{install_line(extra)}")


def require_tracker(name: str) -> None:
    """A one-line error when `--report-to` names a tracker whose package is not installed."""
    if name in EXTRAS and not installed(name):
        raise TetherError(f"--report-to {name} needs the {name} package, which is not "
                          f"installed: {install_line(EXTRAS[name][1])} (or --report-to none)")


def require_engine(engine: str) -> None:
    """A one-line error when `--engine` names an engine whose package is not installed."""
    package = entry(ENGINES, engine, "engine").package
    if package and importlib.util.find_spec(package) is None:
        raise TetherError(f"--engine {engine} needs the {package} package, which is not "
                          f"installed; {ENGINES[engine].install}")


def require(module: str, needed_by: str) -> ModuleType:
    """`import module` (an extra's, `EXTRAS`), or one line naming what needs it and the extra
    that installs it. `needed_by` names the user's request (`--env reasoning-gym:leg_counting`)."""
    top = module.split(".")[0]
    distribution, extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:  # the package, or one of its own dependencies (named)
        missing = "" if (exc.name or "").split(".")[0] == top else f" ({exc})"
        raise TetherError(f"{needed_by} needs the {distribution} package{missing}; "
                          f"pip install 'tether[{extra}]'") from exc
