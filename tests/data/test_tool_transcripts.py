"""Tool-calling transcripts in TRL's form (assistant `tool_calls` with null content, `tool`
results, a `tools` column of JSON schemas) read unchanged by SFT, DPO and the reward model.

Truth is written out here, not derived from tether: the trained tokens decode to the hand-written
text of the two assistant turns (the `<tool_call>` block and the answer, each with its
`<|im_end|>`), and the whole sequence is the template's own rendering (`apply_chat_template`,
tools passed) tokenised once. The tiny Qwen2.5-style model's template writes the schemas in the
system turn, calls as `<tool_call>` JSON blocks and results as `<tool_response>` blocks in a user
turn; the Llama-style one writes neither calls nor schemas, so it must refuse such rows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from offline_fixtures import mask_runs, write_jsonl
from refusals import refused
from transformers import AutoModelForCausalLM
from transformers.utils import get_json_schema

from tether.data.batches import collate_sft
from tether.data.chat import chat_messages
from tether.data.encoding import encode_preferences, encode_sft
from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.tiny import CHATML_TOOLS_TEMPLATE
from tether.train.dpo import DPOConfig
from tether.train.dpo import run as run_dpo
from tether.train.sft import SFTConfig, sft_loss
from tether.train.sft import run as run_sft


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """


TOOLS = [get_json_schema(get_weather)]  # {"type": "function", "function": {...}}, as TRL's rows


def call(city: str, arguments=None) -> dict:
    arguments = {"city": city} if arguments is None else arguments
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


U = {"role": "user", "content": "the movie"}
CALL = {"role": "assistant", "content": None, "tool_calls": [call("Paris")]}
RESULT = {"role": "tool", "name": "get_weather", "tool_call_id": "call_0", "content": "sunny"}
ANSWER = {"role": "assistant", "content": "was good."}
TRANSCRIPT = [U, CALL, RESULT, ANSWER]

# The two assistant turns as the tiny template writes them, by hand
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             '<|im_end|>')
ANSWER_TEXT = "was good.<|im_end|>"


@pytest.fixture(scope="module")
def tok(tiny_qwen2_tools_dir):
    return load_tokenizer(str(tiny_qwen2_tools_dir))


def _sequence(tok, row: dict, loss_on: str = "all") -> tuple[list[int], list[int]]:
    ex = encode_sft(tok, [row], max_length=1024, loss_on=loss_on)[0][0]
    batch = collate_sft([ex], tok.pad_token_id)
    n = int(batch["attention_mask"][0].sum())
    return batch["input_ids"][0, :n].tolist(), batch["response_mask"][0, :n].tolist()


def _encoded(tok, row: dict) -> tuple:
    ex = encode_sft(tok, [row], max_length=1024)[0][0]
    return ex.prompt, ex.responses, ex.loss_mask


# ----------------------------------------------------------------------------- what carries loss

def test_loss_is_on_the_call_turn_and_the_answer_only(tok):
    ids, mask = _sequence(tok, {"messages": TRANSCRIPT, "tools": TOOLS})
    segments = mask_runs(ids, mask)
    # [system + tools, user | call | tool result | answer]
    assert [bit for bit, _ in segments] == [0, 1, 0, 1]
    assert [tok.decode(s) for bit, s in segments if bit] == [CALL_TEXT, ANSWER_TEXT]
    # `<tool_call>` is one token of the vocabulary, and it is trained on
    assert tok.convert_tokens_to_ids("<tool_call>") in segments[1][1]
    context = tok.decode(segments[0][1]) + tok.decode(segments[2][1])
    assert json.dumps(TOOLS[0]) in context  # the schema, in the system turn: no loss
    assert tok.decode(segments[2][1]) == ("\n<|im_start|>user\n<tool_response>\nsunny\n"
                                          "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the sequence is the template's own rendering with the tools, tokenised once, less the
    # newline after the last `<|im_end|>` (never generated)
    full = tok.apply_chat_template(TRANSCRIPT, tools=TOOLS, tokenize=False).removesuffix("\n")
    assert ids == tok(full, add_special_tokens=False)["input_ids"]


def test_loss_on_last_trains_the_answer_with_the_call_as_context(tok):
    ids, mask = _sequence(tok, {"messages": TRANSCRIPT, "tools": TOOLS}, loss_on="last")
    segments = mask_runs(ids, mask)
    assert [bit for bit, _ in segments] == [0, 1]
    assert tok.decode(segments[1][1]) == ANSWER_TEXT
    assert CALL_TEXT in tok.decode(segments[0][1])


def test_a_transcript_ending_in_a_call_trains_the_call(tok):
    # TRL's prompt-completion form: the completion is the pure call, the prompt the context
    ids, mask = _sequence(tok, {"prompt": [U], "completion": [CALL], "tools": TOOLS})
    assert [tok.decode(s) for bit, s in mask_runs(ids, mask) if bit] == [CALL_TEXT]


def test_a_completion_with_a_tool_result_trains_only_the_assistant_turns(tok):
    ids, mask = _sequence(tok, {"prompt": [U], "completion": [CALL, RESULT, ANSWER],
                                "tools": TOOLS})
    assert [tok.decode(s) for bit, s in mask_runs(ids, mask) if bit] == [CALL_TEXT, ANSWER_TEXT]


# ----------------------------------------------------------------------------- other spellings

def test_arguments_as_json_text_give_the_same_ids_as_an_object(tok):
    as_text = dict(CALL, tool_calls=[call("Paris", json.dumps({"city": "Paris"}))])
    row = {"messages": TRANSCRIPT, "tools": TOOLS}
    assert _encoded(tok, {**row, "messages": [U, as_text, RESULT, ANSWER]}) == _encoded(tok, row)


def test_a_template_that_writes_strings_as_they_are_gets_the_text_unchanged(tok):
    # The tiny template writes string arguments verbatim: compact JSON stays compact, it is not
    # re-serialised (the data is what the model learns)
    compact = dict(CALL, tool_calls=[call("Paris", '{"city":"Paris"}')])
    ids, mask = _sequence(tok, {"messages": [U, compact], "tools": TOOLS})
    assert [tok.decode(s) for bit, s in mask_runs(ids, mask) if bit] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
        '<|im_end|>']


def test_a_template_that_quotes_strings_gets_objects(tok):
    # Qwen2.5's and Llama 3.1's templates apply `tojson` to the arguments, so JSON text would
    # be written as a quoted string ("{\"city\": ...}"); tether hands them an object instead
    quoting = CHATML_TOOLS_TEMPLATE.replace(
        "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}",
        "{{ f['arguments'] | tojson }}")
    assert quoting != CHATML_TOOLS_TEMPLATE
    tok = load_tokenizer(tok.name_or_path)
    tok.chat_template = quoting
    as_text = [U, dict(CALL, tool_calls=[call("Paris", json.dumps({"city": "Paris"}))])]
    quoted = tok.apply_chat_template(as_text, tools=TOOLS, tokenize=False)
    assert r'"arguments": "{\"city\": \"Paris\"}"' in quoted  # what it would train unchanged
    ids, mask = _sequence(tok, {"messages": as_text, "tools": TOOLS})
    assert [tok.decode(s) for bit, s in mask_runs(ids, mask) if bit] == [CALL_TEXT]


def test_tools_as_json_text_give_the_same_ids_as_a_list(tok):
    row = {"messages": TRANSCRIPT, "tools": TOOLS}
    assert _encoded(tok, {**row, "tools": json.dumps(TOOLS)}) == _encoded(tok, row)


def test_a_parquet_file_with_null_filled_keys_reads_as_the_json(tok, tmp_path):
    # Arrow gives every message every key some message has: `tool_calls`, `name` and
    # `tool_call_id` are null on the user and answer turns, `content` null on the call
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": TRANSCRIPT, "tools": json.dumps(TOOLS)}] * 2
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    read = load_rows(str(tmp_path / "t.parquet"))
    assert read[0]["messages"][0]["tool_calls"] is None  # so the test means something
    assert _encoded(tok, read[0]) == _encoded(tok, rows[0])
    # the nulls go, as if the JSON had left the keys out: a template testing
    # `'tool_calls' in message` (Llama 3.1's) must not take the user turn for a call
    assert chat_messages(read[0]["messages"], "messages", "row 0") == TRANSCRIPT


def test_tool_messages_keep_their_name_and_call_id():
    messages = chat_messages(TRANSCRIPT, "messages", "row 0")
    assert messages[2] == RESULT and messages[1] == CALL


# ----------------------------------------------------------------------------- bad rows

BAD = [
    ("tool_calls not a list", {"messages": [U, dict(CALL, tool_calls=call("Paris"))]},
     r"^data: row 0 'messages' message 1 'tool_calls' must be a list of calls \(got a dict\); "
     r"write each call as \{\"type\": \"function\""),
    ("call not an object", {"messages": [U, dict(CALL, tool_calls=["get_weather"])]},
     r"'messages' message 1 tool call 0 is a str, not an object; write each call as"),
    ("call without a name", {"messages": [U, dict(CALL, tool_calls=[
        {"type": "function", "function": {"arguments": {}}}])]},
     r"'messages' message 1 tool call 0 has no function name; write each call as"),
    ("arguments a number", {"messages": [U, dict(CALL, tool_calls=[call("x", 3)])]},
     r"message 1 tool call 0 \(get_weather\) has arguments that are neither an object nor the "
     r"JSON text of one \(got int\); give them as"),
    ("arguments not JSON", {"messages": [U, dict(CALL, tool_calls=[call("x", "city=Paris")])]},
     r"tool call 0 \(get_weather\) has arguments .*\(got text that is not a JSON object\)"),
    ("arguments a JSON list", {"messages": [U, dict(CALL, tool_calls=[call("x", "[1]")])]},
     r"tool call 0 \(get_weather\) has arguments .*\(got text that is not a JSON object\)"),
    ("assistant with neither", {"messages": [U, {"role": "assistant", "content": None}, RESULT,
                                             ANSWER]},
     r"'messages' message 1 content must be a string or a list of text parts \(got null\); "
     r"give the message its text or its tool_calls, or drop it"),
    ("calls on a user turn", {"messages": [dict(U, tool_calls=[call("Paris")]), ANSWER]},
     r"'messages' message 0 has 'tool_calls' but role 'user'; only an assistant message makes "
     r"tool calls"),
    ("tools a dict", {"messages": TRANSCRIPT, "tools": TOOLS[0]},
     r"^data: row 0 'tools' must be a list of function schemas \(got a dict\); give \[\{"),
    ("tools strings", {"messages": TRANSCRIPT, "tools": ["get_weather"]},
     r"row 0 'tools' item 0 is a str, not a function schema object; give each tool as"),
    ("tools text not JSON", {"messages": TRANSCRIPT, "tools": "get_weather(city)"},
     r"row 0 'tools' is text but not JSON \(Expecting value at character 0\); give a list"),
    ("tools on plain rows", {"prompt": "the movie", "response": " was good.", "tools": TOOLS},
     r"row 0 has a 'tools' column but plain-text rows, which cannot show the model its tools; "
     r"give the rows as chat messages"),
]


@pytest.mark.parametrize("k", range(len(BAD)), ids=[b[0] for b in BAD])
def test_bad_tool_rows_are_one_line_naming_row_and_field(k, tok):
    _, row, pattern = BAD[k]
    with pytest.raises(TetherError, match=pattern) as info:
        encode_sft(tok, [row], max_length=1024)
    assert "\n" not in str(info.value)


def test_bad_calls_in_preference_rows_are_one_line(tok):
    row = {"prompt": [U], "chosen": [dict(CALL, tool_calls=[{"function": {"arguments": {}}}])],
           "rejected": [ANSWER], "tools": TOOLS}
    with pytest.raises(TetherError, match=r"row 0 'chosen' message 0 tool call 0 has no function "
                                          r"name; write each call as"):
        encode_preferences(tok, [row], max_length=1024)


# ----------------------------------------------------------------------------- templates

# A template that writes a call's arguments only in the last turn (history compressed): the
# call turn renders one way alone and another inside the whole chat.
REWRITING = (
    "{% for m in messages %}{% set final = loop.last %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{{ c['function']['name'] }}{% if final %} {{ c['function']['arguments'] | tojson }}"
    "{% endif %}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_a_call_turn_is_refused_not_mis_masked(tok):
    tok = load_tokenizer(tok.name_or_path)
    tok.chat_template = REWRITING
    with pytest.raises(TetherError, match=r"row 0: the chat template renders message 1 differently "
                                          r"inside the full chat.*pass --loss-on last"):
        encode_sft(tok, [{"messages": TRANSCRIPT}], max_length=1024)
    # the final turn alone is located as the template renders the whole chat
    ids, mask = _sequence(tok, {"messages": TRANSCRIPT}, loss_on="last")
    assert [tok.decode(s) for bit, s in mask_runs(ids, mask) if bit] == [ANSWER_TEXT]
    assert "<tool_call>get_weather</tool_call>" in tok.decode(ids)


def test_a_template_without_tool_calls_refuses_them(tiny_llama_dir):
    # The Llama-style template writes each message's content only: the call would vanish and the
    # model would learn to answer from a tool result it never asked for
    tok = load_tokenizer(str(tiny_llama_dir))
    assert "get_weather" not in tok.apply_chat_template(TRANSCRIPT, tokenize=False)
    with pytest.raises(TetherError, match=r"row 0 message 1 calls 'get_weather' but the chat "
                                          r"template does not write that call .*use a model whose "
                                          r"template renders 'tool_calls'"):
        encode_sft(tok, [{"messages": TRANSCRIPT}], max_length=1024)
    with pytest.raises(TetherError, match=r"row 0 has 'tools' but the chat template does not write "
                                          r"tool schemas .*drop the 'tools' column"):
        encode_sft(tok, [{"messages": [U, ANSWER], "tools": TOOLS}], max_length=1024)
    # a transcript whose calls it never sees: tool results are just another role to it
    _sequence(tok, {"messages": [U, ANSWER, RESULT, ANSWER]})


# ----------------------------------------------------------------------------- DPO, RM rows

def test_preference_rows_differing_in_their_call_share_the_prompt_with_the_schemas(tok):
    london = dict(CALL, tool_calls=[call("London")])
    explicit = {"prompt": [U], "chosen": [CALL], "rejected": [london], "tools": TOOLS}
    implicit = {"chosen": [U, CALL], "rejected": [U, london], "tools": json.dumps(TOOLS)}
    (a,), _ = encode_preferences(tok, [explicit], max_length=1024)
    (b,), _ = encode_preferences(tok, [implicit], max_length=1024)
    prompt_text = tok.apply_chat_template([U], tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True)
    assert json.dumps(TOOLS[0]) in prompt_text
    assert a.prompt == b.prompt == tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert a.responses == b.responses
    assert [tok.decode(r) for r in a.responses] == [CALL_TEXT, CALL_TEXT.replace("Paris", "London")]


def test_preference_rows_after_a_tool_result(tok):
    # chosen and rejected continue a transcript: the prompt ends in the tool result
    rows = [{"chosen": TRANSCRIPT, "rejected": TRANSCRIPT[:3] + [{"role": "assistant",
                                                                 "content": "was bad."}],
             "tools": TOOLS}]
    (ex,), _ = encode_preferences(tok, rows, max_length=1024)
    prompt_text = tok.apply_chat_template(TRANSCRIPT[:3], tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True)
    assert ex.prompt == tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert [tok.decode(r) for r in ex.responses] == [ANSWER_TEXT, "was bad.<|im_end|>"]


# ----------------------------------------------------------------------------- end to end

def _transcripts(n: int) -> list[dict]:
    """Learnable transcripts: call get_weather on the user's first word, answer with the result."""
    words = ["movie", "plot", "music", "film", "story", "scene", "actor", "ending"]
    rows = []
    for k in range(n):
        city, weather = words[k % len(words)], ["sunny", "rainy"][k % 2]
        arguments = {"city": city} if k % 2 else json.dumps({"city": city})  # both spellings
        rows.append({"messages": [
            {"role": "user", "content": f"{city} was fun"},
            {"role": "assistant", "content": None, "tool_calls": [call(city, arguments)]},
            {"role": "tool", "name": "get_weather", "content": weather},
            {"role": "assistant", "content": f"it was {weather}."}],
            "tools": TOOLS if k % 2 else json.dumps(TOOLS)})
    return rows


def _response_nll(model, tok, rows) -> float:
    model.eval()
    examples, _ = encode_sft(tok, rows, max_length=1024)
    with torch.no_grad():
        loss, _ = sft_loss(model, collate_sft(examples, tok.pad_token_id))
    return loss.item()


def test_sft_on_tool_transcripts_lowers_the_loss(tiny_qwen2_tools_dir, tmp_path):
    rows = _transcripts(16)
    cfg = SFTConfig(run_name="tools", output_dir=str(tmp_path / "runs"),
                    model=str(tiny_qwen2_tools_dir),
                    data=str(write_jsonl(tmp_path / "t.jsonl", rows)),
                    max_steps=12, batch_size=8, lr=3e-3, lr_schedule="constant", max_length=1024,
                    device="cpu")
    result = run_sft(cfg)
    assert result.metrics["data/rows"] == 16 and result.metrics["data/truncated"] == 0
    tok = load_tokenizer(str(tiny_qwen2_tools_dir))
    # untrained: ~uniform over ~300 tokens (ln 302 ~ 5.7); the calls and answers are learnable
    before = _response_nll(load_causal_lm(str(tiny_qwen2_tools_dir), tok), tok, rows)
    after = _response_nll(AutoModelForCausalLM.from_pretrained(result.output_path), tok, rows)
    assert after < before - 1.5, (before, after)


def test_dpo_reads_tool_rows_and_starts_at_ln2(tiny_qwen2_tools_dir, tmp_path):
    rows = [{"prompt": r["messages"][:1], "chosen": [r["messages"][1]],
             "rejected": [dict(r["messages"][1], tool_calls=[call("nowhere")])],
             "tools": r["tools"]}
            for r in _transcripts(4)]
    cfg = DPOConfig(run_name="d", output_dir=str(tmp_path), model=str(tiny_qwen2_tools_dir),
                    data=str(write_jsonl(tmp_path / "p.jsonl", rows)), max_steps=1, batch_size=4,
                    max_length=1024, device="cpu")
    # policy == reference before the first update: -log sigmoid(0)
    assert run_dpo(cfg).metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_sft_cli_refuses_tool_transcripts_on_a_template_without_calls(tiny_llama_dir, tmp_path,
                                                                      capsys):
    data = write_jsonl(tmp_path / "t.jsonl", _transcripts(2))
    argv = ["sft", "--model", str(tiny_llama_dir), "--data", str(data), "--run-name", "bad",
            "--output-dir", str(tmp_path / "runs"), "--max-steps", "1", "--batch-size", "2",
            "--device", "cpu"]
    refused(tmp_path, argv, r"t\.jsonl: row 0 message 1 calls 'get_weather' but the chat template "
                            r"does not write that call", capsys)

