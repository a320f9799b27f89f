"""Small synthetic data sets for the offline-stage tests (SFT, RM, DPO), written to disk."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the movie was fine dull fun plot actor scene film story music ending long short it and".split()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _phrase(rng: random.Random, lo: int = 2, hi: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sft_rows(n: int = 32, seed: int = 0) -> list[dict]:
    """Prompts of random words; the response is a fixed, learnable function of the prompt
    (its first two words, then "good.")."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = _phrase(rng, 3, 5)
        rows.append({"prompt": prompt, "response": " " + " ".join(prompt.split()[:2]) + " good."})
    return rows


def preference_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """A learnable rule: the chosen response ends in "great." and the rejected one in "awful.",
    after the same random words, so only the rule separates them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        body = _phrase(rng)
        rows.append({"prompt": _phrase(rng), "chosen": f" {body} great.", "rejected": f" {body} awful."})
    return rows


def mask_runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(bit, ids) for each maximal run of equal mask bits: which stretches of an encoded row the
    loss reads."""
    out: list[tuple[int, list[int]]] = []
    for token, bit in zip(ids, mask, strict=True):
        if out and out[-1][0] == bit:
            out[-1][1].append(token)
        else:
            out.append((bit, [token]))
    return out


# A reward model's own chat template, unlike the policy's (tether.models.tiny's Llama-3 style one)
RM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n"
               "{% endfor %}{{ eos_token }}")


def other_weights(src: Path, dst: Path) -> None:
    """A copy of the model at `src` with every weight moved a little (same names and shapes):
    another model under the same files."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    save_file({k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
