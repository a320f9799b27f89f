import json

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl

from tether.cli import main
from tether.data import collate_sft, encode_sft
from tether.models import RewardModel
from tether.train.reward import RMConfig, run


@pytest.mark.slow
def test_rm_cli_learns_rule_and_normalises(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", preference_rows(128, seed=0))
    held_out = write_jsonl(tmp_path / "eval.jsonl", preference_rows(48, seed=1))
    norm_rows = sft_rows(24, seed=2)
    norm = write_jsonl(tmp_path / "sft.jsonl", norm_rows)
    code = main(["rm", "--model", str(tiny_model_dir), "--data", str(data), "--eval-data", str(held_out),
                 "--normalize-data", str(norm), "--run-name", "r", "--output-dir", str(tmp_path / "runs"),
                 "--epochs", "3", "--batch-size", "16", "--lr", "2e-3", "--log-every", "4", "--device", "cpu"])
    assert code == 0
    run_dir = tmp_path / "runs" / "r"
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["eval/accuracy"] > 0.9, final

    model = RewardModel.from_pretrained(run_dir / "final")  # the reward model's own loader
    model.eval()
    tok = model.tokenizer
    # independent accuracy check on the held-out rows with the loaded model
    rows = preference_rows(48, seed=1)
    def scores(key):
        examples, _ = encode_sft(tok, [{"prompt": r["prompt"], "response": r[key]} for r in rows], 64)
        batch = collate_sft(examples, tok.pad_token_id)
        with torch.no_grad():
            return model.score(batch["input_ids"], batch["attention_mask"])
    assert (scores("chosen") > scores("rejected")).float().mean() > 0.9
    # stored normalisation: SFT samples score mean 0, std 1 after reloading
    examples, _ = encode_sft(tok, norm_rows, 64)
    batch = collate_sft(examples, tok.pad_token_id)
    with torch.no_grad():
        normed = model.score(batch["input_ids"], batch["attention_mask"])
    assert abs(normed.mean().item()) < 1e-4 and abs(normed.std(unbiased=False).item() - 1) < 1e-4
    assert model.norm_std != 1.0  # the constants really were stored, not defaults


def test_rm_margin_and_centring_change_the_objective(tiny_model_dir, tmp_path):
    rows = [r | {"strength": 3.0} for r in preference_rows(16)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    common = dict(output_dir=str(tmp_path / "runs"), model=str(tiny_model_dir), data=str(data),
                  max_steps=1, batch_size=16, eval_fraction=0.0, device="cpu", lr=1e-9)
    plain = run(RMConfig(run_name="plain", **common)).metrics
    margin = run(RMConfig(run_name="margin", margin_column="strength", **common)).metrics
    center = run(RMConfig(run_name="center", center_rewards_coef=2.0, **common)).metrics
    # same initial model and batch, so the scores match; a margin of 3 makes each pair's
    # -log sigmoid(d - 3) larger than -log sigmoid(d), and centring adds 2 * mean((c + r)^2) >= 0
    assert plain["rewards/chosen"] == pytest.approx(margin["rewards/chosen"], abs=1e-6)
    assert margin["train/bt_loss"] > plain["train/bt_loss"] + 1.0
    c, r = center["rewards/chosen"], center["rewards/rejected"]
    assert center["train/loss"] > center["train/bt_loss"]
    assert center["train/loss"] - center["train/bt_loss"] >= 2.0 * ((c + r) ** 2) - 1e-6  # Jensen
