"""Fail fast when the Hugging Face hub cannot be reached.

Without `HF_HUB_OFFLINE`, a hub name on a machine with no network is not an error to
huggingface_hub: it retries each request five times with back-off (1+2+4+8+8 s), twice (tokenizer,
then model), and logs a line per try: 27-51 s and a page of warnings before the same failure
(issue 13). One request to the hub endpoint, with a short timeout and no retry, tells us first.
"""

from __future__ import annotations

import contextlib
from functools import cache

PROBE_TIMEOUT_S = 3.0
"""Seconds to wait for the hub's answer; a reachable hub answers in well under one."""


@cache
def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when the hub endpoint (`HF_ENDPOINT`, default https://huggingface.co) answers one HEAD
    request, with any status, within `timeout` seconds. Asked once per process: the answer is cached.

    It is an HTTP request, not a bare TCP connect, because some networks accept every connection
    and then never answer; it goes through huggingface_hub's own client, so proxies and
    certificates are those the download itself would use.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # noqa: BLE001 - DNS failure, refused, unreachable, timed out, TLS: no answer
        return False
    return True


def go_offline() -> None:
    """Make this process read the hub cache only, as `HF_HUB_OFFLINE=1` would: for a cached name
    on a machine that cannot reach the hub. huggingface_hub and transformers read the flag at call
    time; datasets keeps its own copy."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    # datasets is only needed for hub datasets and save_to_disk directories
    with contextlib.suppress(ImportError):
        import datasets

        datasets.config.HF_HUB_OFFLINE = True
