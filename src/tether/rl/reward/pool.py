"""The reward pool (--reward-workers N > 1): each response scored by its own call, N calls at a
time, each within --reward-fn-timeout seconds and tried again up to --reward-retries times; a
row whose score fails is a counted failure, never a silent zero, and never an error by itself.

    calls = [lambda: f([prompt_i], [response_i]) for each row i]    # one row per call
    outcomes = RewardPool(workers=8, retries=2, timeout=60).run([Call(run, check) ...])
    # outcomes[i]: row i's score, or why it failed and after how many tries

Why one row per call: a reward that waits on something (an API judge, ~50 ms a call; a sandbox
running a program; a proof checker) is latency-bound per response, so the batch takes
ceil(B / N) waits instead of B; a retry repeats one response's call, not its batch's; a timeout
or a failure names one row and costs one group (the k responses of its prompt), not the batch.
A function that scores a batch faster as a whole (a model forward, a vectorised check) gains
nothing from the pool: keep it at --reward-workers 1, one call per batch. A function whose
score of a response depends on the other responses of the call (a rank within the batch) must
stay at 1 too: in the pool each call sees one row.

How: the calls run on the user's code's runner (tether.run.user_code.calls): an `async def`
function's coroutines on the process's event loop, a plain function in a daemon thread per call,
at most N at once. A plain function therefore runs off the main thread: one that times itself
with SIGALRM (math_verify's `parse`/`verify` with their default timeout) cannot run in the pool.

A call fails when it raises (any exception; Ctrl-C stays Ctrl-C), or does not return within
the timeout: it is tried again, after 0.1 s (RETRY_DELAY_S), then twice that, and so on (a rate limit
or a dropped connection often clears), up to `retries` times. A call that returns a NaN, inf or
out-of-range score fails at once: the function answered, and asking a deterministic function
again gets the same answer. A call that returns something that is not one number per response
(a set, the wrong count, a string) is a bug in the function: the batch stops with one line, as
without the pool. Scores come back in the rows' order, whatever order the calls finish in. An
`async def` function that blocks the loop (a synchronous request inside it) ends the process
with one line, as a hung call without the pool does (the runner's guard).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.errors import TetherError
from tether.rl.reward import FailedRows
from tether.run.user_code.calls import Runner


@dataclass(frozen=True)
class RewardPool(Runner):
    """`workers` calls at a time, each within `timeout` seconds (0: no limit), each tried again
    up to `retries` times after `retry_delay` seconds (doubling): the runner with the reward
    pool's defaults and its option named in lines."""

    retries: int = 2
    timeout_flag: str = "--reward-fn-timeout"


def check_scored(failed: FailedRows | None, what: str) -> None:
    """Where a failed row cannot be drawn again (a held-out evaluation: its prompts are fixed),
    it stops the run with one line naming the first, as a raising function does without the
    pool."""
    if failed is None or not failed.causes:
        return
    first = min(failed.causes)
    raise TetherError(f"{len(failed.causes)} of {len(failed.failed)} responses of {what} have "
                      f"no score: response {first}: {failed.causes[first]}; fix the function, or raise "
                      "--reward-retries or --reward-fn-timeout; checkpoints written so far are "
                      "intact")
