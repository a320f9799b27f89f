"""`tether dpo` with --pack (on the two-row layout, --no-share-prompt) and --micro-batch-tokens:
the step does not depend on how the batch of pairs is cut or whether its rows run packed, because
each micro-batch adds its pairs' loss sum divided by the whole step's pair count
(`accumulate_pairs`), and packed rows give each response token the log-prob it has padded. The
truth is the whole batch in one padded two-row forward, in float64: DPO's path before packing."""

from __future__ import annotations

import json

import pytest
import torch
from offline_fixtures import preference_rows, write_jsonl
from refusals import refused

from tether.cli import main
from tether.data.batches import collate_pairs
from tether.data.encoding import encode_preferences
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.run.distributed import Dist, Parallel
from tether.run.slicing import token_budget_cut
from tether.train.dpo import accumulate_pairs, collate, pair_lengths, pair_logprobs, pair_losses
from tether.train.offline_config import DPOConfig


def _pairs(tok, n=8):
    rows = preference_rows(n, seed=7)
    rows[1]["chosen"] += " and the long ending of the film was fine." * 2  # uneven lengths
    rows[-2]["prompt"] += " a much longer prompt than the others here"
    examples, _ = encode_preferences(tok, rows, max_length=128)
    return examples


def _reference_table(model, examples, pad_id):
    """A fixed reference: the starting model's (chosen, rejected) log-probs, shifted by a seeded
    offset per pair so each pair's loss slope differs (h != 0 at the first step)."""
    with torch.no_grad():
        chosen, rejected, _, _ = pair_logprobs(model, collate_pairs(examples, pad_id), False)
    generator = torch.Generator().manual_seed(11)
    return torch.stack([chosen, rejected], -1) + torch.randn(len(examples), 2, generator=generator,
                                                             dtype=torch.float64)


def _grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _truth(model, examples, pad_id, table, cfg):
    """Mean loss and gradient of the whole batch in one padded two-row forward."""
    model.zero_grad(set_to_none=True)
    policy = pair_logprobs(model, collate_pairs(examples, pad_id), cfg.chunked_lm_head)
    losses, _, _ = pair_losses(cfg, policy, *table.unbind(-1))
    losses.mean().backward()
    return losses.mean().detach(), _grad(model)


def _step(model, examples, pad_id, table, cfg):
    """`accumulate_pairs` (the loop's own code) over all pairs: the step's mean loss from the
    log-probs it returns (policy and reference, pair by pair in the micro-batches' order), and
    the gradient it leaves."""
    model.zero_grad(set_to_none=True)
    out = accumulate_pairs(Parallel(model), model, examples, list(range(len(examples))),
                           lambda rows, batch: table[rows].unbind(-1), cfg, Dist(), pad_id)
    losses, _, _ = pair_losses(cfg, out[:4], out[4], out[5])
    return losses.mean(), _grad(model)


def _config(**options):
    return DPOConfig(model="m", data="d", run_name="r", batch_size=8, **options)


@pytest.mark.parametrize("family, loss, chunked", [
    ("tiny_model_dir", "sigmoid", False), ("tiny_llama_dir", "sigmoid", False),
    ("tiny_llama_dir", "ipo", False), ("tiny_model_dir", "sigmoid", True)])
def test_every_cut_packed_or_not_gives_the_same_step(family, loss, chunked, request):
    model_dir = str(request.getfixturevalue(family))
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tok).double().eval()
    examples = _pairs(tok)
    table = _reference_table(model, examples, tok.pad_token_id)
    lengths = pair_lengths(model, examples, list(range(8)), share_prompt=False)
    assert len(set(lengths)) > 2
    budget = max(lengths) + 10
    assert 1 < len(token_budget_cut(lengths, budget)) < 8  # uneven parts: the weights matter
    common = {"loss": loss, "beta": 0.5, "chunked_lm_head": chunked, "share_prompt": False}
    truth_loss, truth = _truth(model, examples, tok.pad_token_id, table, _config(**common))
    assert float(truth.abs().max()) > 1e-3
    # the chunked head sums its weight gradient in fp32 within a micro-batch (as in SFT's test)
    tolerance = 1e-6 if chunked else 1e-12
    cuts = {"whole": {}, "four": {"grad_accum_steps": 4}, "budget": {"micro_batch_tokens": budget},
            "one pair each": {"micro_batch_tokens": 1}}
    for name, options in cuts.items():
        for pack in (False, True):
            cfg = _config(**common, **options, pack=pack)
            got_loss, got = _step(model, examples, tok.pad_token_id, table, cfg)
            # the returned log-probs are the metrics' float32 copies
            torch.testing.assert_close(got_loss.double(), truth_loss, rtol=1e-5, atol=0,
                                       msg=f"{name} {pack}")
            torch.testing.assert_close(got, truth, rtol=0, atol=tolerance, msg=f"{name} {pack}")


def test_a_token_budget_cuts_the_shared_prompt_layout_by_its_own_tokens(tiny_llama_dir):
    """Without --pack the default shared-prompt row takes a token budget too: a pair counts
    P + C + R there (the prompt once), and the budgeted step is the whole padded batch's."""
    tok = load_tokenizer(str(tiny_llama_dir))
    model = load_causal_lm(str(tiny_llama_dir), tok).double().eval()
    examples = _pairs(tok)
    indices = list(range(8))
    assert "segment" in collate(model, examples, tok.pad_token_id, share_prompt=True)
    shared = pair_lengths(model, examples, indices, share_prompt=True)
    two_rows = pair_lengths(model, examples, indices, share_prompt=False)
    assert [t - s for s, t in zip(shared, two_rows, strict=True)] == [len(e.prompt) for e in examples]
    table = _reference_table(model, examples, tok.pad_token_id)
    common = {"beta": 0.5, "chunked_lm_head": False}
    truth_loss, truth = _truth(model, examples, tok.pad_token_id, table,
                               _config(**common, share_prompt=False))
    budget = max(shared) + 10
    assert 1 < len(token_budget_cut(shared, budget)) < 8
    got_loss, got = _step(model, examples, tok.pad_token_id, table,
                          _config(**common, micro_batch_tokens=budget))
    torch.testing.assert_close(got_loss.double(), truth_loss, rtol=1e-5, atol=0)
    # the shared row itself matches the two-row pass to ~1e-6 only, in float64 too (whole batch:
    # 1.4e-6 here); a per-micro-batch mean misses by > 1e-4 (the next test)
    torch.testing.assert_close(got, truth, rtol=0, atol=1e-5)


def test_a_per_micro_batch_mean_would_depend_on_the_cut(tiny_model_dir):
    """What the global pair count prevents: each uneven micro-batch's own pair mean, averaged
    over the micro-batches, is another gradient than the whole batch's."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), tok).double().eval()
    examples = _pairs(tok)
    table = _reference_table(model, examples, tok.pad_token_id)
    cfg = _config(beta=0.5, chunked_lm_head=False, share_prompt=False)
    _, truth = _truth(model, examples, tok.pad_token_id, table, cfg)
    model.zero_grad(set_to_none=True)
    parts = [[0], [1, 2, 3, 4, 5, 6, 7]]
    for part in parts:
        policy = pair_logprobs(model, collate_pairs([examples[i] for i in part], tok.pad_token_id),
                               False)
        losses, _, _ = pair_losses(cfg, policy, *table[part].unbind(-1))
        (losses.mean() / len(parts)).backward()
    assert float((_grad(model) - truth).abs().max()) > 1e-4


@pytest.mark.parametrize("extra", [[], ["--precompute-ref-logprobs"]])
def test_dpo_cli_with_pack_and_token_budget_matches_the_padded_run(tiny_llama_dir, tmp_path,
                                                                   monkeypatch, extra):
    """The same losses and rewards as the padded run (reference live, or scored once before
    training), and both options acted: every policy and reference forward of the packed run was
    packed, and each step ran as several micro-batches."""
    from tether.train import dpo

    calls = []
    original = dpo.pair_logprobs

    def recording(model, batch, chunked=True, packed=False):
        calls.append((len(batch["input_ids"]) // 2, packed))
        return original(model, batch, chunked, packed)
    monkeypatch.setattr(dpo, "pair_logprobs", recording)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16, seed=2))
    base = ["dpo", "--model", str(tiny_llama_dir), "--data", str(data), "--output-dir",
            str(tmp_path / "runs"), "--max-steps", "2", "--batch-size", "8", "--lr", "1e-3",
            "--beta", "0.5", "--no-share-prompt", "--log-every", "1", "--device", "cpu", *extra]
    assert main([*base, "--run-name", "padded"]) == 0
    assert calls == [(8, False)] * 4  # two steps' policy and reference (or the 16 pairs scored)
    calls.clear()
    assert main([*base, "--run-name", "packed", "--pack", "--micro-batch-tokens", "80"]) == 0
    assert len(calls) > 4 and all(packed for _, packed in calls)
    assert max(pairs for pairs, _ in calls[-3:]) < 8  # the last step ran as several micro-batches
    runs = {}
    for name in ("padded", "packed"):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    assert len(runs["padded"]) == len(runs["packed"]) == 2
    for padded, packed in zip(runs["padded"], runs["packed"], strict=True):
        for key in ("train/loss", "rewards/margins", "logps/chosen", "objective/logratio"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert runs["padded"][1]["rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # it trained


@pytest.mark.parametrize("flags, pattern", [
    (["--pack"], "pass --no-share-prompt with --pack"),
    (["--micro-batch-tokens", "-1"], "micro_batch_tokens' must be >= 0"),
    (["--micro-batch-tokens", "64", "--grad-accum-steps", "2"], "pass one of them"),
])
def test_bad_dpo_packing_options_are_refused(tiny_model_dir, tmp_path, flags, pattern, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))
    refused(tmp_path, ["dpo", "--model", str(tiny_model_dir), "--data", str(data),
                       "--output-dir", str(tmp_path / "runs"), "--run-name", "bad",
                       "--batch-size", "4", *flags],
            pattern, capsys)
