"""Build small tokenizers and causal LMs locally, with no download.

Tests, benchmarks and the demo use these so the real Hugging Face loading code runs on models that
fit a laptop CPU: train a byte-level BPE on text we already have, wrap it as a
`PreTrainedTokenizerFast`, build a GPT-2-style model with `from_config`, and `save_pretrained` both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def make_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with an EOS token and deliberately no pad token.

    No pad token, like GPT-2 and Llama: the loading code must add a distinct one (pad is not EOS).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def make_lm(vocab_size: int, n_layer: int = 2, n_embd: int = 64, n_head: int = 2,
            n_positions: int = 256, seed: int = 0):
    """A randomly initialised GPT-2-style causal LM built with `from_config` (dropout kept at the
    library default, so code that must switch it off is exercised)."""
    import torch

    config = GPT2Config(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def save_tiny(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512, **lm_kwargs) -> Path:
    """Train a tokenizer on `texts`, build a matching LM, and save both to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(texts, vocab_size)
    model = make_lm(len(tokenizer), **lm_kwargs)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out
