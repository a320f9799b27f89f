"""Every row shape of docs/data.md: TRL's column conventions train without renaming (each table
row runs `tether sft`, `rm` or `dpo` a step on GPT-2- and Llama-style tiny models, and prompt rows
are read as PPO, eval and generate read them); completion, text and implicit-prompt rows encode
as their hand-built equivalents; content parts give the ids of the joined string; bad shapes are
one-line errors."""

import json
import math
import re
from pathlib import Path

import pytest

from tether.cli import main
from tether.data.batches import collate_sft
from tether.data.encoding import encode_preferences, encode_sft, special_prefix
from tether.data.prompts import encode_prompt_row, format_prompt, load_prompts, prompt_kind
from tether.data.shapes import implicit_prompt
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# GPT-2's tokenizer has no chat template: conftest's gpt2_chat_dir gives the tiny one a template
# for the chat shapes.


def table_rows() -> list[tuple[str, str, dict]]:
    """(stages, shape, example row) of each row of docs/data.md's table."""
    rows = []
    for line in (ROOT / "docs" / "data.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[2].startswith("`{"):
            rows.append((cells[0], cells[1], json.loads(cells[2].strip("`"))))
    return rows


TABLE = table_rows()
TRAINED = [(stage, shape, row) for stages, shape, row in TABLE
           for stage in ("sft", "rm", "dpo")
           if stage in stages.split(", ") or (stages == "every chat shape" and stage == "sft")]
PROMPT_ROWS = [(shape, row) for stages, shape, row in TABLE
               if stages.startswith("ppo") or stages == "every chat shape"]


def test_the_table_has_every_shape():
    # 6 SFT shapes, 6 preference shapes, 5 prompt shapes and the content-parts row
    assert [len([r for r in TABLE if r[0] == s]) for s in
            ("sft", "rm, dpo", "ppo, rloo, grpo, eval, generate", "every chat shape")] == [6, 6, 5, 1]
    assert len(TRAINED) == 6 + 1 + 2 * 6


@pytest.mark.parametrize("family", ["gpt2_chat_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("stage, shape, row", TRAINED, ids=[f"{s}-{h}" for s, h, _ in TRAINED])
def test_every_documented_row_shape_trains(stage, shape, row, family, request, tmp_path):
    model_dir = request.getfixturevalue(family)
    data = tmp_path / "data.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    out = tmp_path / "runs"
    argv = [stage, "--model", str(model_dir), "--data", str(data), "--run-name", "r",
            "--output-dir", str(out), "--max-steps", "1", "--batch-size", "2", "--device", "cpu"]
    assert main(argv) == 0
    metrics = {}  # rm writes its held-out evaluation on a line of its own
    for line in (out / "r" / "metrics.jsonl").read_text().splitlines():
        metrics |= json.loads(line)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/loss"] > 0
    if stage == "sft":
        assert metrics["data/rows"] == 4 and metrics["train/tokens"] > 0


@pytest.mark.parametrize("family", ["gpt2_chat_dir", "tiny_llama_dir"])
def test_every_documented_prompt_row_is_read_for_generation(family, request, tmp_path):
    # one file of the plain shapes and one of the chat shapes: a file mixing them is refused
    # (tests/data/test_ambiguous_input.py)
    plain = [(shape, row) for shape, row in PROMPT_ROWS if prompt_kind(row) == "plain text"]
    chats = [(shape, row) for shape, row in PROMPT_ROWS if prompt_kind(row) == "chat"]
    assert plain and chats
    for kind, rows in (("plain", plain), ("chat", chats)):
        _read_for_generation(request.getfixturevalue(family), family, rows, tmp_path / kind)


def _read_for_generation(model_dir, family, rows, tmp_path):
    tmp_path.mkdir()
    tok = load_tokenizer(str(model_dir))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _, row in rows))
    texts, ids = load_prompts(str(path), tok, max_len=256)
    for (shape, row), text in zip(rows, texts, strict=True):
        chat = row.get("messages", row["prompt"] if isinstance(row.get("prompt"), list) else None)
        if chat is None:  # plain: the prompt as it is; a `completion` beside it is ignored
            assert text == row["prompt"], shape
            continue
        chat = [dict(m, content=m["content"] if isinstance(m["content"], str) else
                     "".join(p["text"] for p in m["content"])) for m in chat]
        # rendered with the generation prompt, which opens a new assistant turn even after one
        assert text == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|assistant|>\n" if family == "tiny_llama_dir" else "<|assistant|>")
    # `tether generate` reads the same file end to end
    out = tmp_path / "samples.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompts", str(path),
                 "--max-new-tokens", "2", "--output", str(out), "--device", "cpu"]) == 0
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == texts


# ----------------------------------------------------------------------------- SFT shapes

@pytest.fixture(scope="module")
def llama_tok(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def gpt2_tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def _one(tok, row, **kwargs):
    ex = encode_sft(tok, [row], max_length=256, **kwargs)[0][0]
    return ex.prompt, ex.responses, ex.loss_mask


USER = {"role": "user", "content": "the movie"}
REPLY = {"role": "assistant", "content": "was good."}


@pytest.mark.parametrize("which", ["gpt2_tok", "llama_tok"])
def test_completion_rows_are_response_rows(which, request):
    tok = request.getfixturevalue(which)
    plain = {"prompt": "the movie", "completion": " was good."}
    assert _one(tok, plain) == _one(tok, {"prompt": "the movie", "response": " was good."})
    if which == "llama_tok":  # conversational: the same ids as the {messages} row
        chat = {"prompt": [USER], "completion": [REPLY]}
        assert _one(tok, chat) == _one(tok, {"messages": [USER, REPLY]})
        assert _one(tok, chat) == _one(tok, {"prompt": [USER], "completion": REPLY["content"]})


def test_message_lists_in_a_response_column_train_as_chat_turns(llama_tok):
    # Issue 24: a conversational row under tether's `response` name (what a TRL file becomes
    # after a rename) trained the Python text of the message list: 261 loss tokens for 29. It
    # is the {messages} row, or with a plain prompt a one-line refusal.
    row = {"prompt": [USER], "response": [REPLY]}
    assert _one(llama_tok, row) == _one(llama_tok, {"messages": [USER, REPLY]})
    _, responses, _ = _one(llama_tok, row)
    assert llama_tok.decode(responses[0]) == "was good.</s>" and "role" not in llama_tok.decode(
        responses[0])
    with pytest.raises(TetherError, match="mixes a plain-text prompt with a chat 'response'"):
        _one(llama_tok, {"prompt": "the movie", "response": [REPLY]})


def test_conversational_completion_trains_the_completion_only(llama_tok):
    tok = llama_tok
    earlier = {"role": "assistant", "content": "it was long."}
    second = {"role": "user", "content": "and the plot"}
    prompt, responses, mask = _one(tok, {"prompt": [USER, earlier, second], "completion": [REPLY]})
    # the assistant turn inside the prompt is context: the response is the completion alone
    assert mask is None and tok.decode(responses[0]) == "was good.</s>"
    assert "it was long." in tok.decode(prompt)
    # while in a {messages} row both assistant turns train
    _, responses, mask = _one(tok, {"messages": [USER, earlier, second, REPLY]})
    trained = [t for t, m in zip(responses[0], mask, strict=True) if m]
    assert tok.decode(trained) == "it was long.</s>was good.</s>"


@pytest.mark.parametrize("which", ["gpt2_tok", "llama_tok"])
def test_text_rows_train_every_token(which, request):
    tok = request.getfixturevalue(which)
    text = "the movie was good."
    (ex,), _ = encode_sft(tok, [{"text": text}], max_length=64)
    batch = collate_sft([ex], tok.pad_token_id)
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    bos = [tok.bos_token_id] if which == "llama_tok" else []  # GPT-2 adds no BOS
    assert ex.prompt == bos and ex.responses == [ids]
    assert batch["response_mask"][0].tolist() == [0] * len(bos) + [1] * len(ids)


def test_content_parts_give_the_ids_of_the_joined_string(llama_tok, tiny_qwen2_dir):
    for tok in (llama_tok, load_tokenizer(str(tiny_qwen2_dir))):
        def parts(text):
            return [{"type": "text", "text": text[:4]}, {"type": "text", "text": text[4:]}]
        strings = [USER, REPLY, {"role": "user", "content": "and the plot"},
                   {"role": "assistant", "content": "was dull."}]
        with_parts = [dict(m, content=parts(m["content"])) for m in strings]
        assert _one(tok, {"messages": with_parts}) == _one(tok, {"messages": strings})
        assert _one(tok, {"prompt": with_parts[:1], "completion": with_parts[1:2]}) == \
            _one(tok, {"messages": strings[:2]})
        pref = {"prompt": with_parts[:1], "chosen": with_parts[1:2], "rejected": with_parts[3:]}
        pref_strings = {"prompt": strings[:1], "chosen": strings[1:2], "rejected": strings[3:]}
        assert encode_preferences(tok, [pref], 256)[0] == encode_preferences(tok, [pref_strings], 256)[0]
        assert encode_prompt_row(tok, {"messages": with_parts[:3]}, 256, special_prefix(tok)) == \
            encode_prompt_row(tok, {"messages": strings[:3]}, 256, special_prefix(tok))
        assert "{'type'" not in format_prompt(tok, {"prompt": with_parts[:1]})


# ----------------------------------------------------------------------------- implicit prompts

@pytest.mark.parametrize("chosen, rejected, expected", [
    # the cut goes back to the word where the texts part; the space starts both responses
    ("The sky is blue.", "The sky is bleak.", ("The sky is", " blue.", " bleak.")),
    ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
    ("Q: sky?\nA: blue", "Q: sky?\nA: grey", ("Q: sky?\nA:", " blue", " grey")),
    ("a b  c", "a b  d", ("a b", "  c", "  d")),  # the whole whitespace run goes to the responses
    ("The sky is", "The sky is blue.", ("The sky", " is", " is blue.")),  # one ends inside the other
])
def test_implicit_prompt_cut(chosen, rejected, expected):
    assert implicit_prompt(chosen, rejected, "row 0") == expected


@pytest.mark.parametrize("which", ["gpt2_tok", "llama_tok"])
def test_implicit_plain_prompt_encodes_as_the_explicit_row(which, request):
    tok = request.getfixturevalue(which)
    implicit = {"chosen": "the movie was good.", "rejected": "the movie was dull."}
    explicit = {"prompt": "the movie was", "chosen": " good.", "rejected": " dull."}
    assert encode_preferences(tok, [implicit], 64)[0] == encode_preferences(tok, [explicit], 64)[0]
    with pytest.raises(TetherError, match="row 0 has no 'prompt', and its chosen and rejected"):
        encode_preferences(tok, [{"chosen": "good.", "rejected": "dull."}], 64)


# ----------------------------------------------------------------------------- prompts

def test_prompts_ending_in_any_turn(llama_tok, tiny_mistral_dir):
    tok = llama_tok
    tool = {"role": "tool", "content": "42"}
    # after an assistant turn or a tool turn, the generation prompt opens a new assistant turn
    assert format_prompt(tok, {"messages": [USER, REPLY]}) == \
        "<s><|user|>\nthe movie</s>\n<|assistant|>\nwas good.</s>\n<|assistant|>\n"
    assert format_prompt(tok, {"messages": [USER, REPLY, tool]}).endswith(
        "was good.</s>\n<|tool|>\n42</s>\n<|assistant|>\n")
    # a multi-turn PPO prompt is exactly the prompt SFT trained the last turn on
    chat = [USER, REPLY, {"role": "user", "content": "and the plot"}]
    sft = encode_sft(tok, [{"messages": chat + [REPLY]}], 256, loss_on="last")[0][0]
    assert encode_prompt_row(tok, {"messages": chat}, 256, special_prefix(tok))[1] == sft.prompt
    # Mistral's [INST] template has no generation prompt: after an assistant turn no turn opens
    mistral = load_tokenizer(str(tiny_mistral_dir))
    assert format_prompt(mistral, {"messages": [USER]}) == "[INST] the movie [/INST]"
    with pytest.raises(TetherError, match="row 3 ends with an assistant message and the chat "
                                          "template writes no generation prompt"):
        format_prompt(mistral, {"messages": [USER, REPLY]}, "p.jsonl: row 3")


# ----------------------------------------------------------------------------- bad shapes

IMAGE = {"role": "user", "content": [{"type": "text", "text": "what is"},
                                     {"type": "image_url", "image_url": {"url": "x.png"}}]}


@pytest.mark.parametrize("rows, pattern", [
    ([{"messages": [IMAGE, REPLY]}],
     r"d.jsonl: row 0 'messages' message 0 content part 1 has type 'image_url'.*text only"),
    ([{"messages": [{"role": "user", "content": 3}, REPLY]}],
     r"row 0 'messages' message 0 content must be a string or a list of text parts \(got int\)"),
    ([{"messages": [{"role": "user", "content": ["the movie"]}, REPLY]}],
     r"message 0 content part 0 is a str, not a \{'type': 'text'"),
    ([{"prompt": [IMAGE], "completion": "fine"}], r"row 0 'prompt' message 0 content part 1"),
    ([{"prompt": "the movie"}], r"row 0 has no column 'response' \(or 'completion'\)"),
    ([{"prompt": "a", "response": "b"}, {"prompt": "c", "completion": "d"}],
     r"row 1 is a \{prompt, completion\} row but row 0 is a \{prompt, response\} row"),
    ([{"messages": [USER, REPLY]}, {"text": "the movie"}],
     r"row 1 is a \{text\} row but row 0 is a \{messages\} row"),
    ([{"chosen": "the movie"}], r"row 0 is not an SFT row \(columns found: chosen\)"),
    ([{"prompt": "the movie", "response": 3}], r"row 0 'response' must be a string \(got int\)"),
    ([{"prompt": "the movie", "completion": [REPLY]}], r"mixes a plain-text prompt with a chat"),
    ([{"messages": "hello"}], r"row 0 'messages' must be a list of \{role, content\} messages"),
])
def test_bad_sft_rows_are_one_line_errors(rows, pattern, llama_tok):
    with pytest.raises(TetherError, match=pattern) as info:
        encode_sft(llama_tok, rows, max_length=64, source="d.jsonl")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rows, pattern", [
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"chosen": "a b", "rejected": "a c"}],
     r"row 1 is a \{chosen, rejected\} row but row 0 is a \{prompt, chosen, rejected\} row"),
    ([{"prompt": [USER], "chosen": [dict(REPLY, content=[{"type": "image", "image": "x"}])],
       "rejected": "b"}], r"row 0 'chosen' message 0 content part 0 has type 'image'"),
    ([{"prompt": "a", "chosen": 1.5, "rejected": "b"}], r"row 0 'chosen' must be a string"),
])
def test_bad_preference_rows_are_one_line_errors(rows, pattern, llama_tok):
    with pytest.raises(TetherError, match=pattern) as info:
        encode_preferences(llama_tok, rows, max_length=64, source="d.jsonl")
    assert "\n" not in str(info.value)


def test_bad_prompt_rows_are_one_line_errors(llama_tok, tmp_path):
    cases = [({"messages": [IMAGE]}, r"row 0 'messages' message 0 content part 1 has type"),
             ({"prompt": [{"type": "text", "text": "hi"}]}, r"row 0 'prompt' must be a string or a list"),
             ({"prompt": 7}, r"row 0 'prompt' must be a string or chat messages \(got int\)"),
             ({"prompt": None, "completion": "x"}, r"row 0 has neither a 'prompt' nor a 'messages'")]
    for row, pattern in cases:
        path = tmp_path / "p.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(TetherError, match=pattern) as info:
            load_prompts(str(path), llama_tok, 64)
        assert "\n" not in str(info.value) and re.search("p.jsonl", str(info.value))


def test_a_template_that_refuses_the_messages_is_one_line_error(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TetherError, match="row 0: the chat template refuses these messages "
                                          r"\(Conversation roles must alternate") as info:
        encode_sft(tok, [{"messages": [REPLY, USER, REPLY]}], max_length=64, source="d.jsonl")
    assert "\n" not in str(info.value)
