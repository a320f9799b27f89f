"""`tether tiny-model --arch gpt2|llama|mistral|qwen2 [--chat] --output DIR`: an untrained tiny
causal LM and its tokenizer, made offline in seconds by tether.models.tiny's builders (the ones
the tests and examples/calculator use), the tokenizer's BPE trained on the demo's corpus.

It is for trying every command on a machine with no hub: its answers are random, so what it
shows is the plumbing (loading, templates, EOS ids, sampling, checkpoints), never learning.
"""

from __future__ import annotations

from pathlib import Path

from tether.demo import task
from tether.demo.config import TinyModelConfig
from tether.models import tiny
from tether.models.saving import atomic_dir

ARCHS = {"gpt2": tiny.save_tiny, "llama": tiny.save_tiny_llama, "mistral": tiny.save_tiny_mistral,
         "qwen2": tiny.save_tiny_qwen2}
POSITIONS = 1024  # room for the default --max-prompt-len and a multi-turn episode


def tiny_model(output: str | Path, arch: str = "gpt2", chat: bool = False) -> Path:
    """Build the tiny `arch` model (with its family's chat template when `chat`) and save it
    with its tokenizer to `output`, which must not exist or be empty (TinyModelConfig's checks);
    written beside it under a temporary name and renamed into place once whole."""
    TinyModelConfig(arch=arch, chat=chat, output=str(output)).validate()
    out = Path(output)
    sizes = {"n_positions": POSITIONS} if arch == "gpt2" else {"max_positions": POSITIONS, "chat": chat}
    with atomic_dir(out) as tmp:  # a build that fails or is stopped leaves no half-written folder
        ARCHS[arch](tmp, task.corpus(2000, seed=0), **sizes)
    return out


def cli(argv: list[str]) -> int:
    """`tether tiny-model --arch ARCH [--chat] --output DIR`."""
    from tether.run.parse import parse_config

    cfg = parse_config(TinyModelConfig, argv, prog="tether tiny-model")
    out = tiny_model(cfg.output, cfg.arch, cfg.chat)
    print(f"{out}: a tiny untrained {cfg.arch} model and tokenizer ({'with' if cfg.chat else 'no'}"
          " chat template); pass it as --model or --policy")
    return 0
