"""OpenEnv environments as tether environments (the `openenv` extra, openenv-core).

An OpenEnv environment runs as a server (FastAPI; one session per WebSocket connection, its own
`Environment` instance); a client (`openenv.core.EnvClient`, async, or its `.sync()` wrapper)
drives one session: `reset(**kwargs)` and `step(action)` each return a `StepResult` with
`observation`, `reward` (float or None) and `done`. Here each tether episode is one session:

    reset(row, seed)   client.reset(**reset(row, seed)) (default `seed=seed`: the k samples of
                       a prompt meet the same task); its observation as the first prompt
    step(text)         client.step(action(text)); reward None counts 0.0, but with done it is
                       refused (OpenEnv's JSON writes a NaN reward as null, so a missing final
                       reward may be a NaN); done ends the episode and closes the session. An
                       episode tether truncates (--max-turns, its token budget) is never told
                       it ended: its session closes at the end of its batch (tether calls every
                       environment's `close()`; a finalizer closes it too, should a failed
                       batch drop it), so sessions do not pile up on the server.

    make_env = openenv_environment(lambda: MyEnv(base_url=URL), action=MyAction)
    --env openenv:http://127.0.0.1:8000?action=message&observation=text&chat=true

`action` turns the policy's text into what the client's step takes: a function, an Action class
with one string field (`MyAction(message=text)`), or, with a server URL instead of a client (the
generic client, plain dicts), a field name or nothing (the action's one string field, read from
the server's /schema). `observation` turns an observation into text or chat messages: a
function, a field name, or nothing (the observation's one string field). The server must hold
one session per episode of a batch at once (`max_concurrent_envs` >= this rank's rows).
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any

from tether.errors import TetherError
from tether.run.extras import require

SKIPPED = ("reward", "done", "metadata")  # an observation's fields that are not its content
OPTIONS = ("action", "observation", "chat")  # --env openenv:<url>?<options>


def openenv_environment(client: str | Callable[[], Any], *, action: Any = None,
                        observation: str | Callable[[Any], Any] | None = None,
                        reset: Callable[[dict, int], dict] | None = None,
                        chat: bool = False) -> Callable:
    """A tether environment factory whose episodes are sessions of an OpenEnv server (the
    module docstring). `client`: the server's URL, or a function returning a new client (each
    episode has its own). `chat`: the first observation as a user turn instead of plain text."""
    core = require("openenv.core", "openenv_environment()")
    if isinstance(client, str):
        url = client.rstrip("/")
        if action is None or isinstance(action, str):
            action = _keyword_action(dict, _text_field(_schema(url)["action"], "action", action))

        def connect():
            return core.GenericEnvClient(base_url=url)
    elif action is None or isinstance(action, str):
        raise TetherError("openenv_environment(client): give action=, the client's Action class "
                          "(one string field) or a function from text to an action")
    else:
        connect = client
    if isinstance(action, type):  # an Action class: its one string field takes the text
        action = _keyword_action(action, _text_field(action.model_json_schema(), action.__name__,
                                                   None))
    to_text = observation if callable(observation) else _field_reader(observation)
    begin = reset or (lambda row, seed: {"seed": seed})

    def make_env() -> OpenEnvEpisode:
        opened = connect()
        if not isinstance(opened, core.SyncEnvClient):
            opened = opened.sync()  # an EnvClient (async): run on a loop of its own
        return OpenEnvEpisode(opened, action, to_text, begin, chat)
    # tether names a factory `module:qualname` in its errors: here `openenv:<url or client>`
    make_env.__module__ = "openenv"
    make_env.__qualname__ = url if isinstance(client, str) else getattr(client, "__qualname__",
                                                                          "client")
    return make_env


def from_spec(url: str, options: dict[str, str], where: str) -> Callable:
    """The factory `--env openenv:<url>?<options>` names (`where`: that value)."""
    if not url.startswith(("http://", "https://", "ws://", "wss://")):
        raise TetherError(f"--env {where}: give the OpenEnv server's URL, e.g. "
                          "--env openenv:http://127.0.0.1:8000")
    require("openenv.core", f"--env {where}")  # the install hint, naming the --env value
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TetherError(f"--env {where}: no option {unknown[0]!r}; the options are "
                          f"{', '.join(OPTIONS)}")
    chat = options.get("chat", "false").lower()
    if chat not in ("true", "false", "1", "0"):
        raise TetherError(f"--env {where}: chat={options['chat']!r}; give true or false")
    return openenv_environment(url, action=options.get("action"),
                               observation=options.get("observation"),
                               chat=chat in ("true", "1"))


class OpenEnvEpisode:
    """One episode: one session of the server, through a synchronous client."""

    def __init__(self, client, action: Callable[[str], Any], observation: Callable[[Any], Any],
                 reset: Callable[[dict, int], dict], chat: bool):
        self.client, self.action, self.observation = client, action, observation
        self.begin, self.chat = reset, chat
        # Closes the session once: at done, or when tether drops a truncated episode.
        self.close = weakref.finalize(self, _close_in_background, client)

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        result = _called(lambda: self.client.reset(**self.begin(row, seed)), opening=True)
        first = self.observation(result.observation)
        return [{"role": "user", "content": first}] if self.chat and isinstance(first, str) \
            else first

    def step(self, action: str) -> tuple[Any, float, bool]:
        result = _called(lambda: self.client.step(self.action(action)))
        done = bool(result.done)
        if done:
            self.close()
        if result.reward is None and done:  # OpenEnv's JSON writes a NaN reward as null
            raise TetherError("OpenEnv: the server sent no reward (null) with done; its JSON "
                              "writes a NaN reward as null, and a failed episode is a low reward, "
                              "not NaN: return a finite float from the step that ends it")
        reward = 0.0 if result.reward is None else float(result.reward)
        return (None if done else self.observation(result.observation)), reward, done


def _called(call: Callable[[], Any], opening: bool = False) -> Any:
    """`call()`, with the failures a user fixes outside their code said in one line: no server,
    a full one, and one that went away. A full server answers a new session (`opening`: its
    first call) with an error and closes it at once, cleanly (code 1000): the client reads the
    error, or, when the close overtakes its first message, a closed connection (websockets'
    ConnectionClosed). A server that stops or dies closes its sessions otherwise (1012 from a
    restart, 1006 from a crash), at any call."""
    from websockets.exceptions import ConnectionClosed  # openenv-core's own dependency

    try:
        return call()
    except ConnectionError as exc:  # refused: nothing listens there
        raise TetherError(f"OpenEnv: {exc}; start the server or fix its URL") from exc
    except (RuntimeError, ConnectionClosed) as exc:
        if "CAPACITY_REACHED" in str(exc):
            what = str(exc)
        elif not isinstance(exc, ConnectionClosed):
            raise
        elif opening and getattr(exc.rcvd, "code", None) == 1000:
            what = f"the server closed the new session ({exc}), as a full one does"
        else:
            raise TetherError(f"OpenEnv: the session ended ({exc}): the server stopped, "
                              "crashed or restarted; see its log and start it again") from exc
        raise TetherError(f"OpenEnv: {what}; tether holds one session per episode of a batch at "
                          "once: start the server with max_concurrent_envs >= that, or lower "
                          "--batch-size (else see the server's log)") from exc


def _close_in_background(client) -> None:
    """Close a session without holding up the batch (a server that went away can keep a close
    waiting for seconds)."""
    def close() -> None:
        with contextlib.suppress(Exception):  # the session is over either way
            client.close()
    threading.Thread(target=close, daemon=True, name="tether-openenv-close").start()


def _schema(url: str) -> dict:
    """The server's JSON schemas of its action, observation and state (GET /schema)."""
    http = "http" + url[2:] if url.startswith("ws") else url
    try:
        with urllib.request.urlopen(f"{http}/schema", timeout=30) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise TetherError(f"cannot read the OpenEnv schema at {http}/schema ({exc}); start the "
                          "server or fix its URL") from exc


def _one_field(fields: dict[str, bool], what: str, named: str | None, fix: str) -> str:
    """`named`, or the one string field of `fields` (name -> whether it holds text), or one line
    listing them; `fix`: how to name the one meant."""
    if named is None:
        text = [k for k, is_text in fields.items() if is_text]
        if len(text) != 1:
            raise TetherError(f"the OpenEnv {what} has {len(text)} string fields "
                              f"({', '.join(fields)}); {fix} or pass a function")
        return text[0]
    if named not in fields:
        raise TetherError(f"the OpenEnv {what} has no field {named!r}; it has "
                          f"{', '.join(fields) or 'none'}")
    return named


def _text_field(schema: dict, what: str, named: str | None) -> str:
    """`named`, or the one string field of a JSON schema (`_one_field`)."""
    fields = {k: v.get("type") == "string" for k, v in schema.get("properties", {}).items()
              if k not in SKIPPED}
    return _one_field(fields, what, named, "name the one the policy's text goes to "
                      "(action=<field>)")


def _keyword_action(make: Callable[..., Any], field: str) -> Callable[[str], Any]:
    """text -> `make(field=text)`: the generic client's dict (`make` dict), or an Action class's
    instance."""
    return lambda text: make(**{field: text})


def _field_reader(field: str | None) -> Callable[[Any], Any]:
    """An observation (a dict, an Observation model, an object) -> its field `field`, or its one
    string field: text as it is, chat messages (a list) as they are, anything else as str()."""
    def read(observation: Any) -> Any:
        if hasattr(observation, "model_dump"):  # an Observation (pydantic)
            values = observation.model_dump()
        else:  # the generic client's dict, or a plain object of the client's own
            values = dict(observation) if isinstance(observation, dict) else vars(observation)
        values = {k: v for k, v in values.items() if k not in SKIPPED}
        name = _one_field({k: isinstance(v, str) for k, v in values.items()}, "observation",
                          field, "name the one to show the policy (observation=<field>)")
        value = values[name]
        return value if isinstance(value, (str, list)) else str(value)
    return read
