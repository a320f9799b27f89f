"""SFT with --pack and --micro-batch-tokens: the step does not depend on how the batch is cut or
whether it is packed, because every micro-batch divides by the whole step's token count
(`sft_loss(..., batch_tokens)`). The truth is the gradient of the whole batch in one padded
forward, in float64."""

from __future__ import annotations

import json

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from refusals import refused

from tether.cli import main
from tether.data.batches import collate_sft
from tether.data.encoding import encode_sft
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.run.slicing import token_budget_cut
from tether.train.sft import response_tokens, sft_loss


def _gradient(model, examples, pad_id, parts, chunked, packed):
    """The step's gradient with the rows cut into `parts`, each dividing by the step's tokens."""
    model.zero_grad(set_to_none=True)
    batches = [collate_sft([examples[i] for i in part], pad_id) for part in parts]
    total = sum(response_tokens(b) for b in batches)
    for batch in batches:
        loss, _ = sft_loss(model, batch, total, chunked, packed)
        loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_every_cut_packed_or_not_gives_the_same_gradient(family, chunked, request):
    model_dir = str(request.getfixturevalue(family))
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tok).double().eval()
    rows = sft_rows(8, seed=3)
    rows[2]["response"] += " and the long ending of the film was fine." * 2  # uneven lengths
    examples, _ = encode_sft(tok, rows, max_length=96)
    lengths = [len(e.prompt) + len(e.responses[0]) for e in examples]
    assert len(set(lengths)) > 2
    whole = _gradient(model, examples, tok.pad_token_id, [list(range(8))], chunked, False)
    cuts = {"two": [[0, 1, 2, 3], [4, 5, 6, 7]], "eight": [[i] for i in range(8)],
            "budget": token_budget_cut(lengths, max(lengths) + 4)}
    assert 1 < len(cuts["budget"]) < 8
    for name, parts in cuts.items():
        for packed in (False, True):
            got = _gradient(model, examples, tok.pad_token_id, parts, chunked, packed)
            # the chunked head sums its weight gradient in fp32 within a micro-batch
            tolerance = 1e-12 if not chunked else 1e-6
            torch.testing.assert_close(got, whole, rtol=0, atol=tolerance, msg=f"{name} {packed}")
    packed_whole = _gradient(model, examples, tok.pad_token_id, [list(range(8))], chunked, True)
    torch.testing.assert_close(packed_whole, whole, rtol=0, atol=1e-12)  # the same rows packed


def test_a_per_micro_batch_mean_would_depend_on_the_cut(tiny_model_dir):
    """The bug the global denominator prevents: dividing each micro-batch by its own tokens
    (`batch_tokens=None`) changes the gradient with the cut, when lengths differ."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), tok).double().eval()
    rows = sft_rows(4, seed=3)
    rows[0]["response"] += " and the long ending of the film was fine."
    examples, _ = encode_sft(tok, rows, max_length=96)
    grads = []
    for parts in ([[0, 1, 2, 3]], [[0], [1, 2, 3]]):
        model.zero_grad(set_to_none=True)
        for part in parts:
            loss, _ = sft_loss(model, collate_sft([examples[i] for i in part], tok.pad_token_id))
            (loss / len(parts)).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert float((grads[0] - grads[1]).abs().max()) > 1e-4


def test_sft_cli_with_pack_and_token_budget_matches_the_padded_run(tiny_llama_dir, tmp_path,
                                                                   monkeypatch):
    """The same losses as the padded run, and both options acted: the packed run's forwards were
    packed, and each step ran as several micro-batches (8 rows of ~12 tokens, 40 per part)."""
    from tether.train import sft

    calls = []
    original = sft.sft_loss

    def recording(model, batch, batch_tokens=None, chunked=True, packed=False):
        calls.append((len(batch["input_ids"]), packed))
        return original(model, batch, batch_tokens, chunked, packed)
    monkeypatch.setattr(sft, "sft_loss", recording)
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))
    base = ["sft", "--model", str(tiny_llama_dir), "--data", str(data), "--output-dir",
            str(tmp_path / "runs"), "--max-steps", "2", "--batch-size", "8", "--lr", "1e-3",
            "--log-every", "1", "--device", "cpu"]
    assert main([*base, "--run-name", "padded"]) == 0
    assert calls == [(8, False)] * 2
    calls.clear()
    assert main([*base, "--run-name", "packed", "--pack", "--micro-batch-tokens", "40"]) == 0
    assert len(calls) > 2 and all(packed and rows < 8 for rows, packed in calls)
    runs = {}
    for name in ("padded", "packed"):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    for padded, packed in zip(runs["padded"], runs["packed"], strict=True):
        assert packed["train/tokens"] == padded["train/tokens"]
        assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-5)


@pytest.mark.parametrize("flags, pattern", [
    (["--micro-batch-tokens", "-1"], "micro_batch_tokens' must be >= 0"),
    (["--micro-batch-tokens", "64", "--grad-accum-steps", "2"], "pass one of them"),
])
def test_bad_sft_packing_options_are_refused(tiny_model_dir, tmp_path, flags, pattern, capsys):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    refused(tmp_path, ["sft", "--model", str(tiny_model_dir), "--data", str(data),
                       "--output-dir", str(tmp_path / "runs"), "--run-name", "bad",
                       "--batch-size", "4", *flags],
            pattern, capsys)
