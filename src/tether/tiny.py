"""Build small tokenizers and causal LMs locally, with no download.

Tests, benchmarks and the demo use these so the real Hugging Face loading code runs on models that
fit a laptop CPU: train a byte-level BPE on text we already have, wrap it as a
`PreTrainedTokenizerFast`, build a model with `from_config`, and `save_pretrained` both. Two
families: GPT-2-style (absolute positions, tied head, BOS = EOS) and Llama-style (rotary
positions, grouped-query attention, untied head, a tokenizer that adds BOS, a chat template).
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
BOS = "<s>"
LLAMA_EOS = "</s>"
# A Llama-3-style template: it writes BOS itself and marks every turn; the generation prompt
# opens an assistant turn.
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_llama_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE like `make_tokenizer`, but Llama-style: distinct BOS and EOS, a
    post-processor that puts BOS before every encoded text, a chat template, and no pad token."""
    from tokenizers import processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, LLAMA_EOS, "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=LLAMA_EOS)
    tokenizer.chat_template = LLAMA_CHAT_TEMPLATE
    return tokenizer


def make_llama_lm(vocab_size: int, bos_token_id: int, eos_token_id: int, n_layer: int = 2,
                  hidden_size: int = 64, n_head: int = 4, n_kv_head: int = 2,
                  max_positions: int = 256, seed: int = 0, **config_kwargs):
    """A randomly initialised Llama-style causal LM: rotary positions, RMSNorm, SwiGLU,
    grouped-query attention (`n_kv_head` < `n_head`) and an untied LM head."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=n_layer,
                         num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **config_kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def save_tiny_llama(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512,
                    **lm_kwargs) -> Path:
    """Train a Llama-style tokenizer on `texts`, build a matching Llama-style LM, save both."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_llama_tokenizer(texts, vocab_size)
    model = make_llama_lm(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                          **lm_kwargs)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out
