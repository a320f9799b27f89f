"""bench/peers/grpo.py: tether's side runs end to end on a tiny setting, and the TRL side is configured
to do the same work (checked only where TRL 1.16 is installed: the bench's own venv)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(BENCH))

import grpo  # noqa: E402

SMOKES = {"bench/peers/grpo.py": "test_tether_side_runs_both_methods_and_reports_them"}


def test_tether_side_runs_both_methods_and_reports_them():
    try:
        lines = grpo.main(["--no-trl", "--episodes", "8", "--batch-size", "8",
                           "--response-length", "4", "--repeats", "1",
                           "--threads", "0"])  # 0: leave this process's torch threads alone
    finally:
        logging.disable(logging.NOTSET)  # the bench silences logging for its whole process
    rows = {line.split()[1]: line.split()[2:] for line in lines[2:]}
    assert list(rows) == ["rloo", "grpo"]
    for episodes_per_s, ratio, per_cpu_s, cpu_ratio, _, length in rows.values():
        assert float(episodes_per_s) > 0 and float(per_cpu_s) > 0
        assert ratio == cpu_ratio == "-"  # no TRL run, no ratio
        assert 1.0 <= float(length) <= 4.0  # the run's own metrics: 1 to 4 tokens per response


def test_unshared_side_runs_and_restores_prompt_sharing():
    import tether.models.forward as shared_prompt

    prompt_groups = shared_prompt.prompt_groups
    try:
        lines = grpo.main(["--no-trl", "--unshared", "--methods", "grpo", "--episodes", "8",
                           "--batch-size", "8", "--response-length", "4", "--repeats", "1",
                           "--prompt-words", "12-16", "--threads", "0", "--profile"])
    finally:
        logging.disable(logging.NOTSET)
    assert "prompts of 12-16 words" in lines[0]
    names = [line[:22].strip() for line in lines[2:4]]  # the row label column
    assert names == ["tether grpo", "tether grpo unshared"]
    profiled = re.fullmatch(r"profile tether grpo: matmuls ([\d.]+) s of ([\d.]+) s profiled "
                            r"\(\d+%\); fp32 matmul peak here \d+ GFLOP/s", lines[4])
    assert profiled and 0 < float(profiled[1]) < float(profiled[2])
    assert shared_prompt.prompt_groups is prompt_groups  # the patch is undone after the run


def test_prompt_words_must_leave_room_for_the_response():
    with pytest.raises(SystemExit):
        grpo.parse_args(["--prompt-words", "90-100"])  # 100 + 32 > the policy's 128 positions


def test_methods_keep_their_conventional_tether_settings(tmp_path):
    args = grpo.parse_args([])
    rloo = grpo.tether_config("rloo", tmp_path, tmp_path, tmp_path / "p.jsonl", tmp_path, args)
    grpo_cfg = grpo.tether_config("grpo", tmp_path, tmp_path, tmp_path / "p.jsonl", tmp_path, args)
    for cfg in (rloo, grpo_cfg):
        assert (cfg.samples_per_prompt, cfg.ppo_epochs, cfg.num_minibatches) == (4, 1, 1)
        assert cfg.prompts_per_batch == 8 and cfg.n_batches == 8
    assert (rloo.advantage, rloo.kl_in, rloo.resolved_kl_estimator, rloo.beta) == (
        "rloo", "reward", "k1", 0.05)
    assert (grpo_cfg.advantage, grpo_cfg.kl_in, grpo_cfg.resolved_kl_estimator, grpo_cfg.beta) == (
        "grpo", "loss", "k3_ratio", 0.04)
    assert grpo_cfg.kl_per_token_mean and grpo_cfg.scale_rewards == "group"


def test_trl_side_is_configured_like_tether(tmp_path):
    """The same work on both sides: batch, k, steps, length, sampling, optimizer, precision, and
    each method's KL settings (TRL's GRPO defaults differ: beta 0, plain k3, bf16)."""
    trl = pytest.importorskip("trl")
    if trl.__version__ != grpo.TRL_VERSION:
        pytest.skip(f"TRL {trl.__version__}, the bench needs {grpo.TRL_VERSION}")
    args = grpo.parse_args([])
    for method in grpo.METHODS:
        ours = grpo.tether_config(method, tmp_path, tmp_path, tmp_path / "p.jsonl", tmp_path, args)
        theirs = grpo.trl_config(method, tmp_path, args)
        assert theirs.per_device_train_batch_size * theirs.max_steps == ours.total_episodes
        assert (theirs.generation_batch_size, theirs.num_generations) == (
            ours.batch_size, ours.samples_per_prompt)
        assert theirs.num_iterations == ours.ppo_epochs and theirs.steps_per_generation == 1
        assert theirs.max_completion_length == ours.max_new_tokens
        assert (theirs.temperature, theirs.top_k, theirs.top_p) == (ours.temperature, 0, 1.0)
        assert (theirs.learning_rate, theirs.lr_scheduler_type.value) == (ours.lr, "linear")
        assert theirs.max_grad_norm == ours.max_grad_norm
        assert not (theirs.bf16 or theirs.fp16 or theirs.activation_checkpointing)
        assert theirs.disable_dropout and theirs.beta == ours.beta
    grpo_trl = grpo.trl_config("grpo", tmp_path, args)
    assert grpo_trl.use_bias_correction_kl  # k3 x ratio, tether's k3_ratio
    assert (grpo_trl.loss_type, grpo_trl.scale_rewards) == ("dapo", "group")  # token mean
