"""`tether rm` with --pack and --micro-batch-tokens: the step does not depend on how the batch of
pairs is cut or whether its rows run packed, because each micro-batch's pair-mean loss is weighted
by its share of the whole step's pairs (`accumulate_pairs`) and the packed forward reads each
score at the same last real token. The truth is the whole batch in one padded forward, in float64:
the reward-model path as it was before packing."""

from __future__ import annotations

import json

import pytest
import torch
from offline_fixtures import preference_rows, write_jsonl
from refusals import refused

from tether.cli import main
from tether.data.batches import collate_pairs
from tether.data.encoding import encode_preferences
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.run.distributed import Dist, Parallel
from tether.run.slicing import token_budget_cut
from tether.train.offline import example_tokens, step_micro_batches
from tether.train.offline_config import RMConfig
from tether.train.reward import accumulate_pairs, rm_loss

CENTER = 0.05  # the centring term on too: both terms are pair means


def _pairs(tok, n=8):
    rows = preference_rows(n, seed=5)
    for i, row in enumerate(rows):
        row["margin"] = 0.25 * i  # a margin column, read per pair
    rows[1]["chosen"] += " and the long ending of the film was fine." * 2  # uneven lengths
    rows[-2]["prompt"] += " a much longer prompt than the others here"
    examples, _ = encode_preferences(tok, rows, max_length=128, margin_column="margin")
    return examples


def _whole_batch_truth(model, examples, pad_id):
    """Loss and gradient of the whole batch in one padded forward (the path before packing)."""
    model.zero_grad(set_to_none=True)
    batch = collate_pairs(examples, pad_id)
    scores = model(batch["input_ids"], batch["attention_mask"])
    half = len(examples)
    loss, _ = rm_loss(scores[:half], scores[half:], batch["margin"].double(), CENTER)
    loss.backward()
    return loss.detach(), _grad(model)


def _grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _step(model, examples, pad_id, **options):
    """`accumulate_pairs` (the loop's own code) over all pairs with these options: the scores it
    returns and the gradient it leaves."""
    model.zero_grad(set_to_none=True)
    cfg = RMConfig(model="m", data="d", run_name="r", batch_size=len(examples), margin_column="margin",
                   center_rewards_coef=CENTER, **options)
    chosen, rejected, margins = accumulate_pairs(Parallel(model), examples,
                                                 list(range(len(examples))), cfg, Dist(), pad_id)
    loss, _ = rm_loss(chosen, rejected, margins, CENTER)
    return loss, _grad(model)


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_every_cut_packed_or_not_gives_the_same_step(family, request):
    model_dir = str(request.getfixturevalue(family))
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = RewardModel.from_causal_lm(model_dir, tok).double().eval()
    examples = _pairs(tok)
    lengths = example_tokens(examples, list(range(8)), 2)  # two rows per pair: 2 P + C + R
    assert len(set(lengths)) > 2
    budget = max(lengths) + 10
    assert 1 < len(token_budget_cut(lengths, budget)) < 8  # uneven parts: the weights matter
    truth_loss, truth = _whole_batch_truth(model, examples, tok.pad_token_id)
    assert float(truth.abs().max()) > 1e-3
    cuts = {"whole": {}, "four": {"grad_accum_steps": 4}, "budget": {"micro_batch_tokens": budget},
            "one pair each": {"micro_batch_tokens": 1}}
    for name, options in cuts.items():
        for pack in (False, True):
            loss, got = _step(model, examples, tok.pad_token_id, pack=pack, **options)
            torch.testing.assert_close(loss, truth_loss, rtol=0, atol=1e-12, msg=f"{name} {pack}")
            torch.testing.assert_close(got, truth, rtol=0, atol=1e-12, msg=f"{name} {pack}")


def test_the_packed_score_is_read_at_each_rows_last_real_token(tiny_llama_dir):
    """Independent of the padded batch: each packed score equals the row scored alone, with no
    padding at all (the last token is then the last column)."""
    tok = load_tokenizer(str(tiny_llama_dir))
    torch.manual_seed(0)
    model = RewardModel.from_causal_lm(str(tiny_llama_dir), tok).double().eval()
    examples = _pairs(tok, 4)
    batch = collate_pairs(examples, tok.pad_token_id)
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["attention_mask"], packed=True)
        alone = [model(ids[mask.bool()][None], torch.ones(1, int(mask.sum())))[0]
                 for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    torch.testing.assert_close(packed, torch.stack(alone), rtol=0, atol=1e-12)


def test_a_per_micro_batch_mean_would_depend_on_the_cut(tiny_model_dir):
    """What the share weighting prevents: each uneven micro-batch's own pair mean, averaged over
    the micro-batches, is another gradient than the whole batch's."""
    tok = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    model = RewardModel.from_causal_lm(str(tiny_model_dir), tok).double().eval()
    examples = _pairs(tok)
    _, truth = _whole_batch_truth(model, examples, tok.pad_token_id)
    model.zero_grad(set_to_none=True)
    parts = [[0], [1, 2, 3, 4, 5, 6, 7]]
    for part in parts:
        batch = collate_pairs([examples[i] for i in part], tok.pad_token_id)
        scores = model(batch["input_ids"], batch["attention_mask"])
        loss, _ = rm_loss(scores[:len(part)], scores[len(part):], batch["margin"].double(), CENTER)
        (loss / len(parts)).backward()
    assert float((_grad(model) - truth).abs().max()) > 1e-4


@pytest.mark.parametrize("extra", [[], ["--lora-r", "4"]])
def test_rm_cli_with_pack_and_token_budget_matches_the_padded_run(tiny_llama_dir, tmp_path,
                                                                  monkeypatch, extra):
    """The same losses and held-out accuracy as the padded run, and both options acted: the
    packed run's forwards were packed (training and evaluation), and each step ran as several
    micro-batches. With LoRA the trunk packs with the adapter's layers in it."""
    from tether.train import reward

    calls = []
    original = reward.pair_scores

    def recording(model, batch, packed=False):
        calls.append((len(batch["input_ids"]) // 2, packed))
        return original(model, batch, packed)
    monkeypatch.setattr(reward, "pair_scores", recording)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(20, seed=2))
    base = ["rm", "--model", str(tiny_llama_dir), "--data", str(data), "--output-dir",
            str(tmp_path / "runs"), "--max-steps", "2", "--batch-size", "8", "--lr", "1e-3",
            "--eval-fraction", "0.2", "--log-every", "1", "--device", "cpu", *extra]
    assert main([*base, "--run-name", "padded"]) == 0
    assert all(not packed for _, packed in calls) and (8, False) in calls
    calls.clear()
    assert main([*base, "--run-name", "packed", "--pack", "--micro-batch-tokens", "60"]) == 0
    assert all(packed for _, packed in calls)
    assert max(pairs for pairs, _ in calls[:4]) < 8  # a step ran as several micro-batches
    runs = {}
    for name in ("padded", "packed"):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    assert len(runs["padded"]) == len(runs["packed"]) == 3  # two steps, then the final eval
    for padded, packed in zip(runs["padded"], runs["packed"], strict=True):
        assert packed.keys() == padded.keys()
        for key in ("train/loss", "rewards/margin", "eval/loss", "eval/accuracy"):
            if key in padded:
                assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("flags, pattern", [
    (["--micro-batch-tokens", "-1"], "micro_batch_tokens' must be >= 0"),
    (["--micro-batch-tokens", "64", "--grad-accum-steps", "2"], "pass one of them"),
])
def test_bad_rm_packing_options_are_refused(tiny_model_dir, tmp_path, flags, pattern, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))
    refused(tmp_path, ["rm", "--model", str(tiny_model_dir), "--data", str(data),
                       "--output-dir", str(tmp_path / "runs"), "--run-name", "bad",
                       "--batch-size", "4", *flags],
            pattern, capsys)


def budget_of(tokens: int) -> RMConfig:
    return RMConfig(model="m", data="d", run_name="r", micro_batch_tokens=tokens)


def test_a_token_budget_under_torchrun_deals_every_pair_once_with_equal_counts():
    """Under torchrun each rank runs its micro-batches of the step's pairs: together the ranks'
    real micro-batches hold every pair exactly once, each within the budget (a pair over it
    alone), every rank runs as many micro-batches (a rank short of pairs runs a borrowed one,
    not real), and the ranks' token sums are as even as the longest-first rule makes them."""
    indices = [7, 3, 11, 0, 5, 9, 2]
    lengths = [90, 10, 12, 14, 40, 41, 8]
    budget = budget_of(50)
    ranks = [step_micro_batches(indices, lengths, budget, Dist(rank=r, world_size=2))
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    real = [rows for rank in ranks for rows, is_real in rank if is_real]
    assert sorted(k for rows in real for k in rows) == sorted(indices)
    tokens = dict(zip(indices, lengths, strict=True))
    assert all(sum(tokens[k] for k in rows) <= 50 or len(rows) == 1 for rows in real)
    # By hand, longest first to the lighter rank: 90 | 41, 40, 14 | then 12 to rank 0 (90 <
    # 95), 10 to rank 1 (95 < 102), 8 to rank 0; rank 0's {90} {12, 8} is split to match rank
    # 1's three micro-batches.
    assert ranks[0] == [([7], True), ([11], True), ([2], True)]
    assert ranks[1] == [([9], True), ([3, 5], True), ([0], True)]
    # A rank whose micro-batches are single rows and fewer runs a borrowed one, not real.
    short = [step_micro_batches([1, 2, 3], [100, 30, 30], budget_of(40),
                                Dist(rank=r, world_size=2)) for r in range(2)]
    assert short == [[([1], True), ([1], False)], [([2], True), ([3], True)]]
    # One process: the whole step cut first-fit decreasing, as before.
    one = step_micro_batches(indices, lengths, budget, Dist())
    assert one == [([7], True), ([9, 2], True), ([3, 5], True), ([11, 0], True)]
