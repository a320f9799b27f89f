"""The benchmarks' probe and verdicts: a number is only reported for a feature that really ran.

bench/scale/memory.py and bench/scale/gpu.py decide from bench/scale/memory_probe.py's observations whether LoRA
with a shared base, the chunked LM head and gradient checkpointing were active; these tests pin
those observations on models whose answer is known by construction.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale"
sys.path.insert(0, str(BENCH))

import memory  # noqa: E402
from memory_probe import NotMeasurable, Probe, parameter_census  # noqa: E402

# a module of memory.py and gpu.py, not a program: these tests are its smoke test (gpu.py's,
# through bench/scale/gpu.sh: test_bench_scale.py)
SMOKES = {"bench/scale/memory_probe.py": "test_probe_sees_lm_head_rows_and_layer_checkpoints"}


def tiny_gpt2():
    from tether.models.tiny import make_lm

    return make_lm(vocab_size=50, n_layer=1, n_embd=8, n_head=2, n_positions=16)


def test_census_counts_each_storage_once(tmp_path):
    model = tiny_gpt2()  # GPT-2 ties lm_head to wte: one storage, counted once
    n = sum(p.numel() for p in model.parameters())  # parameters() also yields a tied tensor once
    base = 4 * n
    assert parameter_census(base, [model])["base_copies"] == pytest.approx(1.0)
    # A reference that is a deep copy holds a second base...
    ref = copy.deepcopy(model).requires_grad_(False)
    both = parameter_census(base, [model, ref])
    assert both["base_copies"] == pytest.approx(2.0)
    assert both["trainable_params"] == n  # only the policy trains
    # ...a second module over the same tensors (adapter disabled, shared trunk) does not.
    wrapper = nn.ModuleDict({"trunk": model.transformer})
    assert parameter_census(base, [model, wrapper])["base_copies"] == pytest.approx(1.0)


def test_probe_sees_lm_head_rows_and_layer_checkpoints():
    original = torch.utils.checkpoint.checkpoint
    probe = Probe(vocab_size=50, base_params=1).install()
    try:
        head, other = nn.Linear(8, 50), nn.Linear(8, 49)
        with torch.no_grad():
            head(torch.zeros(3, 5, 8))  # a [B, R, V] logits tensor: 15 rows of V
            head(torch.zeros(2, 8))
            other(torch.zeros(100, 8))  # not the vocabulary size: ignored
        assert probe.max_logit_rows == 15

        block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # a "layer": a module with children
        x = torch.zeros(2, 8, requires_grad=True)
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=False)  # tether's chunks
        assert probe.layer_checkpoint_calls == 1
    finally:
        probe.remove()
    assert torch.utils.checkpoint.checkpoint is original  # remove() restores torch's function


def test_probe_check_aborts_at_the_first_update_forward():
    probe = Probe(vocab_size=50, base_params=1, check=lambda report: "LoRA not active").install()
    try:
        layer = nn.Linear(4, 4)
        with torch.no_grad():
            layer(torch.zeros(1, 4))  # rollout and scoring run without autograd: no census yet
        assert probe.census is None
        with pytest.raises(NotMeasurable, match="LoRA not active"):
            layer(torch.zeros(1, 4))
    finally:
        probe.remove()


SPEC = {"base_params": 1000, "minibatch": 4, "response_len": 128}
LORA_CHUNKED = memory.CONFIGS["lora_chunked"][1]


def report(trainable, copies, rows, calls=0):
    return {"trainable_params": trainable, "base_copies": copies, "max_logit_rows": rows,
            "layer_checkpoint_calls": calls, "response_len": 128}


def test_verdicts_name_the_inactive_feature():
    # Today's tether: LoRA ignored (policy + critic train: 2 bases), 4 copies, [4, R + 1, V] logits.
    problems = memory.feature_problems(LORA_CHUNKED, report(2000, 4.0, 4 * 129), SPEC)
    assert [p.split(" (")[0] for p in problems] == ["LoRA not active", "chunked LM head not active"]
    # LoRA on a shared base, log-probs through the head in chunks of 83 rows: measurable, even
    # with three rank-16 adapters left requires_grad (~6% of a GPT-2 base).
    assert memory.feature_problems(LORA_CHUNKED, report(60, 1.06, 83), SPEC) == []
    # Full fine-tuning of the policy alone (one base trains) is not LoRA.
    assert memory.feature_problems(LORA_CHUNKED, report(1000, 1.0, 83), SPEC)[0].startswith(
        "LoRA not active")
    # LoRA active but the reference or reward model holds its own base: not the shared layout.
    assert memory.feature_problems(LORA_CHUNKED, report(12, 2.0, 83), SPEC)[0].startswith(
        "base not shared")
    gc_fields = memory.CONFIGS["lora_chunked_gc"][1]
    assert memory.feature_problems(gc_fields, report(12, 1.0, 83, calls=0), SPEC, final=False) == []
    assert memory.verdict("lora_chunked_gc", report(12, 1.0, 83, calls=0), SPEC).startswith(
        "not measurable: gradient checkpointing not active")
    assert memory.verdict("lora_chunked_gc", report(12, 1.0, 83, calls=24), SPEC) == "ok"
    short = dict(report(12, 1.0, 83), response_len=97.5)  # an early EOS: unequal work, flagged
    assert "mean response length 97.5" in memory.verdict("lora_chunked", short, SPEC)


def test_gpu_script_needs_two_dpo_steps(capsys):
    """The first DPO step is not timed, so one step would leave nothing to take a median of."""
    import gpu

    with pytest.raises(SystemExit) as exit_:
        gpu.parse(["--dpo-steps", "1"])
    assert exit_.value.code == 2
    assert "--dpo-steps 1: the first step is not timed" in capsys.readouterr().err
    assert gpu.parse(["--dpo-steps", "2"]).dpo_steps == 2
