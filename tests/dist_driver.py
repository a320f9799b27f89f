"""Run several stage configs in one torchrun launch (one process group, one start-up).

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py SPEC.json

SPEC.json is a list of {"stage": "sft" | "rm" | "dpo" | "ppo" | "rloo" | "grpo", "config":
{field: value}}; each runs in turn through the stage's Python `run`, exactly as `tether <stage>`
would (a config's `fsdp` chooses DDP or FSDP2 for that run). The tests compare the results
with one-process runs.
"""

import json
import sys

from tether import distributed
from tether.train import dpo, ppo, ppo_config, reward, sft

STAGES = {"sft": (sft, sft.SFTConfig), "rm": (reward, reward.RMConfig),
          "dpo": (dpo, dpo.DPOConfig), "ppo": (ppo, ppo_config.PPOConfig),
          "rloo": (ppo, ppo_config.RLOOConfig), "grpo": (ppo, ppo_config.GRPOConfig)}


def main(spec_path: str) -> int:
    for item in json.loads(open(spec_path, encoding="utf-8").read()):
        module, config = STAGES[item["stage"]]
        module.run(config(**item["config"]))
    distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
