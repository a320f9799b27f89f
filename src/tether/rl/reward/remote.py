"""A reward model served over HTTP (`tether serve-rm`) as the loop's `Reward` (`--reward-url`).

The protocol (docs/rm.md, "Serving a reward model"), JSON both ways:

    GET  /info   -> {"model", "kind", "chat_template", "max_length", "tokenizer", "fingerprint",
                     "dtype", "batch_size", "max_rows", "max_body_mb"}
    POST /score  {"prompts": [...], "responses": [...]} -> {"scores": [...]}
    an error     -> HTTP 4xx or 5xx with {"error": "<one line>"}

A served model always reads text, as a reward model that does not read the policy's ids does in
process (`tether.rl.reward.models.reward_from_texts`): each prompt as its row gave it (plain text, or
the chat messages, which the server renders with the model's own template) and the decoded
response. The checks are the in-process ones: chat prompts need a chat template (refused at
start-up), a row past the model's positions is the server's one line, a non-finite score is
`checked_model_scores`'. A batch is cut into one contiguous part per endpoint, posted at once
and put back in order (tether.run.user_code.calls: a thread each); a connection error or a 5xx
is retried with backoff, and a score that never comes stops the run with one line naming the
URL, never a silent zero. A server started with an API key gets it from $TETHER_RM_API_KEY, the
variable the server reads too (`Authorization: Bearer KEY`, never written to a run's files); its
401 is one line, not retried.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import partial

import torch

from tether.errors import TetherError
from tether.rl.reward import Prompt, Reward
from tether.rl.reward.models import reward_from_texts
from tether.run.config import RM_API_KEY_ENV
from tether.run.slicing import micro_batches
from tether.run.user_code.calls import Call, Runner

RETRIES = 3  # tries after the first, on a connection error or a 5xx (a server restarting)
BACKOFF_S = 0.5  # the first wait; it doubles each try (0.5, 1, 2 s)
INFO_TIMEOUT_S = 10.0  # GET /info's wait where no --reward-url-timeout is given
START_IT = "start it with tether serve-rm MODEL --port N, or check the address"


@dataclass(frozen=True)
class Endpoint:
    """One `tether serve-rm` endpoint and what its GET /info said."""

    url: str  # http://host:port, no trailing slash
    info: dict

    @property
    def name(self) -> str:  # what error lines call the model
        return f"{self.info.get('model', '?')} (served at {self.url})"


def _why(exc: BaseException) -> str:
    """`Connection refused`, `Name or service not known`, ...: the reason of a failed request."""
    reason = getattr(exc, "reason", exc)
    return (getattr(reason, "strerror", None) or str(reason))[:200] or type(reason).__name__


def _error_line(exc: urllib.error.HTTPError) -> str:
    """The server's own one line (`{"error": ...}`), or the HTTP status."""
    try:
        return str(json.loads(exc.read().decode("utf-8"))["error"])
    except (ValueError, KeyError, TypeError, OSError):
        return f"HTTP {exc.code} {exc.reason}"


class Unanswered(Exception):
    """A request worth trying again (a connection error, a 5xx, a broken answer); its args:
    what went wrong, and the fix."""


def _request(url: str, path: str, data: bytes | None, timeout: float) -> dict:
    """GET (data None) or POST the JSON `data` to url + path and return the JSON answer. A
    connection error or a 5xx is `Unanswered`, for `_requests` to try again; a 4xx (the server
    refused what it was sent) and a timeout (a hung server would hang again) are one line at
    once."""
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key := os.environ.get(RM_API_KEY_ENV, ""):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=data, headers=headers)
    hung = (f"--reward-url {url}: no answer to {path} within {timeout:g} s "
            "(--reward-url-timeout); check the server, or raise --reward-url-timeout; "
            "checkpoints written so far are intact")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            # a served score of 10**400 is an integer no float holds (torch.tensor's
            # OverflowError): read as a float it is inf, which `checked_model_scores` names
            return json.loads(answer.read().decode("utf-8"),
                              parse_int=lambda text: int(text) if len(text) < 300 else float(text))
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise TetherError(f"--reward-url {url}: the server wants its API key, and "
                              + (f"${RM_API_KEY_ENV} is not it" if key else
                                 f"${RM_API_KEY_ENV} is not set") + "; set it to the key the "
                              "server was started with") from None
        problem = f"the server answered {path} with {_error_line(exc)}"
        if exc.code < 500:
            raise TetherError(f"--reward-url {url}: {problem}") from None
        raise Unanswered(problem, "check the server's log") from None
    except (TimeoutError, urllib.error.URLError) as exc:  # the socket's, or urlopen's wrapped
        if isinstance(getattr(exc, "reason", exc), TimeoutError):
            raise TetherError(hung) from None
        raise Unanswered(f"cannot connect ({_why(exc)})", START_IT) from None
    except (OSError, ValueError) as exc:  # a reset connection, an answer that is not JSON
        raise Unanswered(f"a broken answer to {path} ({type(exc).__name__}: {_why(exc)})",
                         "check the server's log") from None


def _requests(requests: list[tuple[str, str, bytes | None]], timeout: float, retries: int
              ) -> list[dict]:
    """Each `(url, path, data)` request at once (`_request`), its answer in order; an
    `Unanswered` one is tried again `retries` times, BACKOFF_S apart and doubling, then is one
    line naming its URL."""
    runner = Runner(workers=max(len(requests), 1), retries=retries, retry_delay=BACKOFF_S)
    outcomes = runner.run([Call(partial(_request, *request, timeout)) for request in requests])
    for (url, _, _), outcome in zip(requests, outcomes):
        if isinstance(outcome.error, Unanswered):
            problem, fix = outcome.error.args
            tries = f" after {retries + 1} tries" if retries else ""
            raise TetherError(f"--reward-url {url}: {problem}{tries}; {fix}")
        if outcome.error is not None:  # not the server's doing: a bug of tether's own
            raise outcome.error
    return [outcome.value for outcome in outcomes]


def connect(urls: list[str], timeout: float = INFO_TIMEOUT_S) -> list[Endpoint]:
    """GET /info on every endpoint, before any model loads: a dead one is one line, and so are
    endpoints that serve different models (another fingerprint: other weights, tokenizer or
    dtype), whose scores would depend on which endpoint a row went to. A server that does not
    answer within `timeout` (--reward-url-timeout, which its line says to raise) is one line."""
    answers = _requests([(url, "/info", None) for url in urls], timeout, 0)
    endpoints = [Endpoint(url, info) for url, info in zip(urls, answers)]
    for endpoint in endpoints:
        if not isinstance(endpoint.info.get("fingerprint"), str):
            raise TetherError(f"--reward-url {endpoint.url}: /info answered without a model "
                              "fingerprint; is it a tether serve-rm? " + START_IT)
    first = endpoints[0]
    for other in endpoints[1:]:
        if other.info["fingerprint"] != first.info["fingerprint"]:
            raise TetherError(
                f"--reward-url endpoints serve different models: {first.name}, "
                f"{first.info.get('dtype')}, and {other.name}, {other.info.get('dtype')} (other "
                "weights, tokenizer or --dtype), so a score would depend on the endpoint a row "
                "went to; serve one model, in one dtype, at every URL")
    return endpoints


def _body(endpoint: Endpoint, prompts: list[Prompt], responses: list[str]) -> bytes:
    """One endpoint's POST /score body, or one line when it is past what the server takes (its
    /info's max_rows and max_body_mb): refused there, a large body would reset the connection
    while it is sent, which reads as a dead server."""
    data = json.dumps({"prompts": prompts, "responses": responses}).encode("utf-8")
    max_rows, max_mb = endpoint.info.get("max_rows"), endpoint.info.get("max_body_mb")
    if (max_rows and len(prompts) > max_rows) or (max_mb and len(data) > max_mb * 1e6):
        raise TetherError(f"--reward-url {endpoint.url}: a request of {len(prompts)} rows and "
                          f"{len(data) / 1e6:.1f} MB, more than the server takes ({max_rows} "
                          f"rows, {max_mb:g} MB); start tether serve-rm with a larger --max-rows "
                          "or --max-body-mb, or give more endpoints")
    return data


def score_remote(endpoints: list[Endpoint], prompts: list[Prompt], responses: list[str],
                 timeout: float, retries: int = RETRIES) -> torch.Tensor:
    """Scores `[N]` of (prompt, response) pairs from the endpoints: one contiguous part each,
    posted at once, put back in the rows' order."""
    # at most one contiguous part per endpoint, the first ones a row longer (none left empty)
    parts = micro_batches(list(range(len(prompts))), len(endpoints))
    answers = _requests([(endpoint.url, "/score", _body(endpoint, [prompts[i] for i in rows],
                                                        [responses[i] for i in rows]))
                         for endpoint, rows in zip(endpoints, parts)], timeout, retries)
    scores = []
    for endpoint, rows, answer in zip(endpoints, parts, answers):
        part = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(part, list) or len(part) != len(rows) or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) for s in part):
            raise TetherError(f"--reward-url {endpoint.url}: /score answered {str(answer)[:80]}, "
                              f"not {len(rows)} scores; is it a tether serve-rm? {START_IT}")
        scores += part
    return torch.tensor(scores, dtype=torch.float32)


def reward_from_urls(endpoints: list[Endpoint], originals: dict[str, Prompt],
                     timeout: float) -> Reward:
    """The served reward model as a `Reward`: `reward_from_texts`, as an in-process reward model
    that reads text, with `score_remote` scoring: each prompt text looked up in `originals` (one
    missing there is sent as plain text), the decoded responses, the scores checked as an
    in-process reward model's are. Chat prompts are refused here, at start-up, when the served
    model has no chat template."""
    name = " and ".join([endpoints[0].name] + [e.url for e in endpoints[1:]])
    return reward_from_texts(partial(score_remote, endpoints, timeout=timeout),
                             bool(endpoints[0].info.get("chat_template")), originals, name)
