"""Options every stage shares, checked on each (sft, rm, dpo and the online loop), plus the reward
model's own: each test fails when the stage silently ignores the options it names (see
test_options_effect.py; tests/audit/mutate_options.py checks the claim).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from safetensors.torch import load_file
from test_options_effect import ModelCalls, final_metrics, offline_run, train_lines
from test_options_effect_online import online_run

from tether.errors import TetherError

STAGES = ["sft", "rm", "dpo", "online"]


def any_run(stage, model_dir, tmp_path, name="r", **overrides):
    """(result, run directory) of one tiny run of `stage`."""
    if stage == "online":
        result, run_dir, _, _ = online_run(model_dir, tmp_path, name=name, **overrides)
        return result, run_dir
    return offline_run(stage, model_dir, tmp_path, name=name, **overrides)


@pytest.mark.parametrize("stage", STAGES)
def test_device_is_used(stage, tiny_model_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal of cuda on a machine without it")
    with pytest.raises(TetherError, match="CUDA is not available"):
        any_run(stage, tiny_model_dir, tmp_path, device="cuda")


@pytest.mark.parametrize("stage", STAGES)
def test_trust_remote_code_reaches_the_loaders(stage, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    seen = []
    original = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, *args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    any_run(stage, tiny_model_dir, tmp_path, trust_remote_code=True)
    assert seen and all(seen)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_allow_changes_accepts_and_records_a_harmless_change(stage, tiny_model_dir, tmp_path):
    # a run cut short after its checkpoints (final/ removed), resumed with another log_every
    _, run_dir = any_run(stage, tiny_model_dir, tmp_path, save_every=1, log_every=1,
                         **({"total_episodes": 8} if stage == "online" else {"max_steps": 2}))
    shutil.rmtree(run_dir / "final")
    again = {"save_every": 1, "log_every": 2, "resume": True,
             **({"total_episodes": 8} if stage == "online" else {"max_steps": 2})}
    with pytest.raises(TetherError, match="resume-allow-changes"):
        any_run(stage, tiny_model_dir, tmp_path, **again)
    any_run(stage, tiny_model_dir, tmp_path, resume_allow_changes=True, **again)
    assert (run_dir / "final").is_dir()
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changes"]["log_every"] == {"saved": 1, "now": 2}


@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_and_dtype(stage, tiny_model_dir, tmp_path):
    with ModelCalls() as calls:
        any_run(stage, tiny_model_dir, tmp_path, name="mp", mixed_precision="bf16")
    assert torch.bfloat16 in calls.dtypes  # forwards ran under autocast
    with ModelCalls() as calls:
        any_run(stage, tiny_model_dir, tmp_path, name="fp32")
    assert torch.bfloat16 not in calls.dtypes
    _, run_dir = any_run(stage, tiny_model_dir, tmp_path, name="bf16", dtype="bfloat16")
    weights = load_file(run_dir / "final" / "model.safetensors")
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.bfloat16}


@pytest.mark.parametrize("stage", ["sft", "dpo", "online"])
def test_chunked_lm_head_never_builds_full_logits(stage, tiny_model_dir, tmp_path):
    # [N, T, V] logits of whole training sequences exist on the plain path only
    with ModelCalls() as calls:
        any_run(stage, tiny_model_dir, tmp_path, name="plain", chunked_lm_head=False)
    assert calls.full_logits > 0
    with ModelCalls() as calls:
        any_run(stage, tiny_model_dir, tmp_path, name="chunked", chunked_lm_head=True)
    assert calls.full_logits == 0


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_checkpointing_turns_on_in_every_trained_layer(stage, tiny_model_dir, tmp_path):
    # transformers checkpoints a layer's forward (its recompute runs inside the layer, out of
    # reach of module hooks) when the layer's `gradient_checkpointing` flag is set
    for on in (False, True):
        with ModelCalls() as calls:
            any_run(stage, tiny_model_dir, tmp_path, name=f"gc{on}", gradient_checkpointing=on)
        flags = {layer.gradient_checkpointing for layer in calls.layers.values()}
        assert (True in flags) == on  # frozen references run no backward: not checkpointed


@pytest.mark.parametrize("stage", STAGES)
def test_lora_rank_alpha_targets_and_merge(stage, tiny_model_dir, tmp_path):
    # a LoRA run saves an adapter of rank r on the named modules only; the merged model is
    # W0 + (alpha / r) * B @ A on those modules (Hu et al. 2021, eq. 3)
    r, alpha = 2, 6.0
    steps = {"total_episodes": 8} if stage == "online" else {"max_steps": 2}
    _, run_dir = any_run(stage, tiny_model_dir, tmp_path, lr=1e-2, lora_r=r, lora_alpha=alpha,
                         lora_target_modules="c_attn", merge_lora=True, **steps)
    adapter = load_file(next((run_dir / "final").rglob("adapter_model.safetensors")))
    a_keys = [k for k in adapter if "lora_A" in k]
    assert a_keys and all(".c_attn." in k for k in a_keys)
    assert all(adapter[k].shape[0] == r for k in a_keys)
    key_a = next(k for k in a_keys if ".h.0." in k)
    delta = (alpha / r) * (adapter[key_a.replace("lora_A", "lora_B")] @ adapter[key_a])  # [out, in]
    merged = load_file(run_dir / "merged" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    layer = "h.0.attn.c_attn.weight"
    merged_w = next(v for k, v in merged.items() if k.endswith(layer))
    base_w = next(v for k, v in base.items() if k.endswith(layer))
    assert delta.abs().max() > 0
    torch.testing.assert_close(merged_w - base_w, delta.T, atol=1e-6, rtol=1e-4)  # Conv1D: [in, out]


def test_sft_lora_dropout_reaches_the_adapter(tiny_model_dir, tmp_path):
    _, run_dir = offline_run("sft", tiny_model_dir, tmp_path, lora_r=2, lora_dropout=0.25)
    config = next((run_dir / "final").rglob("adapter_config.json"))
    assert json.loads(config.read_text())["lora_dropout"] == 0.25


# ----------------------------------------------------------------------------- the reward model

def test_rm_held_out_rows_and_eval_every(tiny_model_dir, tmp_path):
    # 8 pairs, a quarter held out: 6 train in 3 steps of 2; evaluated at step 2 (every 2, not at
    # the last step, which the final evaluation covers) on 2 pairs: accuracy in {0, 1/2, 1}
    _, run_dir = offline_run("rm", tiny_model_dir, tmp_path, eval_fraction=0.25, eval_every=2,
                             max_steps=0, log_every=1)
    lines = train_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["step"] for m in lines if "eval/accuracy" in m] == [2]
    assert (final_metrics(run_dir)["eval/accuracy"] * 2) % 1 == 0


def test_rm_eval_data_is_the_held_out_set(tiny_model_dir, tmp_path):
    held = write_jsonl(tmp_path / "held.jsonl", preference_rows(3, seed=7))
    _, run_dir = offline_run("rm", tiny_model_dir, tmp_path, eval_data=str(held), max_steps=0)
    assert [m["step"] for m in train_lines(run_dir)] == [4]  # all 8 pairs train: 4 steps
    accuracy = final_metrics(run_dir)["eval/accuracy"]
    assert min(abs(accuracy * 3 - k) for k in range(4)) < 1e-9  # a count out of 3 pairs


def test_rm_normalize_data_gives_mean_0_std_1_on_those_rows(tiny_model_dir, tmp_path):
    from tether.models.reward_model import RewardModel

    rows = sft_rows(6, seed=3)
    norm = write_jsonl(tmp_path / "norm.jsonl", rows)
    result, _ = offline_run("rm", tiny_model_dir, tmp_path, normalize_data=str(norm))
    model = RewardModel.from_pretrained(str(result.output_path))
    scores = model.score_texts([r["prompt"] for r in rows], [r["response"] for r in rows])
    scores = torch.as_tensor(scores, dtype=torch.float64)
    assert scores.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert scores.std(correction=0).item() == pytest.approx(1.0, abs=1e-3)


# ----------------------------------------------------------------------------- DPO

def test_dpo_label_smoothing_by_hand(tiny_model_dir, tmp_path):
    # conservative DPO (Mitchell 2023): loss = -(1 - e) log s(m) - e log s(-m), m = beta * h the
    # logged margin; one pair per step, so step 2 (m != 0 after step 1) pins the formula
    eps = 0.3
    _, run_dir = offline_run("dpo", tiny_model_dir, tmp_path, label_smoothing=eps, batch_size=1,
                             max_steps=2, log_every=1, lr=1e-2)
    line = train_lines(run_dir)[-1]
    m = torch.tensor(line["rewards/margins"], dtype=torch.float64)
    expected = -(1 - eps) * torch.nn.functional.logsigmoid(m) - eps * torch.nn.functional.logsigmoid(-m)
    assert abs(m.item()) > 1e-3
    assert line["train/loss"] == pytest.approx(expected.item(), rel=1e-4)


def test_dpo_share_prompt_off_puts_each_response_in_its_own_row(tiny_model_dir, tmp_path):
    for share, rows in ((True, 2), (False, 4)):  # 2 pairs per step: 2 shared rows, or 4
        with ModelCalls() as calls:
            offline_run("dpo", tiny_model_dir, tmp_path, name=f"s{share}", share_prompt=share)
        assert max(shape[0] for shape in calls.token_inputs) == rows


def test_dpo_precompute_ref_logprobs_scores_the_reference_before_training(tiny_model_dir, tmp_path):
    # live reference: a no-grad forward of it in every step; precomputed: all before step 1
    for precompute in (False, True):
        grad_flags = []

        def hook(module, args, output, flags=grad_flags):
            if isinstance(module, torch.nn.Embedding) and args[0].dim() == 2 and args[0].shape[0] >= 2:
                flags.append(torch.is_grad_enabled())
        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            offline_run("dpo", tiny_model_dir, tmp_path, name=f"p{precompute}", max_steps=3,
                        precompute_ref_logprobs=precompute)
        finally:
            handle.remove()
        first_grad = grad_flags.index(True)
        late_no_grad = [flag for flag in grad_flags[first_grad:] if not flag]
        assert bool(late_no_grad) != precompute


def test_dpo_ref_model_other_than_the_policy_moves_the_first_loss_off_ln2(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # step 1 has policy == start model, so the loss is ln 2 exactly iff the reference is it too
    other = tmp_path / "other_ref"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    result, _ = offline_run("dpo", tiny_model_dir, tmp_path, ref_model=str(other))
    assert abs(result.metrics["train/loss"] - math.log(2)) > 1e-3


@pytest.mark.parametrize("stage", STAGES)
def test_threads_is_used(stage, tiny_model_dir, tmp_path):
    """--threads N sets torch's count; auto (0) gives the tiny model one thread (run/threads.py)."""
    before = torch.get_num_threads()
    try:
        any_run(stage, tiny_model_dir, tmp_path, name="two", threads=2)
        assert torch.get_num_threads() == 2
        any_run(stage, tiny_model_dir, tmp_path, name="auto", threads=0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
