"""The demo's inputs, made on the spot: its corpus, preference pairs and prompts (demo/task.py)
and an untrained tiny GPT-2 with a tokenizer trained on the corpus.

Each file is renamed into place once complete, so one that exists is whole; all are seeded, so a
resumed demo keeps what its first run wrote (it is what would be written again).
"""

from __future__ import annotations

import json
from pathlib import Path

from tether.demo import task
from tether.demo.config import DemoConfig
from tether.run.atomic import atomic_write_bytes


def _write_jsonl(path: Path, rows) -> str:
    """Write `rows()` as JSONL, atomically, unless `path` is there: each file is renamed into
    place once complete, so one that exists is whole (and seeded: what it would be again)."""
    if not path.is_file():
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows()).encode("utf-8"))
    return str(path)


def prepare_data(root: Path, cfg: DemoConfig) -> dict[str, str]:
    """Corpus, preference pairs, prompts and an untrained tiny model, all written under root;
    what a resumed demo's first run already wrote whole is kept."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    sentences = task.corpus(4000, seed=cfg.seed)
    split = [task.split_prompt(s) for s in sentences]
    return {
        "sft": _write_jsonl(data / "sft.jsonl",
                            lambda: [{"prompt": p, "response": r} for p, r in split]),
        "pairs": _write_jsonl(data / "pairs.jsonl",
                              lambda: task.preference_pairs(1000, cfg.seed + 1)),
        "prompts": _write_jsonl(data / "prompts.jsonl",
                                lambda: [{"prompt": p} for p in task.prompts(512, cfg.seed + 2)]),
        "eval_prompts": _write_jsonl(data / "eval_prompts.jsonl", lambda: [
            {"prompt": p} for p in task.prompts(128, cfg.seed + 3)]),
        "base": _save_base(root / "base", sentences, cfg.seed),
    }


def _save_base(out: Path, sentences: list[str], seed: int) -> str:
    """The untrained tiny GPT-2 and its tokenizer, saved under a temp name and renamed into place
    once complete (so a base that exists is whole), unless it is there."""
    from tether.models.saving import atomic_dir
    from tether.models.tiny import save_tiny

    if not out.is_dir():
        with atomic_dir(out) as tmp:
            save_tiny(tmp, sentences, vocab_size=400, n_layer=2, n_embd=64, n_head=2,
                      n_positions=64, seed=seed)
    return str(out)
