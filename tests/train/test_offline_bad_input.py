"""Bad input: one clear line on stderr, exit code 2, and earlier results left exactly as they were."""

import pytest
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from refusals import refused, snapshot

from tether.cli import main


@pytest.fixture(scope="module")
def earlier_run(tiny_model_dir, tmp_path_factory):
    """A finished SFT run whose files the bad invocations must not touch."""
    root = tmp_path_factory.mktemp("bad_input")
    data = write_jsonl(root / "good.jsonl", sft_rows(8))
    out = root / "runs"
    code = main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "good",
                 "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4", "--save-every", "1",
                 "--device", "cpu"])
    assert code == 0
    return root, out


def _write(root, name, content: bytes):
    path = root / name
    path.write_bytes(content)
    return path


SFT_ROW = b'{"prompt": "the movie", "response": " was fine."}\n'
PAIR_ROW = b'{"prompt": "the movie", "chosen": " was fine.", "rejected": " was dull."}\n'

CASES = {
    "missing column": ("sft", "x.jsonl", b'{"prompt": "the movie"}\n', [], "no column 'response'"),
    "empty file": ("sft", "x.jsonl", b"", [], "has no rows"),
    "non-utf8": ("sft", "x.jsonl", '{"prompt": "caf\xe9", "response": "ok"}\n'.encode("latin-1"), [],
                 "not valid UTF-8"),
    "prompt over max length": ("dpo", "x.jsonl",
                               b'{"prompt": "' + b"the movie was long " * 30 + b'", "chosen": "a", "rejected": "b"}\n',
                               ["--max-length", "32"], "prompt has .* tokens.*max_length=32"),
    "chosen == rejected": ("rm", "x.jsonl", b'{"prompt": "p", "chosen": "same", "rejected": "same"}\n', [],
                           "identical chosen and rejected"),
    "chat rows without a chat template": (
        "dpo", "x.jsonl", b'{"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"}\n',
        [], "row 0.*no chat template"),
    "chosen not an assistant message": (
        "rm", "x.jsonl", b'{"prompt": [{"role": "user", "content": "hi"}], '
        b'"chosen": [{"role": "user", "content": "a"}], "rejected": "b"}\n',
        [], "row 0 'chosen' must be one assistant message after the prompt"),
    "list prompt that is not a chat": (
        "dpo", "x.jsonl", b'{"prompt": ["the", "movie"], "chosen": "a", "rejected": "b"}\n',
        [], "row 0 'prompt' must be a string or a list of .role, content. messages"),
    "unknown config field": ("dpo", "c.yaml", b"beta: 0.1\nbetta: 0.2\n", ["--config"],
                             "unknown config field 'betta' in .*; did you mean 'beta'\\?$"),
    "bad choice": ("dpo", "c.yaml", b"loss: hinge\n", ["--config"], "'loss' must be one of: sigmoid, ipo"),
    # memory and precision knobs: a value that cannot mean what it says is refused up front
    "accumulation does not divide the batch": ("sft", "x.jsonl", SFT_ROW, ["--grad-accum-steps", "3"],
                                               "--grad-accum-steps 3 must be >= 1 and divide --batch-size 8"),
    "accumulation steps 0": ("rm", "x.jsonl", PAIR_ROW, ["--grad-accum-steps", "0"],
                             "--grad-accum-steps 0 must be >= 1"),
    "more micro-batches than rows": ("dpo", "x.jsonl", PAIR_ROW,
                                     ["--batch-size", "4", "--grad-accum-steps", "8"],
                                     "--grad-accum-steps 8 must be >= 1 and divide --batch-size 4"),
    "bf16 autocast of float16 weights": ("sft", "x.jsonl", SFT_ROW,
                                         ["--mixed-precision", "bf16", "--dtype", "float16"],
                                         "--mixed-precision bf16 would recast float16 weights"),
    "unknown precision": ("dpo", "c.yaml", b"mixed_precision: fp16\n", ["--config"],
                          "'mixed_precision' must be one of: no, bf16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_exit_2_nothing_touched(case, earlier_run, tiny_model_dir, capsys):
    root, out = earlier_run
    stage, name, content, extra, pattern = CASES[case]
    path = _write(root, name, content)
    good_data = write_jsonl(root / "pairs.jsonl", preference_rows(4))
    data = str(good_data if name.endswith(".yaml") else path)
    extra = [*extra, str(path)] if extra == ["--config"] else extra
    # --resume on the earlier run's name: only input checking stands between it and its files
    argv = [stage, "--model", str(tiny_model_dir), "--data", data, "--run-name", "good",
            "--output-dir", str(out), "--resume", "--device", "cpu", *extra]
    refused(out, argv, pattern, capsys)


def test_existing_run_without_resume_is_refused(earlier_run, tiny_model_dir, capsys):
    root, out = earlier_run
    before = snapshot(out)
    data = write_jsonl(root / "good2.jsonl", sft_rows(4))
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "good",
                 "--output-dir", str(out), "--device", "cpu"]) == 2
    assert "already has results" in capsys.readouterr().err
    assert snapshot(out) == before


def test_unknown_flag_exit_2(tiny_model_dir, capsys):
    assert main(["rm", "--model", str(tiny_model_dir), "--data", "x.jsonl", "--run-name", "z",
                 "--learning-rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --learning-rate is TRL's name; tether's is --lr (docs/from_trl.md)"
