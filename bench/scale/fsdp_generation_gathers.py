"""FSDP2 all-gathers during one PPO rollout: `Roles.peek` (layers resharded after every forward,
so every generated token gathers every layer again) against `Roles.generate` (each layer gathered
once per rollout), side by side in one run on the tiny Llama-style model, 2 gloo ranks on the CPU.

    torchrun --nproc-per-node 2 bench/scale/fsdp_generation_gathers.py [--max-new-tokens 8]

Expected: peek 1 + layers x tokens (the root, then every layer at every token), generate
1 + layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from torch.distributed.fsdp import FSDPModule

from tether.models.tiny import save_tiny_llama
from tether.rl.engines.native import sample_responses
from tether.rl.rollout import left_pad
from tether.run import distributed
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import batch_rows, build

GATHERS = [0]
_all_gather = param_group.foreach_all_gather


def counting_all_gather(*args, **kwargs):
    GATHERS[0] += 1
    return _all_gather(*args, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    param_group.foreach_all_gather = counting_all_gather
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts = [f"the film was {w} and the plot {v}." for w in ("good", "bad", "dull")
                 for v in ("long", "fun", "slow")] * 20
        save_tiny_llama(root / "llama", texts, vocab_size=300)  # every rank writes the same files
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t[:12]}) + "\n"
                                                    for t in texts[:8]))
        cfg = PPOConfig(policy=str(root / "llama"), prompts=str(root / "prompts.jsonl"),
                        batch_size=8, device="cpu", fsdp=True,
                        max_new_tokens=args.max_new_tokens, output_dir=tmp)
        setup = build(cfg, reward_fn=lambda prompts, responses: [0.0] * len(responses))
        ids, mask = left_pad([setup.source.prompt_ids[i] for i in batch_rows(setup, cfg, 0)],
                             setup.tokenizer.pad_token_id, setup.dist.device)

        def generate(policy, _critic):
            return sample_responses(policy, ids, mask, max_new_tokens=args.max_new_tokens,
                                    temperature=1.0, eos_token_ids=[-1], pad_token_id=0)
        units = [m for m in setup.roles.wrapped.modules() if isinstance(m, FSDPModule)]
        counts = {}
        for name in ("peek", "generate"):
            for unit in units:  # start sharded (the root is otherwise kept after a forward)
                unit.reshard()
            GATHERS[0] = 0
            getattr(setup.roles, name)(generate)
            counts[name] = GATHERS[0]
        if setup.dist.is_main:
            print(f"all-gathers for {args.max_new_tokens} new tokens, "
                  f"{len(distributed.transformer_layers(setup.policy))} layers: "
                  f"peek {counts['peek']}, generate {counts['generate']}")
    distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
