"""The generator process of --max-staleness (`tether.rl.engines.ahead` is the trainer's side, and
says how the two work together): started before the trainer loads its models (`ahead.launch`), it
receives its copy of the policy and an engine, then serves the trainer's requests in order
(`serve`): weights to load, batches to sample.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import queue
import time
import traceback

import torch

from tether.rl.engines.weights import trainable, unflatten_into
from tether.run.distributed import Dist

# The generator is silent past start-up; a check of its liveness every this many seconds while
# the trainer waits for it.
POLL_S = 1.0
# What the generator imports as soon as it starts: the copy of the policy needs them to arrive.
PRELOAD = ("transformers", "tether.rl.engines.native", "tether.models.forward")  # a copy of a large model takes a while to arrive


def serve(threads: int, inbox, outbox) -> None:
    """The generator process. It starts before the trainer has loaded its models (`launch`),
    so its imports overlap the loading, and waits for ("start", replica, settings, longest
    prompt, device, generator): its engine (`generator`, the entry's in `tether.choices.ENGINES`)
    on `replica`, the (model, peft) copy of the policy. It then serves `inbox` in order until "close". Messages:
    ("weights",
    version, flat) load them into the copy and the engine; ("sample", ticket, ids, mask,
    settings) sample with the current weights and answer (ticket, version, rollout)."""
    engine = None
    trainer = multiprocessing.parent_process()
    try:
        torch.set_num_threads(threads)
        for name in PRELOAD:  # while the trainer loads its models, not after
            importlib.import_module(name)
        message = next_message(inbox, trainer)
        if message is None or message[0] != "start":
            return
        _, (model, peft), settings, longest_prompt, device, generator = message
        engine = generator(settings, model, peft, longest_prompt, Dist(device=device))
        params, version = trainable(model), 0
        outbox.put(("ready", os.getpid(), torch.get_num_threads()))
        while (message := next_message(inbox, trainer)) is not None:
            kind = message[0]
            if kind == "close":
                return
            if kind == "weights":
                _, version, flat = message
                unflatten_into(params, flat)
                engine.sync()  # vLLM takes them from the copy; the native engine samples it
            elif kind == "sample":
                _, ticket, ids, mask, asked = message
                rollout = engine.sample(ids.to(device), mask.to(device), **asked)
                outbox.put((ticket, version, rollout.map_rows(lambda t: t.cpu())))
    except Exception:  # noqa: BLE001 - any failure goes back to the trainer, which names it
        outbox.put(("error", None, traceback.format_exc()))
    finally:
        if engine is not None:
            engine.close()


def next_message(box, sender, deadline: float = math.inf) -> tuple | None:
    """`box`'s next message, or None once the process `sender` is gone (or past `deadline`, a
    `time.monotonic()`): a trainer killed outside its `close` (SIGKILL, out of memory) sends no
    "close", and without this the copy would wait, and hold its memory, forever; a generator
    that died answers nothing, and the trainer says so. A message it sent before it died is
    None too when its tensors can no longer be read: torch rebuilds each from a connection to
    the sender (refused, or cut, once it is gone)."""
    while True:
        try:
            return box.get(timeout=POLL_S)
        except queue.Empty:
            if sender is not None and not sender.is_alive() or time.monotonic() > deadline:
                return None
        except Exception:
            if sender is not None:  # a killed process is reaped a moment after its sockets close
                sender.join(POLL_S)
            if sender is None or sender.is_alive():
                raise  # the sender is alive: the error is the message's own
            return None
