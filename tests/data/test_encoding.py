"""One encoding rule for every stage: BOS exactly once whoever writes it, PPO prompts encoded as
SFT saw them, truncation that keeps the special prefix, chat preference rows, responses tokenised
in their prompt's context (SentencePiece/Metaspace), and a distinct pad for two-EOS models."""

import json

import pytest

from tether.data.encoding import encode_preferences, encode_sft, special_prefix
from tether.data.prompts import encode_prompt_row, load_prompts
from tether.errors import TetherError
from tether.models.pretrained import eos_token_ids, load_causal_lm, load_tokenizer

# Zephyr's shape: no bos_token in the template; the tokenizer's post-processor adds BOS.
ZEPHYR_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                   "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
USER = {"role": "user", "content": "the movie was long"}
REPLY = {"role": "assistant", "content": "it was fine."}
OTHER = {"role": "assistant", "content": "it was dull."}


@pytest.fixture(scope="module")
def llama_tok(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def zephyr_tok(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    tok.chat_template = ZEPHYR_TEMPLATE
    return tok


@pytest.mark.parametrize("which", ["llama_tok", "zephyr_tok"])
def test_bos_exactly_once_and_ppo_prompt_equals_sft_prompt(which, request, tmp_path):
    tok = request.getfixturevalue(which)
    bos = tok.bos_token_id
    # the Llama-style template writes BOS itself; the Zephyr-style one relies on the tokenizer
    rendered = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tok.bos_token) == (which == "llama_tok")
    sft, _ = encode_sft(tok, [{"messages": [USER, REPLY]}], max_length=128)
    assert sft[0].prompt.count(bos) == 1 and sft[0].prompt[0] == bos
    # the ids are exactly the rendered text's tokens with one BOS in front
    assert sft[0].prompt == [bos] + tok(rendered.removeprefix(tok.bos_token), add_special_tokens=False)["input_ids"]
    # a chat file and a plain one (a file mixing them is refused: test_ambiguous_input.py)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [USER]}) + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "the movie"}) + "\n"
                                          + json.dumps({"prompt": "<s>the movie"}) + "\n")
    texts, ids = load_prompts(str(tmp_path / "chat.jsonl"), tok, max_len=128)
    assert ids[0] == sft[0].prompt  # PPO continues exactly the prompt SFT trained on
    assert texts[0] == rendered
    _, ids = load_prompts(str(tmp_path / "plain.jsonl"), tok, max_len=128)
    plain = [bos] + tok("the movie", add_special_tokens=False)["input_ids"]
    assert ids[0] == plain  # a plain prompt gets the tokenizer's BOS
    assert ids[1] == plain  # a pre-rendered prompt that writes BOS does not get a second one


def test_gpt2_tokenizer_adds_nothing(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    assert special_prefix(tok) == []
    ids = encode_prompt_row(tok, {"prompt": "the movie"}, 64, special_prefix(tok))[1]
    assert ids == tok("the movie")["input_ids"]


def test_max_prompt_len_keeps_the_special_prefix(llama_tok):
    tok, bos = llama_tok, llama_tok.bos_token_id
    long = " ".join(["the movie was long and dull"] * 8)
    _, ids = encode_prompt_row(tok, {"prompt": long}, 10, special_prefix(tok))
    full = encode_prompt_row(tok, {"prompt": long}, 1000, special_prefix(tok))[1]
    assert len(ids) == 10 and ids[0] == bos and ids[1:] == full[-9:]  # BOS + the last 9 tokens
    system = {"role": "system", "content": "be brief"}
    row = {"messages": [system, {"role": "user", "content": long}]}
    _, ids = encode_prompt_row(tok, row, 24, special_prefix(tok))
    text = tok.decode(ids)
    assert len(ids) <= 24 and ids.count(bos) == 1 and ids[0] == bos
    # markers, the system message and the generation prompt stay; the user content lost its start
    assert text.startswith("<s><|system|>\nbe brief</s>\n<|user|>\n")
    assert text.endswith("dull</s>\n<|assistant|>\n")
    assert len(full) > 24
    with pytest.raises(TetherError, match="cannot fit max_prompt_len=8"):
        encode_prompt_row(tok, {"messages": [{"role": "system", "content": long}, USER]}, 8,
                          special_prefix(tok))


def _sft_equivalent(tok, prompt_messages, reply):
    return encode_sft(tok, [{"messages": prompt_messages + [reply]}], max_length=256)[0][0]


@pytest.mark.parametrize("row", [
    {"prompt": [USER], "chosen": [REPLY], "rejected": [OTHER]},
    {"prompt": [USER], "chosen": REPLY, "rejected": OTHER},
    {"prompt": [USER], "chosen": REPLY["content"], "rejected": OTHER["content"]},
    {"prompt": [USER], "chosen": [USER, REPLY], "rejected": [USER, OTHER]},
    {"chosen": [USER, REPLY], "rejected": [USER, OTHER]},
], ids=["message-lists", "messages", "strings", "full-conversations", "implicit-prompt"])
def test_chat_preference_rows_read_like_sft_messages(llama_tok, row):
    tok = llama_tok
    examples, _ = encode_preferences(tok, [row], max_length=256)
    ex = examples[0]
    chosen, rejected = _sft_equivalent(tok, [USER], REPLY), _sft_equivalent(tok, [USER], OTHER)
    assert ex.prompt == chosen.prompt == rejected.prompt
    assert ex.responses == [chosen.responses[0], rejected.responses[0]]
    # one BOS, no Python repr of the messages, one EOS (the template's) closing each response:
    # the "\n" the template writes after it is never generated, so it is not trained on either
    assert ex.prompt.count(tok.bos_token_id) == 1 and "{'role'" not in tok.decode(ex.prompt)
    assert [r.count(tok.eos_token_id) for r in ex.responses] == [1, 1]
    assert [r[-1] for r in ex.responses] == [tok.eos_token_id] * 2


def test_plain_rows_no_second_bos_or_eos(llama_tok):
    tok = llama_tok
    row = {"prompt": "<s>the movie", "chosen": " was fine.</s>", "rejected": " was dull."}
    ex = encode_preferences(tok, [row], max_length=64)[0][0]
    assert ex.prompt.count(tok.bos_token_id) == 1
    assert [r.count(tok.eos_token_id) for r in ex.responses] == [1, 1]
    assert all(r[-1] == tok.eos_token_id for r in ex.responses)


def test_chat_preference_bad_input_is_one_line(tiny_model_dir, llama_tok):
    no_template = load_tokenizer(str(tiny_model_dir))
    cases = [
        (no_template, {"prompt": [USER], "chosen": [REPLY], "rejected": [OTHER]}, "no chat template"),
        (llama_tok, {"prompt": [USER], "chosen": [USER], "rejected": [OTHER]},
         "row 0 'chosen' must be one assistant message after the prompt"),
        (llama_tok, {"prompt": "the movie", "chosen": [REPLY], "rejected": [OTHER]}, "mixes a plain-text prompt"),
        (llama_tok, {"prompt": [USER], "chosen": 3.0, "rejected": [OTHER]}, "'chosen' must be a string"),
        (llama_tok, {"prompt": [USER], "chosen": [REPLY], "rejected": [REPLY]}, "identical chosen and rejected"),
    ]
    for tok, row, message in cases:
        with pytest.raises(TetherError, match=message) as info:
            encode_preferences(tok, [row], max_length=64, source="p.jsonl")
        assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def metaspace_tok(tiny_mistral_dir):
    return load_tokenizer(str(tiny_mistral_dir))


def test_metaspace_response_ids_are_those_of_the_joint_text(metaspace_tok):
    tok = metaspace_tok
    # chat: after "[/INST]" the reply has no leading "▁"; tokenised alone it would get one
    messages = [{"role": "user", "content": "the movie"}, {"role": "assistant", "content": "was good."}]
    ex = encode_sft(tok, [{"messages": messages}], max_length=64)[0][0]
    joint = tok(tok.apply_chat_template(messages, tokenize=False))["input_ids"]
    assert ex.prompt + ex.responses[0] == joint
    alone = tok("was good.</s>", add_special_tokens=False)["input_ids"]
    assert ex.responses[0] != alone  # so the check above can fail
    # plain rows: prompt + response tokenised together, then EOS
    row = {"prompt": "the movie", "chosen": "s was good", "rejected": " was bad"}
    ex = encode_preferences(tok, [row], max_length=64)[0][0]
    for text, response in zip(("s was good", " was bad"), ex.responses, strict=True):
        assert ex.prompt + response == tok("the movie" + text)["input_ids"] + [tok.eos_token_id]


def test_two_eos_model_gets_a_distinct_pad(tiny_qwen2_dir):
    tok = load_tokenizer(str(tiny_qwen2_dir))
    model = load_causal_lm(str(tiny_qwen2_dir), tok)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    # generation_config lists both; the tokenizer shipped <|endoftext|> as its pad
    assert eos_token_ids(tok, model.config, model.generation_config) == sorted([endoftext, im_end])
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id not in (endoftext, im_end)
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
