"""Stopping and resuming gives the same result as never stopping (CPU, fixed seed)."""

import json

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from safetensors.torch import load_file

from tether.train import dpo, sft


class Stop(Exception):
    pass


def _stop_after(module, monkeypatch, n_steps):
    """Make the stage die (like a killed job) during its (n_steps + 1)-th optimizer step."""
    real, calls = module.optimizer_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) > n_steps:
            raise Stop
        return real(*args, **kwargs)
    monkeypatch.setattr(module, "optimizer_step", step)


def _losses(run_dir):
    return [json.loads(x)["train/loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stage, lora", [("sft", 0), ("dpo", 0), ("sft", 4), ("dpo", 4)])
def test_resume_matches_uninterrupted(stage, lora, tiny_model_dir, tmp_path, monkeypatch):
    if stage == "sft":  # SFT keeps GPT-2's dropout on, so the restored RNG state matters here
        module, rows, extra = sft, sft_rows(24), {"lora_dropout": 0.1 if lora else 0.0}
        make = sft.SFTConfig
    else:
        module, rows, extra = dpo, preference_rows(24), {"precompute_ref_logprobs": True, "beta": 0.5}
        make = dpo.DPOConfig
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = dict(output_dir=str(tmp_path / "runs"), model=str(tiny_model_dir), data=str(data),
                  epochs=2, batch_size=5, lr=1e-3, warmup_steps=2, lr_schedule="cosine",
                  save_every=3, log_every=1, seed=3, device="cpu", lora_r=lora, **extra)
    whole = module.run(make(run_name="whole", **common))  # 2 epochs x 5 batches = 10 steps

    _stop_after(module, monkeypatch, 7)  # dies in step 8; the last checkpoint is step 6
    with pytest.raises(Stop):
        module.run(make(run_name="cut", **common))
    monkeypatch.undo()
    resumed = module.run(make(run_name="cut", resume=True, **common))

    weights = "adapter_model.safetensors" if lora else "model.safetensors"  # LoRA: the adapter
    a = load_file(str(whole.output_path / weights))
    b = load_file(str(resumed.output_path / weights))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    # the metric log reads as one run: steps 7 and 8 were dropped and logged again
    assert _losses(tmp_path / "runs" / "cut") == pytest.approx(_losses(tmp_path / "runs" / "whole"), abs=0)
    kept = sorted(p.name for p in (tmp_path / "runs" / "cut" / "checkpoints").iterdir())
    assert kept == ["step_6", "step_9"]  # the last two; step 10 is the final model itself
