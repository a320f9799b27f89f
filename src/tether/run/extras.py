"""The optional extras a run may need, and the one line that installs each: read before torch
loads (`tether.cli.preflight`), so a missing one is named in a fraction of a second.

The core install (`pip install -e .`) trains, evaluates and generates. Everything else is an extra
of pyproject.toml, and this module is the one place that maps a package to the extra that
installs it:

    EXTRA_OF      import name -> extra
    STAGE_NEEDS   stage -> the packages it imports beyond the core (checked before it starts)

(The environment adapters' extras, reasoning-gym and openenv, live with the adapters:
`tether.rl.env.extras`.)
"""

from __future__ import annotations

import importlib.util

from tether.errors import TetherError

EXTRA_OF = {
    "matplotlib": "report",         # the plots of `tether report`, the sweep's page and the demo's
    "vaderSentiment": "demo",       # the demo's gold reward (ships its lexicon)
    "tensorboard": "tensorboard",   # --report-to tensorboard (through torch.utils.tensorboard)
    "wandb": "wandb",
    "mlflow": "mlflow",             # the mlflow-skinny distribution
}

# The demo extra holds the report extra too (pyproject.toml): one install for `tether demo`.
STAGE_NEEDS = {
    "demo": ("matplotlib", "vaderSentiment"),
    "report": ("matplotlib",),
    "sweep": ("matplotlib",),  # its runs need nothing more, but its report page does
}

VLLM_HINT = ("pip install -e '.[vllm]' (vLLM's CPU build), or on a GPU `pip install vllm` "
             "matching your CUDA torch (docs/engine.md)")


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
        extra = stage if stage == "demo" else EXTRA_OF[missing[0]]
        raise TetherError(f"tether {stage} needs the {extra} extra ({', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed): "
                          f"{install_line(extra)}")


def require_tracker(name: str) -> None:
    """A one-line error when `--report-to` names a tracker whose package is not installed."""
    if name in EXTRA_OF and not installed(name):
        raise TetherError(f"--report-to {name} needs the {name} package, which is not "
                          f"installed: {install_line(EXTRA_OF[name])} (or --report-to none)")


def require_engine(engine: str) -> None:
    """A one-line error when `--engine` names an engine whose package is not installed."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise TetherError(f"--engine vllm needs vLLM, which is not installed; {VLLM_HINT}")
