"""Run several stage configs in one torchrun launch (one process group, one start-up).

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py SPEC.json

SPEC.json is a list of {"stage": "sft" | "rm" | "dpo" | "ppo" | "rloo" | "grpo", "config":
{field: value}, "stop_after": N}; each runs in turn through the stage's Python `run`, exactly as
`tether <stage>` would (a config's `fsdp` chooses DDP or FSDP2 for that run). With `stop_after`
(offline stages) the run dies in optimizer step N + 1 on every rank, like a killed job (its last
checkpoint stays). The tests compare the results with one-process runs; `run_spec` is also how
they make those, in their own process.
"""

from __future__ import annotations

import json
import os
import sys

from tether.run import distributed
from tether.train import dpo, ppo, ppo_config, reward, sft

STAGES = {"sft": (sft, sft.SFTConfig), "rm": (reward, reward.RMConfig),
          "dpo": (dpo, dpo.DPOConfig), "ppo": (ppo, ppo_config.PPOConfig),
          "rloo": (ppo, ppo_config.RLOOConfig), "grpo": (ppo, ppo_config.GRPOConfig)}


class Stop(Exception):
    """The simulated kill of a `stop_after` run."""


def run_one(item: dict) -> None:
    module, config = STAGES[item["stage"]]
    real, calls = getattr(module, "optimizer_step", None), []  # ppo has none: no stop_after

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) > item["stop_after"]:
            raise Stop
        return real(*args, **kwargs)
    if item.get("stop_after") is not None:
        module.optimizer_step = step
    try:
        module.run(config(**item["config"]))
    except Stop:
        pass
    finally:
        if real is not None:
            module.optimizer_step = real


def run_spec(items: list[dict]) -> None:
    for item in items:
        run_one(item)


if __name__ == "__main__":
    if os.environ.get("TETHER_IGNORE_OPTION"):  # the options audit reaches the ranks too
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "audit"))
        from ignore_option import ENV, install

        install(os.environ[ENV])
    run_spec(json.loads(open(sys.argv[1], encoding="utf-8").read()))
    # Every rank past its last collective before any leaves, then the exit the `tether` command
    # takes under torchrun (`distributed.exit_process`: no interpreter finalization, where a rank
    # sometimes aborted after all its work and failed the whole launch).
    distributed.barrier()
    distributed.teardown()
    distributed.exit_process(0)
