import json

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl

from tether.cli import main
from tether.data.batches import collate_sft
from tether.data.encoding import encode_sft
from tether.models.reward_model import RewardModel
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


def test_rm_reads_chat_preference_rows_like_sft_messages(tiny_llama_dir, tmp_path):
    # Llama-style model, chat preference rows (the shape of most public preference sets). The
    # step-1 scores (before the update) must be those of the same chats encoded as SFT
    # {messages} rows, scored by an identically initialised reward model.
    from tether.models.pretrained import load_tokenizer
    from tether.run.launch import seed_everything

    user = [{"role": "user", "content": r["prompt"]} for r in preference_rows(8)]
    replies = {k: [{"role": "assistant", "content": r[k].strip()} for r in preference_rows(8)]
               for k in ("chosen", "rejected")}
    rows = [{"prompt": [u], "chosen": c, "rejected": r}
            for u, c, r in zip(user, replies["chosen"], replies["rejected"], strict=True)]
    cfg = RMConfig(run_name="chat", output_dir=str(tmp_path), model=str(tiny_llama_dir),
                   data=str(write_jsonl(tmp_path / "p.jsonl", rows)), max_steps=1, batch_size=8,
                   eval_fraction=0.0, device="cpu", seed=3)
    metrics = run(cfg).metrics
    tok = load_tokenizer(str(tiny_llama_dir))
    seed_everything(3)
    model = RewardModel.from_causal_lm(str(tiny_llama_dir), tok).eval()
    means = {}
    for key in ("chosen", "rejected"):
        chats = [{"messages": [u, m]} for u, m in zip(user, replies[key], strict=True)]
        batch = collate_sft(encode_sft(tok, chats, 64)[0], tok.pad_token_id)
        assert (batch["input_ids"] == tok.bos_token_id).sum(1).tolist() == [1] * 8
        with torch.no_grad():
            means[key] = model(batch["input_ids"], batch["attention_mask"]).mean().item()
    assert metrics["rewards/chosen"] == pytest.approx(means["chosen"], abs=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(means["rejected"], abs=1e-5)


def test_score_texts_encodes_like_training(tiny_model_dir, tmp_path):
    """score_texts == score on the ids `tether rm` trains on (prompt, response, EOS), and not the
    score of the raw text without EOS."""
    from tether.data.batches import collate_sft
    from tether.data.encoding import encode_sft
    from tether.models.pretrained import load_tokenizer
    from tether.models.reward_model import RewardModel

    tok = load_tokenizer(str(tiny_model_dir))
    rm = RewardModel.from_causal_lm(str(tiny_model_dir), tok)
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    prompts, responses = ["the movie was", "it"], [" good and fun.", " dull"]
    rows = [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]
    batch = collate_sft(encode_sft(tok, rows, 64)[0], tok.pad_token_id)
    assert batch["input_ids"][0, int(batch["attention_mask"][0].sum()) - 1] == tok.eos_token_id
    expected = rm.score(batch["input_ids"], batch["attention_mask"])
    got = rm.score_texts(prompts, responses, batch_size=1)
    torch.testing.assert_close(got, expected)
    raw = tok([p + r for p, r in zip(prompts, responses)], return_tensors="pt", padding=True)
    assert not torch.allclose(rm.score(raw["input_ids"], raw["attention_mask"]), expected)
