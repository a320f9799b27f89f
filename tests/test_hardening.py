"""Hardening: options that must not be silently ignored, guards that stop a run going wrong,
Ctrl-C / SIGTERM that stop with a checkpoint and resume bit-identically, and bad inputs that
used to pass silently or with a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from processes import pinned_threads, same_settings_env
from safetensors.torch import load_file

from tether.cli import main
from tether.errors import TetherError
from tether.rl.reward.functions import call_reward_function
from tether.train import dpo
from tether.train.ppo import PPOConfig, run

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def _ppo_cfg(tmp_path, model_dir, name, **kw):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                  prompts=str(prompts), batch_size=4, total_episodes=8, max_new_tokens=3,
                  lr=1e-3, device="cpu", save_every=0, sample_every=0)
    return PPOConfig(**(values | kw))


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- options that act

def test_missing_eos_penalty_is_applied(tiny_model_dir, tmp_path):
    """The first batch's rlhf_reward is the mean shaped score (KL is exactly 0 there): 0 for a
    zero reward, and -P per response that did not end, with --missing-eos-penalty P."""
    def zero(prompts, responses):
        return [0.0] * len(responses)

    results = {}
    for penalty in (0.0, 5.0):
        run(_ppo_cfg(tmp_path, tiny_model_dir, f"eos{penalty}", missing_eos_penalty=penalty),
            reward_fn=zero)
        first = _lines(tmp_path / "runs" / f"eos{penalty}" / "metrics.jsonl")[0]
        results[penalty] = first
    unended = 1.0 - results[5.0]["rollout/eos_rate"]
    assert unended > 0  # 3 tokens from an untrained model: most responses do not end
    assert results[0.0]["objective/rlhf_reward"] == 0.0
    assert results[5.0]["objective/rlhf_reward"] == pytest.approx(-5.0 * unended)
    assert results[5.0]["objective/score"] == 0.0  # the raw score is logged unpenalised


def test_ipo_gets_the_response_lengths(tiny_model_dir, tmp_path, monkeypatch):
    """IPO averages each log-ratio over its response's tokens (Azar et al. 2023): the stage must
    pass the true lengths to dpo_loss, which otherwise silently sums."""
    rows = preference_rows(8)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    seen = []
    real = dpo.dpo_loss

    def spy(*args, **kwargs):
        seen.append((kwargs.get("loss_type"), kwargs.get("chosen_lengths"),
                     kwargs.get("rejected_lengths")))
        return real(*args, **kwargs)
    monkeypatch.setattr(dpo, "dpo_loss", spy)
    assert main(["dpo", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "i",
                 "--output-dir", str(tmp_path / "runs"), "--batch-size", "8", "--max-steps", "1",
                 "--loss", "ipo", "--device", "cpu"]) == 0
    loss_type, chosen, rejected = seen[0]
    assert loss_type == "ipo" and chosen is not None and rejected is not None
    from tether.data.encoding import encode_preferences
    from tether.models.pretrained import load_tokenizer

    examples, _ = encode_preferences(load_tokenizer(str(tiny_model_dir)), rows, 512)
    order = dpo.batch_order(len(examples), 8, 0, 0)
    expected = sorted(len(examples[i].responses[0]) for i in order)
    assert sorted(chosen.tolist()) == expected


# ----------------------------------------------------------------------------- guards

def test_collapse_is_warned_and_max_kl_stops_the_run(tiny_model_dir, tmp_path, capsys):
    """--lr 1.0 blows the policy up within a few batches: one loud warning, the metric, and
    --max-kl stops the run with one line naming the KL, the batch and beta."""
    def likes_long(prompts, responses):
        return [float(len(r)) for r in responses]

    cfg = _ppo_cfg(tmp_path, tiny_model_dir, "boom", lr=1.0, total_episodes=40,
                   max_new_tokens=8, max_kl=10.0, save_every=1)
    with pytest.raises(TetherError, match=r"batch \d+: the KL to the reference is .* past "
                                          r"--max-kl 10, at beta 0.05"):
        run(cfg, reward_fn=likes_long)
    err = capsys.readouterr().err
    lines = _lines(tmp_path / "runs" / "boom" / "metrics.jsonl")
    assert lines[-1]["objective/kl"] > 10.0 and lines[-1]["policy/collapsed"] == 1.0
    assert lines[0]["policy/collapsed"] == 0.0  # the SFT policy at batch 1 is healthy
    assert err.count("the policy is collapsing") == 1
    assert err.count("the KL to the reference is growing fast") == 1  # and the blow-up, once
    assert not (tmp_path / "runs" / "boom" / "final").exists()
    # The checkpoints before the batch that crossed the ceiling are kept.
    assert (tmp_path / "runs" / "boom" / "checkpoints").exists()


def test_non_finite_loss_is_one_line_and_saves_nothing(tiny_model_dir, tmp_path, capsys):
    """--lr 1e6 turns the weights into inf/NaN within steps: one line, exit 2, no NaN model or
    checkpoint on disk."""
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(16))
    code = main(["rm", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "nan",
                 "--output-dir", str(tmp_path / "runs"), "--batch-size", "4", "--max-steps", "6",
                 "--lr", "1e6", "--max-grad-norm", "0", "--save-every", "1", "--device", "cpu"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert code == 2 and len(err) == 1
    assert "non-finite" in err[0] or "is nan" in err[0] or "is inf" in err[0]
    run_dir = tmp_path / "runs" / "nan"
    assert not (run_dir / "final").exists()
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        for tensor in load_file(str(ckpt / "model.safetensors")).values():
            assert torch.isfinite(tensor).all()


# ----------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("returned, message", [
    ({"a": 1.0, "b": 2.0}, "returned dict"),
    (["1.5", "2.0"], "not a list of numbers"),
    ("12", "returned str"),
])
def test_reward_function_returning_keys_or_strings_is_refused(returned, message):
    with pytest.raises(TetherError, match=message):
        call_reward_function(lambda p, r: returned, ["a", "b"], ["x", "y"])


def test_model_directory_without_tokenizer_is_one_line(tiny_model_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_model_dir / name).read_bytes())
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(4))
    assert main(["sft", "--model", str(bare), "--data", str(data), "--run-name", "t",
                 "--output-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no usable tokenizer" in err[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_damaged_or_pickled_weights_are_one_line(tiny_model_dir, tmp_path, capsys, damage):
    model = tmp_path / "m"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.is_file():
            (model / path.name).write_bytes(path.read_bytes())
    weights = model / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()

        class Payload:
            def __reduce__(self):
                return (os.system, ("echo pwned",))
        torch.save({"x": Payload()}, model / "pytorch_model.bin")
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(4))
    assert main(["sft", "--model", str(model), "--data", str(data), "--run-name", "t",
                 "--output-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load a causal LM")
    assert ("safe loader refuses" in lines[0]) == (damage == "pickle")
    assert "pwned" not in err.out
    assert not (tmp_path / "runs" / "t").exists()


def test_dpo_reference_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path, capsys):
    from conftest import sample_texts

    from tether.models.tiny import save_tiny

    other = save_tiny(tmp_path / "other", sample_texts(seed=9), vocab_size=280)
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(4))
    assert main(["dpo", "--model", str(tiny_model_dir), "--ref-model", str(other), "--data",
                 str(data), "--run-name", "v", "--output-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reference model's tokenizer has a different vocabulary" in err[0]
    assert not (tmp_path / "runs" / "v").exists()


# ----------------------------------------------------------------------------- Ctrl-C / SIGTERM

def _sft_argv(model, data, out, name, *extra):
    return ["sft", "--model", str(model), "--data", str(data), "--run-name", name,
            "--output-dir", str(out), "--batch-size", "4", "--max-steps", "300", "--lr", "1e-3",
            "--save-every", "1000", "--device", "cpu", "--seed", "1", *pinned_threads(), *extra]


@pytest.mark.slow
@pytest.mark.across_processes  # the same computation: the child's threads pinned to this one's
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_with_a_checkpoint_and_resumes_bit_identically(tiny_model_dir, tmp_path,
                                                                    signum):
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(32))
    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli",
                             *_sft_argv(tiny_model_dir, data, out, "cut")],
                            stderr=subprocess.PIPE, text=True, env=same_settings_env())
    progress_lines = 0
    for line in proc.stderr:  # wait for a few progress lines: the loop is running
        progress_lines += "step " in line
        if progress_lines == 2:
            proc.send_signal(signum)
            break
    err = proc.stderr.read()
    code = proc.wait(timeout=120)
    assert code == 128 + signum
    final_lines = [x for x in err.splitlines() if x.startswith("interrupted")]
    assert len(final_lines) == 1 and "continue with --resume" in final_lines[0]
    ckpts = sorted((out / "cut" / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and not (out / "cut" / "final").exists()
    # Resume, and compare with a run that was never interrupted.
    time.sleep(0.1)
    assert main([*_sft_argv(tiny_model_dir, data, out, "cut"), "--resume"]) == 0
    assert main(_sft_argv(tiny_model_dir, data, out, "whole")) == 0
    a = load_file(str(out / "cut" / "final" / "model.safetensors"))
    b = load_file(str(out / "whole" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_resumed_before_its_first_checkpoint_logs_step_zero_once(tiny_model_dir, tmp_path,
                                                                      capsys):
    eval_prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    cfg = dict(eval_prompts=str(eval_prompts), eval_every=1, save_every=5)

    calls = []

    def dies(prompts, responses):  # scores the step-0 evaluation, then dies in batch 1
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("reward server went away")
        return [0.0] * len(responses)

    with pytest.raises(TetherError, match="reward server went away"):
        run(_ppo_cfg(tmp_path, tiny_model_dir, "early", **cfg), reward_fn=dies)
    metrics = tmp_path / "runs" / "early" / "metrics.jsonl"
    assert [m["step"] for m in _lines(metrics)] == [0]  # the step-0 evaluation was logged
    capsys.readouterr()
    run(_ppo_cfg(tmp_path, tiny_model_dir, "early", resume=True, **cfg),
        reward_fn=lambda prompts, responses: [0.0] * len(responses))
    assert "no checkpoint in" in capsys.readouterr().err
    assert [m["step"] for m in _lines(metrics)] == [0, 1, 2]


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS"])
def test_a_full_disk_or_read_only_directory_is_one_line(tiny_model_dir, tmp_path, monkeypatch,
                                                        capsys, code):
    import errno

    from tether.train import offline

    def no_room(root, step, *args, **kwargs):
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(root / f"step_{step}"))
    monkeypatch.setattr(offline, "save_checkpoint", no_room)
    data = write_jsonl(tmp_path / "s.jsonl", sft_rows(8))
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "d",
                 "--output-dir", str(tmp_path / "runs"), "--max-steps", "3", "--batch-size", "4",
                 "--save-every", "1", "--device", "cpu"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert len(err) == 1 and os.strerror(getattr(errno, code)) in err[0]
    assert "free space or choose a writable --output-dir" in err[0]
