import json

import datasets
import pytest

from tether.data.batches import batch_order, collate_pairs, collate_sft
from tether.data.encoding import encode_preferences, encode_sft
from tether.data.prompts import format_prompt
from tether.data.rows import load_rows, require_columns
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer

ROWS = [{"prompt": "the movie", "response": "was good."}, {"prompt": "it", "response": "was bad."}]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_every_format_reads_the_same_rows(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,response\nthe movie,was good.\nit,was bad.\n", encoding="utf-8")
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in ("d.jsonl", "d.csv", "d.parquet", "saved", "saved_dict"):
        assert load_rows(str(tmp_path / source)) == ROWS, source


def test_bad_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(TetherError, match="has no rows"):
        load_rows(str(empty))
    latin = tmp_path / "l.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(TetherError, match="not valid UTF-8"):
        load_rows(str(latin))
    with pytest.raises(TetherError, match="not found"):
        load_rows(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "b.txt"
    bad.write_text("x")
    with pytest.raises(TetherError, match="unknown data format"):
        load_rows(str(bad))
    broken = tmp_path / "j.jsonl"
    broken.write_text('{"prompt": 1}\n{oops\n')
    with pytest.raises(TetherError, match="line 2 is not valid JSON"):
        load_rows(str(broken))


def test_require_columns_names_the_column():
    with pytest.raises(TetherError, match="row 1 has no column 'response'"):
        require_columns([{"prompt": "a", "response": "b"}, {"prompt": "c"}], ["prompt", "response"], "x")


def test_sft_mask_covers_response_and_eos_only(tok):
    examples, stats = encode_sft(tok, ROWS, max_length=64)
    batch = collate_sft(examples, tok.pad_token_id)
    for i, row in enumerate(ROWS):
        prompt_ids = tok(row["prompt"])["input_ids"]
        response_ids = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(prompt_ids) + len(response_ids)
        assert batch["input_ids"][i, :n].tolist() == prompt_ids + response_ids
        # mask: 0 on the prompt, 1 on response + EOS, 0 on padding
        expected = [0] * len(prompt_ids) + [1] * len(response_ids)
        expected += [0] * (batch["input_ids"].shape[1] - n)
        assert batch["response_mask"][i].tolist() == expected
        assert batch["attention_mask"][i].sum() == n
    assert stats.truncated == 0


def test_long_prompt_error_or_skip(tok):
    rows = ROWS + [{"prompt": "the movie was good " * 20, "response": "fine."}]
    with pytest.raises(TetherError, match="row 2 prompt has .* tokens.*max_length=16"):
        encode_sft(tok, rows, max_length=16)
    examples, stats = encode_sft(tok, rows, max_length=16, on_long_prompt="skip")
    assert len(examples) == 2 and stats.skipped_long_prompt == 1


def test_long_response_truncated_and_counted(tok):
    rows = [{"prompt": "it", "response": "was good and fun " * 10}]
    examples, stats = encode_sft(tok, rows, max_length=12)
    assert len(examples[0].prompt) + len(examples[0].responses[0]) == 12
    assert stats.truncated == 1


def test_chat_rows_use_template(tok):
    tok = load_tokenizer(tok.name_or_path)
    tok.chat_template = CHAT_TEMPLATE
    rows = [{"messages": [{"role": "user", "content": "the movie"},
                          {"role": "assistant", "content": "was good."}]}]
    examples, _ = encode_sft(tok, rows, max_length=64)
    ex = examples[0]
    assert tok.decode(ex.prompt) == "<user>the movie<assistant>"
    assert tok.decode(ex.responses[0]) == "was good."
    assert format_prompt(tok, rows[0] | {"messages": rows[0]["messages"][:1]}) == "<user>the movie<assistant>"
    assert format_prompt(tok, {"prompt": "abc"}) == "abc"


def test_chat_rows_without_template_error(tok):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    with pytest.raises(TetherError, match="no chat template"):
        encode_sft(tok, rows, max_length=64)


def test_preferences(tok):
    rows = [{"prompt": "it", "chosen": "was good.", "rejected": "was bad.", "m": 2}]
    examples, _ = encode_preferences(tok, rows, max_length=64, margin_column="m")
    batch = collate_pairs(examples, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 2  # chosen row then rejected row
    assert batch["margin"].tolist() == [2.0]
    chosen = batch["input_ids"][0][batch["response_mask"][0].bool()].tolist()
    assert tok.decode(chosen) == "was good." + tok.eos_token
    with pytest.raises(TetherError, match="row 0 has identical chosen and rejected"):
        encode_preferences(tok, [{"prompt": "a", "chosen": "x", "rejected": "x"}], max_length=64)
    with pytest.raises(TetherError, match="no column 'rejected'"):
        encode_preferences(tok, [{"prompt": "a", "chosen": "x"}], max_length=64)


def test_batch_order_is_an_epoch_permutation():
    # steps 0..2 of 10 rows in batches of 4 cover every row exactly once (4 + 4 + 2)
    epoch0 = sum((batch_order(10, 4, seed=3, step=s) for s in range(3)), [])
    assert sorted(epoch0) == list(range(10))
    epoch1 = sum((batch_order(10, 4, seed=3, step=s) for s in range(3, 6)), [])
    assert sorted(epoch1) == list(range(10)) and epoch1 != epoch0  # reshuffled
    assert batch_order(10, 4, seed=3, step=4) == batch_order(10, 4, seed=3, step=4)
