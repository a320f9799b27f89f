"""`tether STAGE ...` (sft or an online stage) that stops for good inside step STOP_AT (default 3),
as a live training process would look from outside: steps before it are logged and checkpointed,
the run directory is locked, and a checkpoint is being written (a `.tmp-step_N-*` directory, what
`--resume` cleans up after a kill). It then writes its pid to READY_FILE and sleeps until killed.

    READY_FILE=/path python tests/lock_holder.py sft --model ... --save-every 1 --log-every 1

With HOLD=0 it is plain `tether STAGE ...`; NO_PROBE=1 drops the early check of `RunDir`, so the
lock is met where it is taken, in `save_config` (under torchrun: the refusal every rank shares),
and each rank writes the message it raised to RANK_ERRORS/rank<N>.
"""

import os
import sys
import time
from pathlib import Path

from tether import cli
from tether.errors import TetherError
from tether.run import lock
from tether.run.rundir import RunDir
from tether.train import ppo, sft

STOP_AT = int(os.environ.get("STOP_AT", "3"))


def _args_value(flag: str) -> str:
    return sys.argv[sys.argv.index(flag) + 1]


def hold_forever() -> None:
    run_dir = Path(_args_value("--output-dir")) / _args_value("--run-name")
    half = run_dir / "checkpoints" / f".tmp-step_{STOP_AT}-holder"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"half-written")
    Path(os.environ["READY_FILE"]).write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def stop_at(real):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == STOP_AT:
            hold_forever()
        return real(*args, **kwargs)
    return wrapper


if os.environ.get("HOLD", "1") == "1":
    sft.optimizer_step = stop_at(sft.optimizer_step)  # once per SFT step
    ppo.collect_batch = stop_at(ppo.collect_batch)  # once per online batch
if os.environ.get("NO_PROBE") == "1":
    lock.probe = lambda *args, **kwargs: None
    real_save_config = RunDir.save_config

    def save_config(self, cfg):  # each rank notes what it raised (the CLI prints rank 0's)
        try:
            return real_save_config(self, cfg)
        except TetherError as exc:
            Path(os.environ["RANK_ERRORS"], f"rank{os.environ['RANK']}").write_text(str(exc))
            raise
    RunDir.save_config = save_config

sys.exit(cli.main(sys.argv[1:]))
