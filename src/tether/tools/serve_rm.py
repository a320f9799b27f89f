"""`tether serve-rm MODEL`: a reward model over HTTP, for `--reward-url` (tether.rl.reward.remote).

    MODEL -> tether.rl.reward.models.load_scoring_model
                                                     loaded as the in-process reward model is
    GET  /info                                       name, kind, chat template, positions, dtype,
                                                     tokenizer and model fingerprints
    POST /score {"prompts": [...], "responses": [...]} -> {"scores": [...]}
                                                     the model's `score_texts`, --batch-size rows
                                                     per forward: the in-process scores exactly

Requests are served on threads and scored one at a time (a lock around the model), so a request
gets the scores it would get alone. A bad request is HTTP 400 with `{"error": "<one line>"}`: the
body, or what the model refuses (a row past its positions, chat messages without a template).
The model and the port are checked before anything loads; Ctrl-C or SIGTERM stops the server
after the requests in flight.
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torch import nn

from tether.data.chat import is_messages
from tether.errors import TetherError
from tether.models.hub_reward import check_reward_model
from tether.models.reward_model import RewardModel, position_limit
from tether.rl.reward.models import has_chat_template, load_scoring_model
from tether.run.launch import resolve_device
from tether.run.threads import use_threads
from tether.tools.config import ServeRMConfig


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


def model_info(model: nn.Module, cfg: ServeRMConfig, kind: str) -> dict:
    """What GET /info answers."""
    config = model.backbone.config if isinstance(model, RewardModel) else model.model.config
    tokenizer_print = tokenizer_fingerprint(model.tokenizer)
    return {"model": cfg.model, "kind": kind, "chat_template": has_chat_template(model),
            "max_length": position_limit(config, model.tokenizer), "dtype": cfg.dtype,
            "batch_size": cfg.batch_size, "tokenizer": tokenizer_print,
            "fingerprint": model_fingerprint(model, tokenizer_print)}


def _pairs(body) -> tuple[list, list[str]]:
    """The (prompts, responses) of a POST /score body, or TetherError saying what is wrong."""
    if not isinstance(body, dict) or not {"prompts", "responses"} <= body.keys():
        raise TetherError('the body must be {"prompts": [...], "responses": [...]}')
    prompts, responses = body["prompts"], body["responses"]
    if not isinstance(prompts, list) or not isinstance(responses, list):
        raise TetherError("prompts and responses must be lists")
    if len(prompts) != len(responses):
        raise TetherError(f"{len(prompts)} prompts for {len(responses)} responses; give one "
                          "prompt per response")
    for i, prompt in enumerate(prompts):
        if not (isinstance(prompt, str) or is_messages(prompt)):
            raise TetherError(f"prompt {i} is neither text nor a list of chat messages "
                              '({"role": ..., "content": text})')
    if not all(isinstance(r, str) for r in responses):
        raise TetherError("every response must be a string")
    return prompts, responses


class RewardServer(ThreadingHTTPServer):
    """The HTTP server around one frozen reward model: bound at once (a port in use is one
    line), listening once `load` has the model."""

    daemon_threads = True

    def __init__(self, cfg: ServeRMConfig):
        self.cfg, self.model, self.info = cfg, None, {}
        self.lock = threading.Lock()  # one forward at a time: each request scores as alone
        super().__init__((cfg.host, cfg.port), _Handler, bind_and_activate=False)
        try:
            self.server_bind()
        except OSError as exc:
            self.server_close()
            raise TetherError(f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc});"
                              " choose another --port (0: any free one) or stop what holds it"
                              ) from None

    def load(self, model: nn.Module, kind: str) -> None:
        """Serve `model` (frozen, on its device) from now on."""
        self.model, self.info = model, model_info(model, self.cfg, kind)
        self.server_activate()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def score(self, body) -> list[float]:
        prompts, responses = _pairs(body)
        if not self.info["chat_template"] and any(is_messages(p) for p in prompts):
            raise TetherError(f"the prompts are chat messages but the reward model "
                              f"{self.cfg.model} has no chat template to render them with")
        with self.lock, torch.no_grad():
            scores = self.model.score_texts(prompts, responses, self.cfg.batch_size)
        return scores.tolist()


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")  # NaN stays NaN: the client names it
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/info":
            self._answer(200, self.server.info)
        else:
            self._answer(404, {"error": f"no {self.path}; GET /info or POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self._answer(404, {"error": f"no {self.path}; POST /score or GET /info"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            self._answer(400, {"error": f"the body is not JSON ({exc})"})
            return
        try:
            self._answer(200, {"scores": self.server.score(body)})
        except TetherError as exc:
            self._answer(400, {"error": str(exc)})
        except Exception as exc:  # a bug or the device (out of memory): 500, the client retries
            line = (str(exc).splitlines() or [""])[0][:300]
            self._answer(500, {"error": f"{type(exc).__name__}: {line}"})

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: no line per request
        pass


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
        server.server_close()
        raise
    return server


def serve(server: RewardServer) -> threading.Thread:
    """Serve on a thread (stopped by `server.shutdown()`); returns it."""
    thread = threading.Thread(target=server.serve_forever, name="serve-rm", daemon=True)
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
    thread = serve(server)
    print(f"serving {cfg.model} on {server.url} (POST /score)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    print(f"stopped serving {cfg.model} ({received[0] if received else 'done'})", flush=True)
    return 0
