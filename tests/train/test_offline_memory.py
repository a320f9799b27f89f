"""Offline stages (SFT, RM, DPO): gradient accumulation and gradient checkpointing change memory,
never the update.

The independent truth is the plain run: one forward/backward over the whole batch, no
checkpointing. Accumulating k micro-batches must give the same weights and the same logged metrics
(to float rounding), and checkpointing must too; layer-call counts show each knob really acted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from scale_helpers import (
    assert_same_weights,
    layer_calls,
    max_change,
    no_dropout_copy,
    weights,
)

from tether.models.prepare import enable_gradient_checkpointing
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.reward_model import RewardModel
from tether.run.slicing import micro_batches
from tether.train import dpo, reward, sft

STAGES = {"sft": (sft, sft.SFTConfig), "rm": (reward, reward.RMConfig),
          "dpo": (dpo, dpo.DPOConfig)}


@pytest.fixture(scope="module")
def no_dropout_dirs(tiny_model_dir, tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nodrop")
    return {"tiny_model_dir": no_dropout_copy(tiny_model_dir, root / "gpt2"),
            "tiny_llama_dir": no_dropout_copy(tiny_llama_dir, root / "llama")}


def _run(stage, tmp_path, model_dir, name, **overrides):
    """Run a stage; return its final weights, metric lines, layer calls and the gradients each
    optimizer step applied (recorded just before the step)."""
    module, make = STAGES[stage]
    rows = sft_rows(10) if stage == "sft" else preference_rows(10)
    data = write_jsonl(tmp_path / f"{stage}.jsonl", rows)
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), model=str(model_dir),
                  data=str(data), batch_size=4, max_steps=2, lr=1e-4, log_every=1,
                  save_every=0, device="cpu", seed=1)
    if stage == "rm":
        values |= dict(eval_fraction=0.0, center_rewards_coef=0.1)
    values.update(overrides)
    real_step, grads = module.optimizer_step, []

    def recording_step(model, *args, **kwargs):
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_step(model, *args, **kwargs)

    module.optimizer_step = recording_step
    try:
        with layer_calls() as calls:
            result = module.run(make(**values))
    finally:
        module.optimizer_step = real_step
    lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return Run(weights(result.output_path), [json.loads(x) for x in lines], calls, grads)


@dataclass
class Run:
    weights: dict
    metrics: list
    calls: list
    grads: list


def _same_grads(a: list[dict], b: list[dict], rtol: float) -> None:
    """Gradients equal to float rounding: elementwise rtol, plus an atol of rtol times the
    largest gradient (entries that cancel to ~0 carry the rounding of their summands)."""
    assert len(a) == len(b) >= 2
    for step_a, step_b in zip(a, b, strict=True):
        assert step_a.keys() == step_b.keys()
        scale = max(g.abs().max().item() for g in step_a.values())
        for key in step_a:
            torch.testing.assert_close(step_b[key], step_a[key], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, key=key: f"{key}: {m}")


def _initial(stage, model_dir):
    tokenizer = load_tokenizer(str(model_dir))
    if stage == "rm":  # saved as a sequence classifier: the trunk under its prefix, plus `score`
        trunk = RewardModel.from_causal_lm(str(model_dir), tokenizer).backbone
        return {f"{trunk.base_model_prefix}.{k}": v for k, v in weights(trunk).items()}
    return weights(load_causal_lm(str(model_dir), tokenizer))


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) >= 2
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            # abs: implicit KL and rewards are small differences of summed log-probs (~30 nats)
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-5), key


def _grad_rows(calls):
    return [rows for rows, grad in calls if grad]


DPO_VARIANTS = {"concatenated": {"share_prompt": False},
                "precomputed ref": {"precompute_ref_logprobs": True}, "ipo": {"loss": "ipo"}}


def _cases():
    """Every stage on both models; DPO's other batch layouts and IPO on GPT-2 only (time)."""
    for model in ("tiny_model_dir", "tiny_llama_dir"):
        for stage in ("sft", "rm", "dpo"):
            yield pytest.param(model, stage, {}, id=f"{model}-{stage}")
    for name, extra in DPO_VARIANTS.items():
        yield pytest.param("tiny_model_dir", "dpo", extra, id=f"tiny_model_dir-dpo-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("model, stage, extra", list(_cases()))
def test_accumulation_and_checkpointing_give_the_plain_update(model, stage, extra, no_dropout_dirs,
                                                              tmp_path):
    model_dir = no_dropout_dirs[model]
    plain = _run(stage, tmp_path, model_dir, "plain", **extra)
    accum = _run(stage, tmp_path, model_dir, "accum", grad_accum_steps=2, **extra)
    ckpt = _run(stage, tmp_path, model_dir, "ckpt", gradient_checkpointing=True, **extra)

    # Accumulation: each step's gradient is the full batch's, hence the same weights after 2 Adam
    # steps and the same logged metrics. Adam divides by |g|, so the odd entry whose gradient
    # nearly cancels turns 1e-7 of summation-order rounding into ~1e-6 of weight; the weights
    # moved 1.5e-4 (1.5 lr), so atol 5e-6 still tells a changed update from an equal one.
    _same_grads(plain.grads, accum.grads, rtol=1e-5)
    assert max_change(_initial(stage, model_dir), plain.weights) > 1e-4
    assert_same_weights(plain.weights, accum.weights, rtol=1e-5, atol=5e-6)
    _same_metrics(plain.metrics, accum.metrics)
    # ... and it acted: every trained forward saw half the rows, twice as often.
    plain_rows = _grad_rows(plain.calls)
    assert sorted(_grad_rows(accum.calls)) == sorted([r // 2 for r in plain_rows] * 2)

    # Checkpointing: each trained layer call runs once more, in the backward pass; the update is
    # the plain one (the recompute reruns the same operations).
    assert len(ckpt.calls) == len(plain.calls) + len(plain_rows)
    _same_grads(plain.grads, ckpt.grads, rtol=1e-6)
    assert_same_weights(plain.weights, ckpt.weights, rtol=1e-6, atol=1e-8)
    _same_metrics(plain.metrics, ckpt.metrics)


@pytest.mark.slow
def test_uneven_last_batch_accumulates_exactly(tiny_model_dir, tmp_path):
    # 10 rows, batches of 4: step 3 gets the 2 rows left, split 4 ways into 1 + 1 (2 empty ones
    # dropped). Token-count weighting keeps it equal to the plain step; GPT-2's dropout is off.
    model_dir = no_dropout_copy(tiny_model_dir, tmp_path / "nodrop")
    plain = _run("sft", tmp_path, model_dir, "plain", max_steps=3)
    accum = _run("sft", tmp_path, model_dir, "accum", max_steps=3, grad_accum_steps=4)
    _same_grads(plain.grads, accum.grads, rtol=1e-5)
    assert_same_weights(plain.weights, accum.weights, rtol=1e-5, atol=5e-6)
    _same_metrics(plain.metrics, accum.metrics)
    assert _grad_rows(accum.calls) == [1] * 2 * (4 + 4 + 2)  # 2 layers; 4, 4 and 2 micro-batches


def test_micro_batches_split_evenly_and_drop_empties():
    assert micro_batches([5, 6, 7, 8], 2) == [[5, 6], [7, 8]]
    assert micro_batches([5, 6, 7], 2) == [[5, 6], [7]]
    assert micro_batches([5, 6], 4) == [[5], [6]]
    assert micro_batches([5, 6, 7, 8], 1) == [[5, 6, 7, 8]]


def test_checkpointing_on_a_lora_model_matches_plain_gradients(tiny_llama_dir):
    # A frozen base with LoRA adapters: non-reentrant checkpointing needs no input that requires
    # grad, and peft's wrapper reaches the transformers model inside.
    peft = pytest.importorskip("peft")
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    ids = torch.tensor([tokenizer("the movie was good and the plot was fun")["input_ids"]] * 2)
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        base = load_causal_lm(str(tiny_llama_dir), tokenizer)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False)  # random B: nonzero gradients on A too
        model = peft.get_peft_model(base, config)
        if checkpointing:
            assert enable_gradient_checkpointing(model) is model
            # transformers 5.20 renamed the flag (the vllm extra pins 5.19)
            assert (getattr(base, "is_activation_checkpointing", False)
                    or getattr(base, "is_gradient_checkpointing", False))
        model.train()
        with layer_calls() as calls:
            model(input_ids=ids, labels=ids).loss.backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.requires_grad}
        n_layers = base.config.num_hidden_layers
        assert len(calls) == n_layers * (2 if checkpointing else 1)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name in grads[True]:
        assert grads[True][name].abs().sum() > 0, name
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-6, atol=1e-8)


def test_checkpointing_an_unsupported_model_is_one_clear_line():
    from tether.errors import TetherError

    with pytest.raises(TetherError, match="Linear does not support gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
