"""Memory plan per model size for PPO (policy, reference, reward model, critic): arithmetic, not a run.

    python bench/scale/memory_plan.py                       # the table in docs/scaling.md
    python bench/scale/memory_plan.py --tokens 16384 --act-per-token-layer-d 20

Per-parameter costs (bytes per base parameter P; bf16 weights, fp32 AdamW states):
  full fine-tuning, separate critic: 4 bases resident (policy, reference, reward model, critic),
    bf16 weights 4 x 2, bf16 gradients of the two trained ones 2 x 2, AdamW m and v in fp32 for the
    two trained ones 2 x 8, and (column "+ fp32 master") an fp32 master copy of each trained one
    2 x 4, as mixed-precision AdamW usually keeps.
  LoRA, everything on one shared base: 1 bf16 base (2 bytes), plus three adapters (policy,
    critic, reward model) of rank r on every linear layer of the trunk, in fp32; the policy and
    critic adapters train (fp32 weight 4 + gradient 4 + AdamW 8 = 16 bytes per adapter parameter),
    the reward model's is frozen (4 bytes).
Activations (what one forward/backward of a micro-batch keeps for backward), per trunk that
trains (policy and critic run their own forward over the shared base):
  per token per layer: `act_per_token_layer_d` x hidden size bytes in fp32, halved in bf16
    (fitted on the 125M GPT-2 runs of bench/scale/memory.py; see docs/scaling.md for the fit);
  with gradient checkpointing: one bf16 hidden state per token per layer, plus one layer's full
    activations;
  LM head: a plain head keeps `head_fp32_copies` (fitted: 2.7) fp32 [response tokens, V] tensors
    (logits, their gradient, scratch); a chunked head keeps one 16 MiB chunk.
These are extrapolations from the stated rule, not measurements at these sizes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

GIB = 2**30
# name: (parameters, hidden, layers, intermediate, vocab, kv heads x head dim)
MODELS = {
    "Qwen2-0.5B": (494e6, 896, 24, 4864, 151936, 2 * 64),
    "Llama-3-8B": (8.03e9, 4096, 32, 14336, 128256, 8 * 128),
    "Llama-3-70B": (70.6e9, 8192, 80, 28672, 128256, 8 * 128),
}


def lora_params(hidden: int, layers: int, intermediate: int, kv: int, r: int) -> float:
    """Adapter parameters for rank r on q, k, v, o, gate, up, down: r * (d_in + d_out) each."""
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
              (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    return layers * sum(r * (a + b) for a, b in shapes)


def plan(name: str, args) -> dict[str, float]:
    params, hidden, layers, inter, vocab, kv = MODELS[name]
    full = params * (4 * 2 + 2 * 2 + 2 * 8)
    master = params * 2 * 4
    adapter = lora_params(hidden, layers, inter, kv, args.lora_r)
    lora = params * 2 + adapter * (2 * 16 + 4)
    act_layer = args.act_per_token_layer_d * hidden / 2  # bf16 activations
    trunk_act = args.tokens * layers * act_layer
    ckpt_act = args.tokens * (layers * hidden * 2 + act_layer)
    head_plain = args.response_tokens * vocab * 4 * args.head_fp32_copies
    head_chunked = 16 * 2**20
    return {"params": params, "full": full, "master": master, "adapter": adapter, "lora": lora,
            "act_2trunks": 2 * trunk_act, "act_ckpt_2trunks": 2 * ckpt_act,
            "head_plain": head_plain, "head_chunked": head_chunked}


def fit(paths: list[str], config: str = "full") -> dict[str, float]:
    """Least squares over bench/scale/memory.py --json outputs of one configuration:

        peak above imports = a * P + b * L * N + c * N

    P parameters of one base, L layers, N = minibatch rows x sequence length (tokens in one
    update forward). a: fixed bytes per base parameter (weights of every role, gradients, AdamW
    states); b: activation bytes per token per layer (policy and critic trunks together); c:
    bytes per token outside the layers (LM-head logits and their log-softmax/grad, embeddings).
    """
    import json

    import numpy as np

    rows, target, names = [], [], []
    for path in paths:
        data = json.loads(open(path).read())
        spec, result = data["spec"], data["results"].get(config)
        if not result or "above_imports_mib" not in result:
            continue
        d = spec.get("width", 768)  # runs written before "layers" was in the spec: GPT-2's count
        layers = spec.get("layers") or round((spec["base_params"] - (spec["vocab"] + 1024 + 2) * d)
                                             / (12 * d * d + 13 * d))
        tokens = spec["minibatch"] * (spec["prompt_len"] + spec["response_len"])
        rows.append([spec["base_params"], layers * tokens, tokens])
        target.append(result["above_imports_mib"] * 2**20)
        names.append(f"{Path(path).name}: L={layers} N={tokens}")
    if len(rows) < 4:
        raise SystemExit(f"fit: need 4 runs of {config!r} (2 layer counts x 2 lengths) for 3 "
                         f"unknowns and a residual; got {len(rows)}")
    x, *_ = np.linalg.lstsq(np.array(rows, float), np.array(target), rcond=None)
    for name, row, y in zip(names, rows, target):
        print(f"  {name}: measured {y / 2**20:.0f} MiB, fitted {np.dot(row, x) / 2**20:.0f} MiB")
    d, vocab = spec.get("width", 768), spec["vocab"]
    print(f"a = {x[0]:.1f} bytes per base parameter; b = {x[1] / 1024:.1f} KiB per token per "
          f"layer (two trunks) = {x[1] / 2 / d:.1f} x hidden bytes per trunk; c = "
          f"{x[2] / 1024:.1f} KiB per token = {2 * x[2] / (4 * vocab):.2f} fp32 V-rows per "
          f"response token (half the tokens are response tokens)")
    return {"bytes_per_param": x[0], "bytes_per_token_layer": x[1], "bytes_per_token": x[2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", nargs="+", default=[], help="bench/scale/memory.py --json files to fit")
    p.add_argument("--fit-config", default="full")
    p.add_argument("--tokens", type=int, default=4 * 1024,
                   help="tokens in one micro-batch forward (rows x sequence length)")
    p.add_argument("--response-tokens", type=int, default=4 * 512,
                   help="response tokens in that micro-batch (the LM head's rows)")
    p.add_argument("--act-per-token-layer-d", type=float, default=0.0,
                   help="fitted fp32 activation bytes per token per layer per hidden unit")
    p.add_argument("--head-fp32-copies", type=float, default=2.7,
                   help="fp32 [response tokens, V] tensors a plain LM head keeps (fitted)")
    p.add_argument("--lora-r", type=int, default=16)
    args = p.parse_args()
    if args.fit:
        fit(args.fit, args.fit_config)
        return
    if args.act_per_token_layer_d <= 0:
        p.error("give --act-per-token-layer-d (fitted from bench/scale/memory.py runs, docs/scaling.md)")
    print(f"micro-batch of {args.tokens} tokens ({args.response_tokens} response tokens), "
          f"LoRA rank {args.lora_r} on q,k,v,o,gate,up,down; GiB")
    print("| model | full FT fixed (4 bases) | + fp32 master | LoRA shared fixed (1 base) "
          "| activations, 2 trunks | with checkpointing | LM head plain | LM head chunked "
          "| full FT total (plain head, fp32 master) | LoRA total (chunked head, checkpointing) |")
    print("|---" * 10 + "|")
    for name in MODELS:
        m = plan(name, args)
        full_total = m["full"] + m["master"] + m["act_2trunks"] + m["head_plain"]
        lora_total = m["lora"] + m["act_ckpt_2trunks"] + m["head_chunked"]
        cells = [m["full"], m["master"], m["lora"], m["act_2trunks"], m["act_ckpt_2trunks"],
                 m["head_plain"], m["head_chunked"], full_total, lora_total]
        print(f"| {name} | " + " | ".join(f"{c / GIB:,.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
