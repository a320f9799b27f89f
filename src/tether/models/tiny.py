"""Build small tokenizers and causal LMs locally, with no download.

Tests, benchmarks and the demo use these so the real Hugging Face loading code runs on models that
fit a laptop CPU: train a byte-level BPE on text we already have, wrap it as a
`PreTrainedTokenizerFast`, build a model with `from_config`, and `save_pretrained` both. Four
families:
- GPT-2-style: absolute positions, tied head, BOS = EOS.
- Llama-style: rotary positions, grouped-query attention, untied head, a tokenizer that adds BOS,
  a chat template that writes BOS itself.
- Mistral-style: Llama's architecture with a sliding attention window, and a SentencePiece-style
  (Metaspace) tokenizer that adds BOS, with an `[INST]` chat template that does not write BOS.
- Qwen2-style: tied head, a byte-level tokenizer with no BOS, ChatML template, `<|endoftext|>`
  as pad token and two EOS ids in `generation_config` (like Qwen2.5-Instruct), optional sliding
  window on the upper layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

from tether.run.atomic import follow_umask

EOS = "<|endoftext|>"


def _byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A BPE over GPT-2's byte-level pieces, trained on `texts`, `special_tokens` first in its
    vocabulary: the tokenizer under the GPT-2, Llama and Qwen2 families."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def _from_config(config, seed: int):
    """A randomly initialised causal LM of `config`, its weights drawn after `manual_seed(seed)`."""
    import torch

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _save(out_dir: str | Path, tokenizer, model, chat: bool = True) -> Path:
    """`tokenizer` and `model` saved to `out_dir` (made when missing); without `chat`, the
    tokenizer's chat template left out (a base model's tokenizer)."""
    tokenizer.chat_template = tokenizer.chat_template if chat else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    follow_umask(out)  # safetensors writes its files 0600
    return out


def make_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with an EOS token and deliberately no pad token.

    No pad token, like GPT-2 and Llama: the loading code must add a distinct one (pad is not EOS).
    """
    tok = _byte_level_bpe(texts, vocab_size, [EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def make_lm(vocab_size: int, n_layer: int = 2, n_embd: int = 64, n_head: int = 2,
            n_positions: int = 256, seed: int = 0):
    """A randomly initialised GPT-2-style causal LM built with `from_config` (dropout kept at the
    library default, so code that must switch it off is exercised)."""
    config = GPT2Config(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    return _from_config(config, seed)


def save_tiny(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512, **lm_kwargs) -> Path:
    """Train a tokenizer on `texts`, build a matching LM, and save both to `out_dir`."""
    tokenizer = make_tokenizer(texts, vocab_size)
    return _save(out_dir, tokenizer, make_lm(len(tokenizer), **lm_kwargs))


# ----------------------------------------------------------------------------- Llama-style

BOS = "<s>"
LLAMA_EOS = "</s>"
# A Llama-3-style template: it writes BOS itself and marks every turn; the generation prompt
# opens an assistant turn.
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _bos_first(tok: Tokenizer) -> None:
    """Give `tok` a post-processor that puts BOS before every encoded text (Llama's and
    Mistral's tokenizers)."""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])


def make_llama_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE like `make_tokenizer`, but Llama-style: distinct BOS and EOS, a
    post-processor that puts BOS before every encoded text, a chat template, and no pad token."""
    tok = _byte_level_bpe(texts, vocab_size,
                          [BOS, LLAMA_EOS, "<|user|>", "<|assistant|>", "<|system|>"])
    _bos_first(tok)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=LLAMA_EOS)
    tokenizer.chat_template = LLAMA_CHAT_TEMPLATE
    return tokenizer


def make_llama_lm(vocab_size: int, bos_token_id: int, eos_token_id: int, n_layer: int = 2,
                  hidden_size: int = 64, n_head: int = 4, n_kv_head: int = 2,
                  max_positions: int = 256, seed: int = 0, config_class=None, **config_kwargs):
    """A randomly initialised Llama-style causal LM: rotary positions, RMSNorm, SwiGLU,
    grouped-query attention (`n_kv_head` < `n_head`) and an untied LM head. `config_class`:
    `LlamaConfig` unless given (Mistral's and Qwen2's take the same fields); `config_kwargs` add
    to the fields or override them."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return _from_config((config_class or LlamaConfig)(**(fields | config_kwargs)), seed)


def save_tiny_llama(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512,
                    chat: bool = True, **lm_kwargs) -> Path:
    """Train a Llama-style tokenizer on `texts`, build a matching Llama-style LM, save both
    (`chat`: with the chat template)."""
    tokenizer = make_llama_tokenizer(texts, vocab_size)
    model = make_llama_lm(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                          **lm_kwargs)
    return _save(out_dir, tokenizer, model, chat)


# ----------------------------------------------------------------------------- Mistral-style

UNK = "<unk>"
# Mistral-Instruct v0.1's shape: no BOS in the template (the tokenizer adds it), `[INST]` as plain
# text, the reply closed by EOS.
MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")
# Characters a chat template or a test may use beyond the training texts (there is no byte
# fallback, so anything else would become <unk>).
_ASCII = [chr(c) for c in range(32, 127)] + ["\n"]


def make_metaspace_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer like Llama 2's and Mistral's: spaces become `▁` and are
    part of the next word's token (Metaspace pre-tokenizer and decoder, a `▁` prepended to the
    first word only), a BPE over those pieces, BOS added before every text, no pad token.

    Its defining trait for training code: a text tokenised alone gets a `▁` in front ("was" ->
    `▁was`), while the same text inside a longer one after a special token or `]` does not
    ("[/INST]was" -> `... ] was`), so a response tokenised apart from its prompt gets other ids.
    """
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, BOS, LLAMA_EOS],
                                  initial_alphabet=_ASCII + ["\u2581"], show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    _bos_first(tok)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=LLAMA_EOS,
                                        unk_token=UNK)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def save_tiny_mistral(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512,
                      sliding_window: int = 8, chat: bool = True, **lm_kwargs) -> Path:
    """A Mistral-style model (Llama's blocks, attention limited to the last `sliding_window`
    positions, untied head, GQA) with a Metaspace tokenizer (`chat`: with the chat template),
    saved to `out_dir`. `lm_kwargs`: the sizes and seed of `make_llama_lm`."""
    from transformers import MistralConfig

    tokenizer = make_metaspace_tokenizer(texts, vocab_size)
    model = make_llama_lm(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                          config_class=MistralConfig, sliding_window=sliding_window, **lm_kwargs)
    return _save(out_dir, tokenizer, model, chat)


# ----------------------------------------------------------------------------- Qwen2-style

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ChatML with tools the way Qwen2.5-Instruct and Hermes lay them out: the tools' JSON schemas in
# the system turn, an assistant's calls as `<tool_call>` JSON blocks after its content, and the
# `tool` results of one step gathered into one user turn of `<tool_response>` blocks. transformers
# renders templates with trim_blocks, which drops a newline right after a tag: hence `{{ '\\n' }}`.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You can call these functions:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] != 'system' or not loop.first %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "{% set f = c['function'] if 'function' in c else c %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_qwen2_tokenizer(texts: Iterable[str], vocab_size: int = 512, tools: bool = False
                         ) -> PreTrainedTokenizerFast:
    """A byte-level BPE like Qwen2.5-Instruct's: no BOS, EOS `<|im_end|>`, pad `<|endoftext|>`
    (which is also one of the model's EOS ids), ChatML template; with `tools`, the template that
    renders tool schemas, calls and results, and `<tool_call>` `</tool_call>` as single tokens
    (as Qwen2.5's vocabulary has them)."""
    tok = _byte_level_bpe(texts, vocab_size, [EOS, IM_START, IM_END])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOS)
    tokenizer.chat_template = CHATML_TEMPLATE
    if tools:
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
        tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def save_tiny_qwen2(out_dir: str | Path, texts: Iterable[str], vocab_size: int = 512,
                    use_sliding_window: bool = False, sliding_window: int = 8,
                    max_window_layers: int = 1, hidden_size: int = 64, spare_rows: int = 0,
                    tools: bool = False, intermediate_size: int | None = None,
                    max_positions: int | None = None, chat: bool = True, **lm_kwargs) -> Path:
    """A Qwen2-style model (tied head, GQA, qkv biases) saved with its tokenizer and a
    `generation_config` listing two EOS ids, `<|im_end|>` and `<|endoftext|>`.

    With `use_sliding_window`, layers from `max_window_layers` up attend within a window and the
    ones below attend to everything (Qwen2's mixed layout). `spare_rows`: embedding rows past the
    tokenizer's last id, as real Qwen2 models have (151936 rows for 151665 tokens). `tools`: the
    tool-calling template and tokens (make_qwen2_tokenizer). `intermediate_size` (default twice
    the width) and `max_positions` (default 1024 with tools, whose schemas make long prompts,
    else 256) for callers that size their own model. `chat`: with the chat template.
    `lm_kwargs`: the other sizes and the seed of `make_llama_lm`.
    """
    from transformers import Qwen2Config

    tokenizer = make_qwen2_tokenizer(texts, vocab_size, tools)
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, EOS])
    model = make_llama_lm(len(tokenizer) + spare_rows, endoftext, im_end, hidden_size=hidden_size,
                          max_positions=max_positions or (1024 if tools else 256),
                          config_class=Qwen2Config, tie_word_embeddings=True,
                          intermediate_size=intermediate_size or 2 * hidden_size,
                          use_sliding_window=use_sliding_window, sliding_window=sliding_window,
                          max_window_layers=max_window_layers, **lm_kwargs)
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.generation_config.pad_token_id = endoftext
    return _save(out_dir, tokenizer, model, chat)
