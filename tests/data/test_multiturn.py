"""Multi-turn SFT: loss on every assistant turn (content + end-of-turn token), none on the turns
between; `--loss-on last` is the old rule, byte for byte; the SFT loss equals a hand sum of
per-token NLLs from a plain forward; truncation at the end; templates that rewrite earlier turns."""

import json

import pytest
import torch
from offline_fixtures import mask_runs

from tether.cli import main
from tether.data.batches import collate_sft
from tether.data.encoding import encode_sft
from tether.errors import TetherError
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.train.sft import sft_loss

SYSTEM = {"role": "system", "content": "be brief"}
U1, A1 = {"role": "user", "content": "the movie"}, {"role": "assistant", "content": "was good."}
U2, A2 = {"role": "user", "content": "and the plot"}, {"role": "assistant", "content": "was dull."}
U3, A3 = {"role": "user", "content": "the music"}, {"role": "assistant", "content": "fine."}
TWO = [U1, A1, U2, A2]
THREE = [SYSTEM, U1, A1, U2, A2, U3, A3]

# The tiny templates' texts, written out by hand: (the prompt before the first reply, what lies
# between two replies, the end-of-turn token). Llama-style: BOS + `<|role|>\n ... </s>\n`;
# ChatML (Qwen2): `<|im_start|>role\n ... <|im_end|>\n`, no BOS.
LLAMA = {"open": "<s><|user|>\nthe movie</s>\n<|assistant|>\n",
         "open_system": "<s><|system|>\nbe brief</s>\n<|user|>\nthe movie</s>\n<|assistant|>\n",
         "between": ["\n<|user|>\nand the plot</s>\n<|assistant|>\n",
                     "\n<|user|>\nthe music</s>\n<|assistant|>\n"],
         "end": "</s>"}
CHATML = {"open": "<|im_start|>user\nthe movie<|im_end|>\n<|im_start|>assistant\n",
          "open_system": "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe movie"
                         "<|im_end|>\n<|im_start|>assistant\n",
          "between": ["\n<|im_start|>user\nand the plot<|im_end|>\n<|im_start|>assistant\n",
                      "\n<|im_start|>user\nthe music<|im_end|>\n<|im_start|>assistant\n"],
          "end": "<|im_end|>"}
FAMILIES = {"tiny_llama_dir": LLAMA, "tiny_qwen2_dir": CHATML}


def _sequence(tok, messages, loss_on="all", max_length=256):
    ex = encode_sft(tok, [{"messages": messages}], max_length=max_length, loss_on=loss_on)[0][0]
    batch = collate_sft([ex], tok.pad_token_id)
    n = int(batch["attention_mask"][0].sum())
    return batch["input_ids"][0, :n].tolist(), batch["response_mask"][0, :n].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("conversation", ["two", "three"])
def test_masked_ids_are_the_assistant_turns_and_their_end_of_turn_tokens(family, conversation,
                                                                        request):
    tok = load_tokenizer(str(request.getfixturevalue(family)))
    text = FAMILIES[family]
    messages = TWO if conversation == "two" else THREE
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    ids, mask = _sequence(tok, messages)
    segments = mask_runs(ids, mask)
    # [prompt | reply 1 | between | reply 2 (| between | reply 3)]: 0/1 alternating, hand texts
    assert [bit for bit, _ in segments] == [0, 1] + [0, 1] * (len(replies) - 1)
    expected = [text["open"] if conversation == "two" else text["open_system"]]
    for k, reply in enumerate(replies):
        expected += ([text["between"][k - 1]] if k else []) + [reply + text["end"]]
    assert [tok.decode(s) for _, s in segments] == expected
    # each reply's ids are those of its text alone (byte-level BPE: a turn after "\n" tokenises
    # as it would on its own), so the mask lands on whole turns, end-of-turn token included
    trained = [s for bit, s in segments if bit]
    assert trained == [tok(r + text["end"], add_special_tokens=False)["input_ids"] for r in replies]
    # the sequence is the whole rendered chat tokenised once (BOS once), less the trailing "\n"
    full = tok.apply_chat_template(messages, tokenize=False).removesuffix("\n")
    assert ids == tok(full, add_special_tokens=not full.startswith(tok.bos_token or "\0"))["input_ids"]


def test_every_turn_is_tokenised_in_context_on_a_metaspace_tokenizer(tiny_mistral_dir):
    # Mistral-style: the tokenizer adds BOS, `[INST] ... [/INST]` is plain text, and a reply
    # tokenised alone gets a leading "▁" it does not have after "]" in the whole chat
    tok = load_tokenizer(str(tiny_mistral_dir))
    messages = [U1, A1, U2, A2, U3, A3]
    ids, mask = _sequence(tok, messages)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full.endswith("</s>") and ids == tok(full)["input_ids"]  # BOS once, one tokenisation
    assert ids.count(tok.bos_token_id) == 1
    trained = [s for bit, s in mask_runs(ids, mask) if bit]
    replies = [A1["content"], A2["content"], A3["content"]]
    assert [tok.decode(s) for s in trained] == [r + "</s>" for r in replies]
    alone = [tok(r + "</s>", add_special_tokens=False)["input_ids"] for r in replies]
    assert all(a != t for a, t in zip(alone, trained, strict=True))  # so the check above can fail


# ----------------------------------------------------------------------------- the old rule
# tether's SFT chat encoding before multi-turn loss (git 82a45f5, tether.data.chat.split_chat and
# tether.data.encoding.encode_pair), frozen here as the reference `--loss-on last` must reproduce.

def _old_special_prefix(tok):
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def _old_encode_prompt(tok, text, prefix):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids if ids[:len(prefix)] == prefix else prefix + ids


def _old_end_at_turn_token(tok, response):
    stripped = response.rstrip()
    specials = set(tok.all_special_tokens)
    specials |= {t.content for t in getattr(tok, "added_tokens_decoder", {}).values()}
    if stripped != response and any(stripped.endswith(s) for s in specials if s):
        return stripped
    return response


def old_sft_encoding(tok, messages):
    """(prompt ids, response ids) of a `{messages}` row under the old last-turn rule."""
    prompt_text = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert full_text.startswith(prompt_text)
    response_text = _old_end_at_turn_token(tok, full_text[len(prompt_text):])
    prefix = _old_special_prefix(tok)
    prompt = _old_encode_prompt(tok, prompt_text, prefix)
    full = _old_encode_prompt(tok, prompt_text + response_text, prefix)
    shared = 0
    while shared < min(len(prompt), len(full)) and full[shared] == prompt[shared]:
        shared += 1
    if shared == 0:
        full = prompt + tok(response_text, add_special_tokens=False)["input_ids"]
        shared = len(prompt)
    return prompt[:shared], full[shared:]


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir"])
def test_loss_on_last_is_the_old_encoding(family, request):
    tok = load_tokenizer(str(request.getfixturevalue(family)))
    chats = [[U1, A1], TWO, [U1, A1, U2, A2, U3, A3]]
    if family != "tiny_mistral_dir":  # the [INST] template has no system role
        chats.append(THREE)
    examples, _ = encode_sft(tok, [{"messages": m} for m in chats], max_length=256, loss_on="last")
    batch = collate_sft(examples, tok.pad_token_id)
    for row, (ex, messages) in enumerate(zip(examples, chats, strict=True)):
        prompt, response = old_sft_encoding(tok, messages)
        assert (ex.prompt, ex.responses, ex.loss_mask) == (prompt, [response], None)
        # the batch mask is the old contiguous one: 1 exactly on the response
        expected = [0] * len(prompt) + [1] * len(response)
        assert batch["response_mask"][row, :len(expected)].tolist() == expected
        assert batch["response_mask"][row, len(expected):].sum() == 0
    # the rules differ in the mask only: the ids (all a reward model's normalisation data and
    # score_texts read through encode_sft) are the same sequence
    every, _ = encode_sft(tok, [{"messages": m} for m in chats], max_length=256)
    assert [e.prompt + e.responses[0] for e in every] == [e.prompt + e.responses[0] for e in examples]
    # one assistant turn: "all" and "last" are the same encoding
    one = encode_sft(tok, [{"messages": [U1, A1]}], max_length=256)[0][0]
    assert (one.prompt, one.responses, one.loss_mask) == (examples[0].prompt, examples[0].responses, None)


# ----------------------------------------------------------------------------- the loss

def _hand_positions(tok, messages):
    """Llama-style ids built piece by piece from the template's text (`<|role|>\n content </s>\n`
    per message, after BOS), and the positions of each assistant turn (content + </s>) in them,
    counted from the pieces' lengths."""
    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, positions = [tok.bos_token_id], []
    for k, m in enumerate(messages):
        ids += encode(f"<|{m['role']}|>\n")
        turn = encode(m["content"] + "</s>")
        if m["role"] == "assistant":
            positions.append(list(range(len(ids), len(ids) + len(turn))))
        ids += turn + (encode("\n") if k < len(messages) - 1 else [])  # no "\n" after the last
    # the pieces tokenise as the whole text does (no token merges across them)
    full = tok.apply_chat_template(messages, tokenize=False).removesuffix("\n")
    assert ids == tok(full, add_special_tokens=False)["input_ids"]
    return ids, positions


def _hand_nll(model, tok, conversations, loss_on):
    total, count = 0.0, 0
    for messages in conversations:
        ids, positions = _hand_positions(tok, messages)
        trained = [p for turn in (positions if loss_on == "all" else positions[-1:]) for p in turn]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        # the logits at position p - 1 predict token p
        total -= sum(logp[p - 1, ids[p]].item() for p in trained)
        count += len(trained)
    return total / count, count


@pytest.mark.parametrize("loss_on", ["all", "last"])
def test_sft_loss_on_a_multiturn_batch_is_the_hand_sum_of_nlls(tiny_llama_dir, loss_on):
    tok = load_tokenizer(str(tiny_llama_dir))
    model = load_causal_lm(str(tiny_llama_dir), tok).eval()
    conversations = [TWO, THREE]
    expected, count = _hand_nll(model, tok, conversations, loss_on)
    examples, _ = encode_sft(tok, [{"messages": m} for m in conversations], 256, loss_on=loss_on)
    batch = collate_sft(examples, tok.pad_token_id)
    for chunked in (True, False):
        with torch.no_grad():
            loss, n_tokens = sft_loss(model, batch, chunked=chunked)
        assert int(n_tokens) == count
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    # so the check can fail: the two rules train on different token counts
    other = _hand_nll(model, tok, conversations, "last" if loss_on == "all" else "all")[1]
    assert other != count


def test_sft_cli_loss_on_all_or_last(tiny_llama_dir, tmp_path):
    """`--loss-on`: the first step's loss (lr ~0, so the untrained model's) and token count are
    the hand NLL over every assistant turn, or over the last only."""
    tok = load_tokenizer(str(tiny_llama_dir))
    model = load_causal_lm(str(tiny_llama_dir), tok).eval()
    conversations = [TWO, THREE]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    for loss_on in ("all", "last"):
        argv = ["sft", "--model", str(tiny_llama_dir), "--data", str(data), "--run-name", loss_on,
                "--output-dir", str(tmp_path / "runs"), "--max-steps", "1", "--batch-size", "2",
                "--lr", "1e-12", "--device", "cpu"]
        assert main(argv + (["--loss-on", "last"] if loss_on == "last" else [])) == 0
        lines = (tmp_path / "runs" / loss_on / "metrics.jsonl").read_text().splitlines()
        metrics = json.loads(lines[-1])
        expected, count = _hand_nll(model, tok, conversations, loss_on)
        assert metrics["train/tokens"] == count
        assert metrics["train/loss"] == pytest.approx(expected, rel=1e-4)


# ----------------------------------------------------------------------------- length and templates

def test_a_long_conversation_is_cut_at_the_end_and_counted(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    whole_ids, whole_mask = _sequence(tok, THREE)
    first_reply_end = whole_mask.index(0, whole_mask.index(1))  # just after "was good.</s>"
    cut = first_reply_end + 3  # inside the second user turn
    examples, stats = encode_sft(tok, [{"messages": THREE}], max_length=cut)
    ex = examples[0]
    assert stats.truncated == 1
    assert ex.prompt + ex.responses[0] == whole_ids[:cut]
    assert [0] * len(ex.prompt) + ex.loss_mask == whole_mask[:cut]
    assert sum(ex.loss_mask) == first_reply_end - len(ex.prompt)  # only the first reply trains


# Rewrites earlier assistant turns (as templates that drop past reasoning do): rendering the first
# turns is not a prefix of rendering the whole chat.
REWRITING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "<|assistant|>\n[earlier]{{ eos_token }}\n{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_one_line_error(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    tok.chat_template = REWRITING_TEMPLATE
    with pytest.raises(TetherError, match="row 0: the chat template renders message 1 differently "
                                          ".*pass --loss-on last") as info:
        encode_sft(tok, [{"messages": TWO}], max_length=256, source="chat.jsonl")
    assert "\n" not in str(info.value)
    # the last turn alone is still found: the rewritten earlier turn is only context
    ex = encode_sft(tok, [{"messages": TWO}], max_length=256, loss_on="last")[0][0]
    assert tok.decode(ex.responses[0]) == "was dull.</s>"
    assert "[earlier]" in tok.decode(ex.prompt)


def test_a_chat_that_does_not_end_with_the_assistant_is_one_line_error(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    with pytest.raises(TetherError, match="row 0: the chat must end with an assistant message"):
        encode_sft(tok, [{"messages": [U1, A1, U2]}], max_length=256)
    with pytest.raises(TetherError, match="loss_on must be 'all' or 'last'"):
        encode_sft(tok, [{"messages": TWO}], max_length=256, loss_on="first")
