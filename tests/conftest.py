"""Shared fixtures: a tiny tokenizer and causal LM saved to disk, so loading code is real."""

from __future__ import annotations

import os
import random

# The suite never reaches a model or data hub: names that are not local fail fast, offline. Set
# before anything imports huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tether.models.tiny import save_tiny  # noqa: E402

# The suite's models are tiny: with 2 intra-op threads the thread hand-offs cost more than the
# maths (the offline-stage tests took 98 s with 2 threads and 10 s with 1 on an idle machine).
# CI runs the tests that compare across processes again with TETHER_TEST_THREADS=2
# (tests/processes.py): a comparison whose sides are not pinned to one count then fails.
torch.set_num_threads(int(os.environ.get("TETHER_TEST_THREADS", "1")))

@pytest.fixture
def no_loads(monkeypatch):
    """Every model load fails the test at once, and is recorded should a stage catch the error:
    the bad-input tests' proof that a check ran before any weights loaded. Patched where every
    load of every stage goes through (transformers' `PreTrainedModel.from_pretrained`)."""
    import transformers

    calls = []

    def refuse(cls, *args, **kwargs):
        calls.append(cls.__name__)
        raise AssertionError(f"{cls.__name__} was loaded before the bad input was found")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    return calls


WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene "
         "film story music ending long short loved hated it and but very quite").split()


def sample_texts(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a saved tokenizer (BPE, ~300 tokens, no pad token) and 2-layer GPT-2 model."""
    return save_tiny(tmp_path_factory.mktemp("tiny_lm"), sample_texts(), vocab_size=300)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Path to a saved Llama-style tokenizer (adds BOS, chat template, no pad token) and a 2-layer
    Llama-style model (rotary positions, grouped-query attention, untied head)."""
    from tether.models.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), sample_texts(), vocab_size=300)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    """A Mistral-style model (sliding window 8, GQA, untied head) with a SentencePiece-style
    Metaspace tokenizer that adds BOS and an `[INST]` template that does not write BOS."""
    from tether.models.tiny import save_tiny_mistral

    return save_tiny_mistral(tmp_path_factory.mktemp("tiny_mistral"), sample_texts(),
                             vocab_size=300, sliding_window=8)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A Qwen2.5-Instruct-style model: ChatML, pad `<|endoftext|>`, two EOS ids in
    generation_config, tied head; layer 0 full attention, layer 1 a window of 8."""
    from tether.models.tiny import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), sample_texts(), vocab_size=300,
                           use_sliding_window=True, sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="session")
def tiny_qwen2_tools_dir(tmp_path_factory):
    """The Qwen2.5-style model with a tool-calling ChatML template (schemas in the system turn,
    `<tool_call>` JSON blocks, `tool` results as `<tool_response>` in a user turn) and
    `<tool_call>` `</tool_call>` as single tokens."""
    from tether.models.tiny import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_tools"), sample_texts(),
                           vocab_size=300, tools=True)


# A chat template for the GPT-2 model (which has none): role markers, EOS after every turn.
GPT2_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                      "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                      "{% endif %}")


def with_chat_template(model_dir, template: str, out_dir):
    """A copy of the saved model at `model_dir` under `out_dir`, its tokenizer given `template`."""
    import shutil

    from tether.models.pretrained import load_tokenizer

    shutil.copytree(model_dir, out_dir)
    tok = load_tokenizer(str(out_dir))
    tok.chat_template = template
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def gpt2_chat_dir(tiny_model_dir, tmp_path_factory):
    """The GPT-2 model with GPT2_CHAT_TEMPLATE: chat rows on a model without a template of its own."""
    return with_chat_template(tiny_model_dir, GPT2_CHAT_TEMPLATE,
                              tmp_path_factory.mktemp("gpt2_chat") / "model")
