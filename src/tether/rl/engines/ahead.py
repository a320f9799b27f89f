"""Generation ahead of the trainer (--max-staleness S): a copy of the policy samples later
batches in a second process while the trainer updates on the current one.

    trainer process                               generator process (its own copy of the policy)
    prefetch(prompts of batch b + L)   ------>    serves its inbox in order:
    update batch b: optimizer steps                  weights v      load them: version v
    sync(): the trained weights, version v' -->      sample j       sample with version v, tag
    sample(prompts of batch b + 1)     <------                      each token v, record
                                                                    log pi_v(y_t)

Versions count optimizer steps (`tether.run.optim.StepCounter`, a hook on the optimizer's
`step`), so gradient accumulation, several minibatches and several epochs per batch are all
counted. The inbox is
served in order, so a request is sampled by the last weights sent before it: which version
samples which batch follows from the order of the trainer's calls alone, never from timing, and
a run is as reproducible as the synchronous one. The loop asks for batch b + L before it updates
batch b (L = S // the optimizer steps a batch takes, `PPOConfig.batches_ahead`): the weights the
generator holds then are those batch b starts from, and batch b + L is trained L batches, at
most S steps, later. Training takes batches in order, oldest first, and none is dropped.

The recorded log-probs are the behaviour policy's (`Rollout.engine_logprobs`): the update
recomputes the proximal policy's on the same tokens and weights each token by the truncated
ratio pi_prox / pi_behaviour (decoupled PPO, Hilton et al. 2021; `tether.rl.engines.mismatch`).

Weights travel in memory: the trainable parameters only (the whole model, or with LoRA the
adapter alone: the base is frozen and the copy holds it already), flattened into one tensor per
dtype, which the queue moves into shared memory; each sync is its own snapshot, so the trainer
never writes over weights the generator has not read yet. Under torchrun each rank runs its own
generator on its slice of the rows; under FSDP2 its copy is made before the policy is sharded,
and each sync gathers the shards whole (`flatten`, on every rank alike).

This module is the trainer's side; what runs in the generator process is
`tether.rl.engines.generator`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker

import torch
from torch import nn

from tether.choices import ENGINES, entry
from tether.errors import TetherError
from tether.rl.engines import RolloutEngine
from tether.rl.engines.generator import next_message, serve
from tether.rl.engines.jobs import Background, T
from tether.rl.engines.weights import flatten, trainable
from tether.rl.rollout import Rollout
from tether.run.jobs import available_cores
from tether.run.optim import StepCounter


def request_key(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: dict) -> str:
    """What identifies a sampling request: the prompts, their mask, the noise and the settings
    (a prefetched batch is taken only by the call that asks for exactly it)."""
    digest = hashlib.sha256()
    for t in (prompt_ids, prompt_mask, settings.get("uniforms")):
        if t is not None:
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    rest = {k: v for k, v in settings.items() if k not in ("uniforms", "generator")}
    digest.update(repr(sorted((k, tuple(v) if isinstance(v, list) else v)
                              for k, v in rest.items())).encode())
    return digest.hexdigest()


class AheadEngine(RolloutEngine):
    """A `RolloutEngine` whose samples come from the generator process (see the module's
    docstring). `prefetch` asks for a batch without waiting; `sample` takes a prefetched batch
    when one matches, or asks for it now (a --dynamic-sampling refill, an evaluation: the
    current weights sample it). Every rollout carries the behaviour log-probs and, per token,
    the version that sampled it."""

    own_logprobs = True
    lockstep = False  # each rank's generator is a process of its own: no collective in sampling

    def __init__(self, launched: Launched, counter: StepCounter, params: list[nn.Parameter],
                 device: torch.device, keep: int = 0):
        self.launched = launched
        self.counter, self.params, self.device = counter, params, device
        self.pending: dict[str, int] = {}  # request key -> ticket, asked for, not yet taken
        self.ready: dict[int, tuple[int, object]] = {}  # ticket -> (version, answer), arrived
        self.tickets = 0
        self.threads = 0  # the generator's torch threads, as it reports them once started
        self.jobs: list[Background] = []  # work submitted and not yet waited for, in order
        # (version, flat weights) of the last `keep` syncs, the oldest first: what a checkpoint
        # needs to sample the batches in flight again on resume (`state_dict`)
        self.history: deque[tuple[int, dict[torch.dtype, torch.Tensor]]] = deque(maxlen=keep)
        self.replay: list = []  # a resumed run's: the weights of each batch in flight, in order
        self.replayed = None  # the weights the replay sent last

    # -- RolloutEngine
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> Rollout:
        self._drain()
        return self._sample(prompt_ids, prompt_mask, settings)

    def prefetch(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> None:
        """Ask for this batch now, sampled by the weights last synced; `sample` takes it."""
        self._drain()
        self._replayed()
        key = request_key(prompt_ids, prompt_mask, settings)
        if key not in self.pending:
            self.pending[key] = self._ask(prompt_ids, prompt_mask, settings)

    def submit(self, work: Callable[[Turns], T]) -> Background[T]:
        """Run `work` now in a thread of this process (after the work submitted before it),
        sampling through the generator with the weights last synced: the trainer updates
        meanwhile. Every other call waits for the work first (`_drain`), so the requests of a
        job reach the generator before any weights sent after it: all its turns are sampled by
        one version, whatever the timing."""
        self._replayed()
        job = Background(lambda: work(Turns(self)), self.jobs[-1] if self.jobs else None)
        self.jobs.append(job)
        return job

    def sync(self) -> None:
        """Send the trained weights, tagged with the optimizer steps taken (also when none were:
        a resumed run's weights changed without a step)."""
        self.replay = []  # a resumed run's batches in flight are all asked for by now
        weights = (self.counter.version, flatten(self.params))
        self._load(weights)
        self.history.append(weights)

    def state_dict(self) -> dict:
        """The weights the generator was given last (`keep` of them, the oldest first): the
        versions, and the flat tensors named `<index>/<dtype>` (a checkpoint's tensors file)."""
        tensors = {f"{i}/{str(dtype).removeprefix('torch.')}": flat
                   for i, (_, by_dtype) in enumerate(self.history)
                   for dtype, flat in by_dtype.items()}
        return {"ahead_versions": [version for version, _ in self.history], "tensors": tensors}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's engine (`state_dict`'s, in a checkpoint's state): the batches in flight
        are asked for again (`prefetch`, `submit`) in the order the uninterrupted run asked for
        them, each sampled by the weights of its time. With L = keep - 1 batches ahead, batch
        p >= start was asked for at the start of batch p - L, so the i-th request after a resume
        is sampled by held[i] (h = keep of them held; fewer, from an older checkpoint: the oldest
        stand in for those missing, and with none the weights restored)."""
        held = [(v, {}) for v in state.get("ahead_versions", [])]  # (version, flat weights)
        for name, flat in state.get("tensors", {}).items():
            index, _, dtype = name.partition("/")
            held[int(index)][1][getattr(torch, dtype)] = flat
        held = held or [(self.counter.version, flatten(self.params))]
        keep, h = self.history.maxlen or 1, len(held)
        self.replay = [held[max(i - keep + h, 0)] for i in range(keep - 1)]
        self.history = deque(held[:-1], maxlen=self.history.maxlen)

    def close(self) -> None:  # a job still running ends on its next request: the process is gone
        self.launched.close()

    # -- plumbing
    def _sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: dict
                ) -> Rollout:
        """The prefetched batch when one matches, or one asked for now; each token tagged."""
        ticket = self.pending.pop(request_key(prompt_ids, prompt_mask, settings), None)
        if ticket is None:
            ticket = self._ask(prompt_ids, prompt_mask, settings)
        version, rollout = self._answer(ticket)
        rollout = rollout.map_rows(lambda t: t.to(self.device))
        rollout.versions = torch.where(rollout.action_mask, version, 0).long()
        return rollout

    def _load(self, weights: tuple[int, dict[torch.dtype, torch.Tensor]]) -> None:
        """Give the generator these (version, `flatten`'s) weights, after the submitted work."""
        self._drain()
        self._put(("weights", *weights))

    def _replayed(self) -> None:
        """Before a resumed run's request for a batch in flight: the weights it was sampled by
        (`load_state_dict`), sent when they are not those sent last."""
        if self.replay:
            weights = self.replay.pop(0)
            if weights is not self.replayed:
                self._load(weights)
                self.replayed = weights

    def _drain(self) -> None:
        """Wait until the submitted work is over (a job's error is raised by its `result`)."""
        waiting, self.jobs = self.jobs, []
        for job in waiting:
            job.done.wait()

    def _ask(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: dict) -> int:
        self.tickets += 1
        settings = {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                    for k, v in settings.items() if k != "generator"}
        self._put(("sample", self.tickets, prompt_ids.cpu(), prompt_mask.cpu(), settings))
        return self.tickets

    def _put(self, message: tuple) -> None:
        if not self.launched.process.is_alive():
            raise self._ended()
        self.launched.inbox.put(message)

    def _answer(self, ticket: int) -> tuple[int, object]:
        while ticket not in self.ready:
            message = next_message(self.launched.outbox, self.launched.process)
            if message is None:
                raise self._ended()
            got, version, answer = message
            if got == "error":
                raise RuntimeError(f"the generator process failed:\n{answer}")
            self.ready[got] = (version, answer)
        return self.ready.pop(ticket)

    def _ended(self) -> TetherError:
        return TetherError(f"the generator process (--max-staleness) ended with exit code "
                           f"{self.launched.process.exitcode} (out of memory, or killed); lower "
                           "--max-staleness or --batch-size, or pass --max-staleness 0")


class Turns:
    """The engine a submitted job samples through: `AheadEngine`'s requests without its wait for
    the submitted work (the job is that work)."""

    own_logprobs = True
    lockstep = False

    def __init__(self, engine: AheadEngine):
        self.engine = engine

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> Rollout:
        return self.engine._sample(prompt_ids, prompt_mask, settings)


def split_threads(trainer: int, generator: int, ahead: bool) -> tuple[int, int]:
    """(the trainer's requested threads, the generator's): as given; with a generator and 0
    given, it takes half the cores (at least 1) and the trainer the rest (its --threads 0, auto,
    would otherwise take them all and the two processes would contend for every core)."""
    if not ahead:
        return trainer, 0
    cores = available_cores()
    generator = generator or max(1, cores // 2)
    return trainer or max(1, cores - generator), generator


def warn(settings) -> None:
    """A warning line on stderr (rank 0; `build` calls this once) for each setting of a run
    sampling ahead that is accepted but does less than it says: an S past a whole number of
    batches, whose rest no batch can use (L = S // k), and more generator threads than the
    cores, which only wait on each other."""
    steps, cores, threads = settings.steps_per_batch, available_cores(), settings.generator_threads
    lines = [f"--max-staleness {settings.max_staleness} is not a multiple of the {steps} "
             f"optimizer steps each batch takes, so it samples {settings.batches_ahead} batches "
             f"ahead as --max-staleness {settings.batches_ahead * steps} does; give that"
             ] if settings.max_staleness % steps else []
    lines += [f"--generator-threads {threads} is more than the {cores} cores this process may "
              "use, and threads past them only wait on each other; give at most that many, or "
              "0 (half the cores)"] if threads > cores else []
    for line in lines if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {line}", file=sys.stderr, flush=True)


@dataclass
class Launched:
    """A generator process started ahead of its copy of the policy (`launch`), and its queues."""

    process: object
    inbox: object
    outbox: object

    def close(self) -> None:
        """Ask it to end, and end it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.inbox.put(("close",))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        tracker = resource_tracker._resource_tracker
        if tracker._fd is not None and not tracker._check_alive():
            # killed with the generator (`pkill -9 -P` of the trainer ends both): at exit each
            # queue semaphore's finalizer still unlinks it, but its unregister would start a new
            # tracker that prints a KeyError for every name it never saw
            resource_tracker.unregister = lambda name, rtype: None


def launch(threads: int) -> Launched:
    """Start the generator process now, before the policy it will copy is loaded: a fresh
    interpreter importing torch and transformers takes seconds, which the trainer's own loading
    then hides. `start` sends it the copy."""
    ctx = torch.multiprocessing.get_context("spawn")  # a fork would copy the trainer's threads
    inbox, outbox = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=serve, args=(threads, inbox, outbox), daemon=True,
                          name="tether-generator")
    process.start()
    return Launched(process, inbox, outbox)


def start(settings, model: nn.Module, peft: nn.Module | None, counter: StepCounter,
          threads: int, longest_prompt: int, device: torch.device,
          replica: tuple | None = None, launched: Launched | None = None,
          keep: int = 0) -> AheadEngine:
    """The generator process (`launched`, or one started now), with the engine
    `settings.engine` names, on `replica`: by default a copy of (`model`, the policy as
    prepared, before any wrapper; `peft`, the PeftModel holding its adapter, or None). Returns
    the trainer's side; waits until the engine is ready, so a failure shows here, before the
    first batch. Under FSDP2 `model`'s parameters are shards: `replica` is then such a copy made
    before the model was sharded, with its trainable parameters in `model`'s order. `keep`: how
    many of the weights it is given the engine remembers for checkpoints
    (`AheadEngine.state_dict`), the first being those the copy starts with."""
    launched = launched or launch(threads)
    if replica is None:  # its own weights (the queue shares what it sends), and one copy: peft
        replica = copy.deepcopy((model, peft))  # holds the model, the same object in the copy
    # the engine's generator travels with the copy (by reference: an engine registered in the
    # trainer's process need not be in this one's table)
    generator = entry(ENGINES, settings.engine, "engine").generator
    launched.inbox.put(("start", replica, settings, longest_prompt, device, generator))
    del replica
    engine = AheadEngine(launched, counter, trainable(model), device, keep)
    if keep:  # the weights the copy holds: every batch until the first sync samples them
        engine.history.append((counter.version, flatten(engine.params)))
    # the copy arrives, or the process ends (its traceback is on stderr), within 10 minutes
    answer = next_message(launched.outbox, launched.process, time.monotonic() + 600.0)
    if answer is None:
        engine.close()
        raise TetherError(f"the generator process (--max-staleness) did not start (exit code "
                          f"{launched.process.exitcode}); see the lines above, or pass "
                          "--max-staleness 0")
    if answer[0] == "error":
        engine.close()
        raise RuntimeError(f"the generator process failed to start:\n{answer[2]}")
    engine.threads = answer[2]
    return engine
