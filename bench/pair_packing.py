"""Packed vs padded pair steps (`tether rm --pack`, `tether dpo --pack`): the forward and backward
of one micro-batch of preference pairs of uneven length, side by side, reporting tokens/s and
peak memory.

The batch: B pairs, prompts of U(8, 64) tokens, chosen and rejected responses of U(8, 256) each
(seeded). The step is the stage's own code: rm, `tether.train.reward.pair_scores` then `rm_loss`
on the padded [2B, L] two-row batch (`collate_pairs`), padded or packed; dpo, the policy's
`tether.train.dpo.pair_logprobs` (chunked LM head) then `pair_losses` against a fixed reference,
on the default shared-prompt row (`collate_shared`), the two-row batch padded, or packed. A
GPT-2-shaped model built from its config.

Each variant runs in a fresh process (`python bench/pair_packing.py --child ...`), so its peak
memory is its own: the child's `ru_maxrss` after the steps minus before them (see
bench/packing.py for why ru_maxrss). Time: the median of `--repeats` steps after one warm-up
step, each child on one thread, wall clock and CPU time; tokens/s counts the real tokens of the
pairs (prompt + chosen + rejected, the prompt once), the same in every variant; slots, the token
slots each forward runs (padded rows, the shared rows, or the packed rows).

    python bench/pair_packing.py [--pairs 8] [--layers 4] [--width 256] [--repeats 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

# isort: split
from packing import alternated, timed_steps  # bench/packing.py: the same runs and timing

VARIANTS = ["rm padded", "rm packed", "dpo shared", "dpo padded", "dpo packed"]


def pairs(n: int, vocab: int, seed: int):
    from tether.data.encoding import Encoded

    rng = random.Random(seed)

    def ids(k):
        return [rng.randrange(1, vocab) for _ in range(k)]
    return [Encoded(ids(rng.randint(8, 64)), [ids(rng.randint(8, 256)), ids(rng.randint(8, 256))])
            for _ in range(n)]


def child(args) -> dict:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, GPT2Config

    from tether.data.batches import collate_pairs
    from tether.data.packing import pack_rows
    from tether.models.pair_row import collate_shared
    from tether.models.reward_model import RewardModel
    from tether.train.dpo import pair_logprobs, pair_losses
    from tether.train.offline_config import DPOConfig
    from tether.train.reward import pair_scores, rm_loss

    torch.set_num_threads(1)  # one core each: CPU time is then a fair measure on a shared machine
    torch.manual_seed(0)
    stage, layout = args.child.split()
    config = GPT2Config(vocab_size=512, n_layer=args.layers, n_embd=args.width,
                        n_head=max(1, args.width // 64), n_positions=1024)
    examples = pairs(args.pairs, 512, seed=1)
    packed = layout == "packed"
    if stage == "rm":
        model = RewardModel(AutoModel.from_config(config)).eval()  # dropout off, as in rm
        batch = collate_pairs(examples, 0)

        def loss():
            chosen, rejected = pair_scores(model, batch, packed)
            return rm_loss(chosen, rejected, None, 0.0)[0]
    else:
        model = AutoModelForCausalLM.from_config(config).eval()  # dropout off, as in dpo
        batch = collate_shared(examples, 0) if layout == "shared" else collate_pairs(examples, 0)
        cfg = DPOConfig(model="m", data="d", run_name="bench", share_prompt=layout == "shared")
        with torch.no_grad():  # the reference: the starting policy (loss ln 2 at the first step)
            reference = pair_logprobs(model, batch, True, packed)[:2]

        def loss():
            policy = pair_logprobs(model, batch, True, packed)
            return pair_losses(cfg, policy, *reference)[0].mean()

    def step():
        model.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        return float(value)

    measured = timed_steps(step, args.repeats)
    tokens = sum(len(e.prompt) + len(e.responses[0]) + len(e.responses[1]) for e in examples)
    slots = int(batch["input_ids"].numel())
    if packed:
        packing = pack_rows(batch["attention_mask"])
        slots = packing.packed_rows * packing.packed_width
    return measured | {"tokens": tokens, "slots": slots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=VARIANTS, default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    out = alternated(__file__, VARIANTS, args.rounds,
                     ["--pairs", str(args.pairs), "--layers", str(args.layers), "--width",
                      str(args.width), "--repeats", str(args.repeats)])
    tokens = out["rm padded"]["tokens"]
    print(f"batch: {args.pairs} pairs, prompts U(8, 64), responses U(8, 256); {tokens} real "
          f"tokens (prompt once); GPT-2 {args.layers} layers x {args.width}; medians of "
          f"{args.rounds} alternated processes x {args.repeats} steps")
    print(f"{'':11} {'slots':>6} {'s/step':>8} {'cpu s':>8} {'tokens/s':>9} {'tok/cpu s':>9} "
          f"{'peak MiB':>9} {'loss':>10}")
    for name, r in out.items():
        print(f"{name:11} {r['slots']:6d} {r['seconds']:8.3f} {r['cpu_seconds']:8.3f} "
              f"{r['tokens'] / r['seconds']:9.0f} {r['tokens'] / r['cpu_seconds']:9.0f} "
              f"{r['peak_mib']:9.1f} {r['loss']:10.6f}")
    for stage, base in (("rm", "rm padded"), ("dpo", "dpo padded"), ("dpo", "dpo shared")):
        a, b = out[base], out[f"{stage} packed"]
        print(f"{stage} packed / {base}: tokens/s x{a['seconds'] / b['seconds']:.2f} (wall), "
              f"x{a['cpu_seconds'] / b['cpu_seconds']:.2f} (CPU time), peak memory "
              f"x{b['peak_mib'] / max(a['peak_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
