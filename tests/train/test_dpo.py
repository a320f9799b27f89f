import json
import math

import pytest
import torch
from offline_fixtures import preference_rows, write_jsonl
from transformers import AutoModelForCausalLM

from tether.cli import main
from tether.errors import TetherError
from tether.train.dpo import DPOConfig, dpo_metrics, run


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _args(tiny_model_dir, data, out, name, *extra, steps=8):
    return ["dpo", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", name,
            "--output-dir", str(out), "--batch-size", "16", "--max-steps", str(steps), "--lr", "1e-3",
            "--lr-schedule", "constant", "--log-every", "1", "--device", "cpu", *extra]


@pytest.mark.slow
def test_dpo_cli_first_loss_ln2_and_margin_grows(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(64))
    assert main(_args(tiny_model_dir, data, tmp_path / "runs", "d", "--beta", "0.5")) == 0
    metrics = _metrics(tmp_path / "runs" / "d")
    # step 1 is scored before any update: policy == reference, so h = 0 and -log sigmoid(0) = ln 2
    assert metrics[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert metrics[0]["objective/logratio"] == pytest.approx(0.0, abs=1e-5)
    margins = [m["rewards/margins"] for m in metrics]
    assert margins[-1] > 1.0 and margins[-1] > max(margins[:4])
    assert metrics[-1]["train/loss"] < 0.5 * math.log(2)
    assert metrics[-1]["rewards/accuracies"] > 0.9
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "d" / "final")
    assert model.config.pad_token_id is not None


@pytest.mark.slow
def test_precomputed_reference_matches_live_reference(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(32))
    out = tmp_path / "runs"
    assert main(_args(tiny_model_dir, data, out, "live", steps=3)) == 0
    assert main(_args(tiny_model_dir, data, out, "pre", "--precompute-ref-logprobs", steps=3)) == 0
    live, pre = _metrics(out / "live"), _metrics(out / "pre")
    for a, b in zip(live, pre, strict=True):  # same maths, reference scored once vs every step
        for key in ("train/loss", "rewards/chosen", "rewards/rejected", "objective/logratio"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), key


@pytest.mark.slow
def test_ipo_runs_and_loss_falls(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(64))
    beta = 0.5
    # also the plain concatenated [2B, P+R] pass, end to end
    assert main(_args(tiny_model_dir, data, tmp_path / "runs", "ipo", "--loss", "ipo",
                      "--beta", str(beta), "--lr", "3e-4", "--no-share-prompt")) == 0
    metrics = _metrics(tmp_path / "runs" / "ipo")
    # at step 1, h = 0, so the IPO loss is (0 - 1/(2 beta))^2 = 1 for beta = 0.5
    assert metrics[0]["train/loss"] == pytest.approx((1 / (2 * beta)) ** 2, abs=1e-5)
    assert metrics[-1]["train/loss"] < 0.5 * metrics[0]["train/loss"]


def test_metrics_by_hand():
    # rewards beta*(pi - ref): chosen [0.2, -0.1], rejected [0.1, 0.1], beta 0.5
    chosen, rejected = torch.tensor([0.2, -0.1]), torch.tensor([0.1, 0.1])
    m = dpo_metrics(torch.tensor([0.5, 0.7]), chosen, rejected, beta=0.5)
    assert m["train/loss"] == pytest.approx(0.6)
    assert m["rewards/margins"] == pytest.approx((0.1 - 0.2) / 2)  # margins 0.1 and -0.2
    assert m["rewards/accuracies"] == 0.5
    # log-ratios are rewards / beta: [0.4, -0.2] and [0.2, 0.2]; their mean is 0.15
    assert m["objective/logratio"] == pytest.approx(0.15)


def test_config_rejects_smoothing_with_ipo():
    with pytest.raises(TetherError, match="label_smoothing"):
        DPOConfig(run_name="x", model="m", data="d", loss="ipo", label_smoothing=0.1).validate()


def test_python_api_returns_path_and_metrics(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(8))
    cfg = DPOConfig(run_name="api", output_dir=str(tmp_path), model=str(tiny_model_dir), data=str(data),
                    max_steps=1, batch_size=8, label_smoothing=0.2, device="cpu")
    result = run(cfg)
    assert result.output_path == tmp_path / "api" / "final"
    # cDPO at h = 0: -(0.8) log(1/2) - 0.2 log(1/2) = ln 2 again
    assert result.metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_separate_reference_model(tiny_model_dir, tmp_path):
    # policy and reference loaded separately from the same weights: step 1 is still exactly ln 2
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(8))
    for precompute in (False, True):
        cfg = DPOConfig(run_name=f"ref{precompute}", output_dir=str(tmp_path), model=str(tiny_model_dir),
                        ref_model=str(tiny_model_dir), data=str(data), max_steps=1, batch_size=8,
                        device="cpu", precompute_ref_logprobs=precompute)
        assert run(cfg).metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-5)


def _chat_rows(n: int) -> list[dict]:
    """Chat preference rows (prompt as messages, replies as assistant messages) from the plain ones."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]}
            for r in preference_rows(n)]


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_first_step_is_ln2_on_each_family(family, request, tmp_path):
    model_dir = request.getfixturevalue(family)
    # the Llama-style model reads chat preference rows with its own template
    rows = _chat_rows(8) if family == "tiny_llama_dir" else preference_rows(8)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DPOConfig(run_name="f", output_dir=str(tmp_path), model=str(model_dir), data=str(data),
                    max_steps=1, batch_size=8, device="cpu")
    assert run(cfg).metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_sliding_window_model_same_logps_with_and_without_prefix_sharing(tiny_mistral_dir, tmp_path):
    # Mistral-style, window 8, pairs far longer than the window, Metaspace tokenizer: the shared
    # pass must carry the window (it once gave step-1 logps/chosen -39.86 against -39.15).
    rows = [r | {"prompt": r["prompt"] + " and the story was long but the music was fun",
                 "chosen": r["chosen"] + " the ending was fine"} for r in preference_rows(8)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    results = {}
    for share in (True, False):
        cfg = DPOConfig(run_name=f"share{share}", output_dir=str(tmp_path), model=str(tiny_mistral_dir),
                        data=str(data), max_steps=2, batch_size=8, lr=1e-3, device="cpu",
                        share_prompt=share, log_every=1)
        run(cfg)
        results[share] = _metrics(tmp_path / f"share{share}")
    for shared, concat in zip(results[True], results[False], strict=True):
        for key in ("logps/chosen", "logps/rejected", "train/loss", "train/grad_norm"):
            assert shared[key] == pytest.approx(concat[key], rel=1e-4, abs=1e-4), key
