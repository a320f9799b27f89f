"""tether: RLHF with a KL leash.

The maths layer (`tether.kl`, `tether.logprobs`, `tether.advantages`, `tether.losses`,
`tether.lm_head`) is pure tensor functions at the package root; the folders are the layers above
it (DESIGN.md): `data`, `run`, `models`, `rl`, then the stages in `tether.train` (explicit loops
built on them), the tools and the demo.
"""

__version__ = "0.1.0"

# Before anything imports transformers: an extension built for another torch (vLLM's CPU build
# pulls CUDA torchvision) would break its imports (tether._compat).
from tether._compat import hide_mismatched_extensions  # noqa: E402

hide_mismatched_extensions()


def version() -> str:
    """The installed distribution's version (what `tether --version` prints)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("tether")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"
