"""`tether serve-rm MODEL`: a reward model over HTTP, for `--reward-url` (tether.rl.reward.remote).

    MODEL -> tether.rl.reward.models.load_scoring_model
                                                     loaded as the in-process reward model is
    GET  /info                                       name, kind, chat template, positions, dtype,
                                                     limits, tokenizer and model fingerprints
    POST /score {"prompts": [...], "responses": [...]} -> {"scores": [...]}
                                                     the model's `score_texts`, --batch-size rows
                                                     per forward: the in-process scores exactly

An ASGI app (`RewardApp`) served by uvicorn: one event loop holds the connections (no thread per
connection; a backlog of BACKLOG, uvicorn's 5 s keep-alive), reads and checks each request, and
hands its rows to the one thread that runs the model (`FairScorer`). What a request meets:

    the key      with a key (--api-key or $TETHER_RM_API_KEY, required off loopback), every
                 request carries `Authorization: Bearer KEY`, compared in constant time; else 401
    the body     read as it arrives and refused (413) once past --max-body-mb, at once when its
                 Content-Length says so: never held whole; not all there within BODY_TIMEOUT_S: 408
    the rows     JSON of the shape above, else 400 with one line (nested too deeply included);
                 more than --max-rows rows 413; no rows `{"scores": []}`
    the work     cut into chunks of --batch-size rows; the requests in flight take turns, one chunk
                 each, so a small request waits for at most one chunk of each request ahead of
                 it, never for the whole of a large one
    the answers  one line; a failure of the server's own (a bug, the device out of memory) is 500
                 naming the exception's type alone, its text and traceback on the server's stderr;
                 /info names the model by its directory's name, never its path

Turns go to requests, not to client addresses: behind the TLS proxy that docs/rm.md asks for off
a private network every client has the proxy's address, and turns per address would be one queue.
Each chunk is one forward of --batch-size rows, as the in-process model cuts them, so the scores
are its scores bit for bit. The model and the port are checked before anything loads; Ctrl-C or
SIGTERM stops the server after the requests in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import signal
import socket
import sys
import threading
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from torch import nn

from tether.data.chat import is_messages
from tether.errors import TetherError
from tether.models.hub_reward import check_reward_model
from tether.models.reward_model import RewardModel, position_limit
from tether.rl.reward.models import has_chat_template, load_scoring_model
from tether.run.config import RM_API_KEY_ENV
from tether.run.launch import resolve_device
from tether.run.threads import use_threads
from tether.tools.config import ServeRMConfig

BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default; 5 reset most of a burst)
BODY_TIMEOUT_S = 60.0  # a body not all there by then is a stalled or hostile client: 408
SHORTEN = "send a shorter prompt or response"  # a too-long row's fix, the server's side of it


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the ids a text gets: the vocabulary, the special tokens and the
    chat template (16 hex digits)."""
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.special_tokens_map,
                       getattr(tokenizer, "chat_template", None)], default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def model_fingerprint(model: nn.Module, tokenizer_print: str) -> str:
    """sha256 of every parameter's name, shape, dtype and first and last 16 values, the score
    normalisation and the tokenizer's fingerprint: two endpoints with the same one score alike
    (cheap: 32 values a tensor, not the weights)."""
    digest = hashlib.sha256(tokenizer_print.encode("utf-8"))
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        ends = torch.cat([flat[:16], flat[-16:]]).float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(ends.numpy().tobytes())
    norm = (getattr(model, "norm_mean", 0.0), getattr(model, "norm_std", 1.0))
    digest.update(repr(norm).encode())
    return digest.hexdigest()[:16]


def public_name(model: str) -> str:
    """What answers call the model: a local directory by its name alone (its path says where the
    server's files are), a hub id as given."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


def model_info(model: nn.Module, cfg: ServeRMConfig, kind: str) -> dict:
    """What GET /info answers."""
    config = model.backbone.config if isinstance(model, RewardModel) else model.model.config
    tokenizer_print = tokenizer_fingerprint(model.tokenizer)
    return {"model": public_name(cfg.model), "kind": kind, "chat_template": has_chat_template(model),
            "max_length": position_limit(config, model.tokenizer), "dtype": cfg.dtype,
            "batch_size": cfg.batch_size, "max_rows": cfg.max_rows,
            "max_body_mb": cfg.max_body_mb, "tokenizer": tokenizer_print,
            "fingerprint": model_fingerprint(model, tokenizer_print)}


class Refused(Exception):
    """A request answered with HTTP `status` and one line (the exception's text)."""

    def __init__(self, status: int, line: str):
        super().__init__(line)
        self.status = status


async def read_body(scope: dict, receive, limit: int) -> bytes:
    """The request's body as it arrives; Refused (413) as soon as it passes `limit` bytes, or at
    once when its Content-Length says it would, so an oversized body is never held whole."""
    too_big = Refused(413, f"the body is over the {limit / 1e6:g} MB this server reads (tether "
                           "serve-rm --max-body-mb); send fewer rows at a time")
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and int(declared) > limit:
        raise too_big
    body, more = bytearray(), True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refused(400, "the client left before its body arrived")
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_big
        more = message.get("more_body", False)
    return bytes(body)


@dataclass
class _Request:
    prompts: list
    responses: list[str]
    future: Future = field(default_factory=Future)
    scores: list[float] = field(default_factory=list)


class FairScorer:
    """The one thread that runs the model. The requests in flight wait in one line and take
    turns: the first is scored `batch_size` rows (one chunk, one forward) and, with rows left,
    goes to the back. A request of k chunks among n in flight thus waits at most n - 1 chunks
    between its own: round robin, each request its share whatever its size (module docstring)."""

    def __init__(self, score_chunk, batch_size: int):
        self.score_chunk, self.batch_size = score_chunk, batch_size
        self.line: deque[_Request] = deque()
        self.changed = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="serve-rm scorer", daemon=True)
        self.thread.start()

    def submit(self, prompts: list, responses: list[str]) -> Future:
        """Put a request (one row or more) at the back of the line; its future gets its scores."""
        request = _Request(prompts, responses)
        with self.changed:
            self.line.append(request)
            self.changed.notify()
        return request.future

    def close(self) -> None:
        """Score what is in the line, then end the thread."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join()

    def _run(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.line or self.closed)
                if not self.line:
                    return
                request = self.line.popleft()
            start = len(request.scores)
            if start == 0 and not request.future.set_running_or_notify_cancel():
                continue  # its client is gone
            stop = min(start + self.batch_size, len(request.prompts))
            try:
                request.scores += self.score_chunk(request.prompts[start:stop],
                                                   request.responses[start:stop])
            except Exception as exc:  # a bug or the device: the request's 500, as it is
                # the model refused a row (TetherError): name the chunk when one of many
                many = isinstance(exc, TetherError) and len(request.prompts) > self.batch_size
                request.future.set_exception(TetherError(
                    f"rows {start} to {stop - 1}: {exc}") if many else exc)
                continue
            if stop == len(request.prompts):
                request.future.set_result(request.scores)
            else:
                with self.changed:
                    self.line.append(request)


class RewardApp:
    """The ASGI app: GET /info and POST /score, each answered with JSON (module docstring)."""

    def __init__(self, cfg: ServeRMConfig, info: dict, scorer: FairScorer):
        self.cfg, self.info, self.scorer = cfg, info, scorer
        self.bearer = f"Bearer {cfg.key}".encode() if cfg.key else b""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        try:
            status, payload = 200, await self.answer(scope, receive)
        except (Refused, TetherError) as exc:  # one line: Refused's own status, a TetherError 400
            status, payload = getattr(exc, "status", 400), {"error": str(exc)}
        except Exception as exc:  # a bug or the device (out of memory): 500, the client retries
            print(f"serve-rm: {scope['method']} {scope['path']} failed:", file=sys.stderr)
            traceback.print_exc()
            status, payload = 500, {"error": f"{type(exc).__name__} in the server (its log has "
                                             "the rest)"}
        data = json.dumps(payload).encode("utf-8")  # NaN stays NaN: the client names it
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(data)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def answer(self, scope, receive) -> dict:
        """The answer to one request, or Refused / TetherError saying why not."""
        given = dict(scope["headers"]).get(b"authorization", b"")
        if self.bearer and not hmac.compare_digest(given, self.bearer):
            raise Refused(401, "this server wants its API key: send Authorization: Bearer KEY "
                               f"(tether's --reward-url sends ${RM_API_KEY_ENV})")
        route = (scope["method"], scope["path"].rstrip("/"))
        if route == ("GET", "/info"):
            return self.info
        if route != ("POST", "/score"):
            raise Refused(404, f"no {' '.join(route)}; GET /info or POST /score")
        try:
            body = await asyncio.wait_for(
                read_body(scope, receive, int(self.cfg.max_body_mb * 1e6)), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise Refused(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        prompts, responses = await asyncio.to_thread(self.rows, body)  # off the event loop
        if not prompts:
            return {"scores": []}
        return {"scores": await asyncio.wrap_future(self.scorer.submit(prompts, responses))}

    def rows(self, body: bytes) -> tuple[list, list[str]]:
        """The (prompts, responses) of a POST /score body, or TetherError (400) saying what is
        wrong with it, or Refused (413) past --max-rows."""
        try:
            parsed = json.loads(body.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError included
            raise TetherError(f"the body is not JSON ({exc})") from None
        except RecursionError:
            raise TetherError("the body is nested too deeply to read; send the rows as "
                              '{"prompts": [...], "responses": [...]}') from None
        if not isinstance(parsed, dict) or not {"prompts", "responses"} <= parsed.keys():
            raise TetherError('the body must be {"prompts": [...], "responses": [...]}')
        prompts, responses = parsed["prompts"], parsed["responses"]
        if not isinstance(prompts, list) or not isinstance(responses, list):
            raise TetherError("prompts and responses must be lists")
        if len(prompts) != len(responses):
            raise TetherError(f"{len(prompts)} prompts for {len(responses)} responses; give one "
                              "prompt per response")
        max_rows = self.cfg.max_rows
        if len(prompts) > max_rows:
            raise Refused(413, f"{len(prompts)} rows in one request, more than the {max_rows} this "
                               "server takes (tether serve-rm --max-rows); send fewer at a time")
        for i, prompt in enumerate(prompts):
            if not (isinstance(prompt, str) or is_messages(prompt)):
                raise TetherError(f"prompt {i} is neither text nor a list of chat messages "
                                  '({"role": ..., "content": text})')
        if not all(isinstance(r, str) for r in responses):
            raise TetherError("every response must be a string")
        if not self.info["chat_template"] and any(is_messages(p) for p in prompts):
            raise TetherError(f"the prompts are chat messages but the reward model "
                              f"{self.info['model']} has no chat template to render them with")
        return prompts, responses


class RewardServer:
    """One frozen reward model behind uvicorn: the port bound at once (a port in use is one
    line), listening once `load` has the model; `run` serves until `stop`."""

    def __init__(self, cfg: ServeRMConfig):
        self.cfg, self.model, self.scorer, self.uvicorn = cfg, None, None, None
        self.socket = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((cfg.host, cfg.port))
        except OSError as exc:
            self.socket.close()
            raise TetherError(f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc});"
                              " choose another --port (0: any free one) or stop what holds it"
                              ) from None
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def load(self, model: nn.Module, kind: str) -> None:
        """Serve `model` (frozen, on its device) from now on."""
        info = model_info(model, self.cfg, kind)
        if hasattr(model, "name"):  # what its own lines call it: no path in an answer
            model.name = info["model"]

        def score_chunk(prompts: list, responses: list[str]) -> list[float]:
            with torch.no_grad():
                return model.score_texts(prompts, responses, self.cfg.batch_size,
                                         too_long=SHORTEN).tolist()
        self.model, self.scorer = model, FairScorer(score_chunk, self.cfg.batch_size)
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            RewardApp(self.cfg, info, self.scorer), interface="asgi3", http="h11", ws="none",
            lifespan="off", log_config=None, log_level="warning", access_log=False,
            backlog=BACKLOG, server_header=False))
        self.socket.listen(BACKLOG)  # connections wait for the loop from now on, none refused

    def run(self) -> None:
        """Serve until `stop`, then finish the requests in flight and close."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.close()

    def stop(self) -> None:
        """Ask `run` to end: no new connections; the requests in flight are answered first."""
        self.uvicorn.should_exit = True

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        self.socket.close()


def open_server(cfg: ServeRMConfig) -> RewardServer:
    """Check the model (its kind, from its config alone) and bind the port, then load the model:
    a wrong model or a port in use is one line before anything large loads."""
    kind = check_reward_model(cfg.model, cfg.trust_remote_code)
    server = RewardServer(cfg)
    try:
        device = resolve_device(cfg.device)
        model = load_scoring_model(cfg.model, device, cfg.dtype, cfg.trust_remote_code)
        use_threads(cfg.threads, model, device)  # as every stage: a tiny model on one thread
        server.load(model, kind)
    except BaseException:
        server.close()
        raise
    return server


def serve(server: RewardServer) -> threading.Thread:
    """Serve on a thread (ended by `server.stop()`); returns it."""
    thread = threading.Thread(target=server.run, name="serve-rm", daemon=True)
    thread.start()
    return thread


def cli(argv: list[str]) -> int:
    """`tether serve-rm MODEL [--host H] [--port N] [--device D] [--dtype T] [--batch-size B]`."""
    from tether.run.parse import parse_config

    cfg = parse_config(ServeRMConfig, argv, prog="tether serve-rm")
    server = open_server(cfg)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    thread = serve(server)  # uvicorn off the main thread leaves the signals to this function
    print(f"serving {cfg.model} on {server.url} (POST /score)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        thread.join()
    print(f"stopped serving {cfg.model} ({received[0] if received else 'done'})", flush=True)
    return 0
