"""What the record of an adapter's base costs (`tether.models.adapter_checks.base_record`, written
as `tether_base.json` and compared on every adapter load), against a SHA-256 of every weight.

Two models, built from their configs (no download): the test suite's tiny Llama, and one of
Llama-2-7B's shapes in bfloat16 (`to_empty` on the CPU: 12.6 GiB of memory reserved, not
written; the record reads 8 values per weight, a few pages). The hash is timed on 1 GiB and
scaled to the 7B's bytes. Medians of `--repeats`; docs/loading.md quotes the figures.

    python bench/adapter_record.py [--repeats 3] [--no-7b]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time

import torch

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401
from tether.models.adapter_checks import base_record
from tether.models.tiny import save_tiny_llama


def record_cost(model, name: str, repeats: int) -> int:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        record = base_record(model, name)
        times.append(time.perf_counter() - started)
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n / 1e6:.1f}M parameters, {len(record['tensors'])} tensors, record "
          f"{statistics.median(times) * 1e3:.1f} ms, {len(json.dumps(record, indent=1)) / 1e3:.0f} "
          "kB of JSON")
    return n


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-7b", action="store_true", help="skip the 12.6 GiB model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        words = "the movie was good bad great awful fine dull fun boring plot".split()
        texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(200)]
        tiny = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp, texts, 300))
    record_cost(tiny, "tiny Llama (the test fixture's shape)", args.repeats)
    if args.no_7b:
        return
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    big = big.to_empty(device="cpu")
    n = record_cost(big, "Llama-2-7B shapes (bf16)", args.repeats)
    del big
    block = torch.zeros(256 * 2**20, dtype=torch.uint8).numpy()  # 256 MiB
    started = time.perf_counter()
    for _ in range(4):
        hashlib.sha256(block).digest()
    per_gib = time.perf_counter() - started
    print(f"SHA-256: {per_gib:.2f} s per GiB -> {per_gib * n * 2 / 2**30:.1f} s for the 7B's "
          f"{n * 2 / 2**30:.1f} GiB in bf16, on every load")


if __name__ == "__main__":
    main()
