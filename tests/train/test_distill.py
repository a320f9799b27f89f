"""On-policy distillation: `tether distill` and `--teacher` on the online stages (docs/ppo.md,
"On-policy distillation"). The teacher is the KL's anchor in place of the frozen SFT model; the
student samples and the loss pulls its next-token distribution toward the teacher's.

Independent truth: the KL from the student to the teacher measured here from the two saved
models' full logits (not from tether's metrics), a padded teacher whose first rows are the SFT
model's (its KL to the start is then exactly 0), and bit-identity with a run without --teacher
when the teacher is the SFT model itself. The bandit fixed points are in
tests/train/test_online_fixed_points.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.cli import main
from tether.errors import TetherError
from tether.train import ppo
from tether.train.ppo_config import DistillConfig, GRPOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def make_teacher(model_dir, out_dir, seed=0, scale=4.0, extra_rows=0):
    """The model at `model_dir` with seeded noise on every weight (a different next-token
    distribution over the same tokenizer), `extra_rows` untrained rows padded past its
    vocabulary, saved with the same tokenizer files."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    if extra_rows:
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + extra_rows)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def kl_to(student_dir, teacher_dir, prompts=PROMPTS) -> float:
    """Mean over the prompts' positions of KL(student || teacher) over the student's vocabulary,
    from the saved models' logits (float64)."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            s_logits, t_logits = student(input_ids=ids).logits[0], teacher(input_ids=ids).logits[0]
            rows = min(s_logits.shape[-1], t_logits.shape[-1])  # the tokenizer's, and a pad row
            p = torch.log_softmax(s_logits[:, :rows].double(), -1)
            q = torch.log_softmax(t_logits[:, :rows].double(), -1)
            total += float((p.exp() * (p - q)).sum())
            count += ids.shape[1]
    return total / count


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def settings(tmp_path, name, **overrides):
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), prompts=str(prompts_file(tmp_path)),
                  batch_size=8, total_episodes=8 * 6, max_new_tokens=6, lr=3e-3, device="cpu",
                  save_every=0, sample_every=0, report_to="none")
    return values | overrides


def metrics(tmp_path, name):
    path = tmp_path / "runs" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("estimator", ["exact", "forward", "jsd"])
def test_distill_moves_the_student_toward_the_teacher(arch, estimator, tiny_model_dir, tiny_llama_dir,
                                                      tmp_path):
    # No task reward: the divergence to the teacher is the whole loss, so after a few batches
    # the student's KL to the teacher (measured here from both models' logits) must have fallen
    # well below the SFT model's.
    model_dir = str(tiny_model_dir if arch == "gpt2" else tiny_llama_dir)
    teacher = make_teacher(model_dir, tmp_path / "teacher")
    name = f"{arch}-{estimator}"
    result = ppo.run(DistillConfig(**settings(tmp_path, name, policy=model_dir,
                                              teacher=str(teacher), kl_estimator=estimator)))
    before, after = kl_to(model_dir, teacher), kl_to(result.output_path, teacher)
    assert before > 0.05 and after < 0.8 * before, (before, after)
    lines = metrics(tmp_path, name)
    assert all(line["objective/kl_loss"] >= 0 for line in lines)
    assert lines[0]["objective/kl_exact"] > lines[-1]["objective/kl_exact"]


def test_jsd_beta_reaches_the_loss(tiny_model_dir, tmp_path):
    # One batch, one step: the loss term is computed on the very policy that sampled, so with
    # --jsd-beta 1 (the reverse KL, as GKD defines the end) it equals the logged exact KL to the
    # teacher (both per-sequence sums averaged over sequences) up to float rounding between the
    # scoring and the update's passes, and with --jsd-beta 0 (the forward KL) it does not.
    teacher = make_teacher(str(tiny_model_dir), tmp_path / "teacher")
    lines = {}
    for jsd_beta in (0.0, 1.0):
        name = f"jsd-{jsd_beta}"
        ppo.run(DistillConfig(**settings(tmp_path, name, policy=str(tiny_model_dir),
                                         teacher=str(teacher), kl_estimator="jsd",
                                         jsd_beta=jsd_beta, total_episodes=8)))
        lines[jsd_beta] = metrics(tmp_path, name)[0]
    reverse, forward = lines[1.0], lines[0.0]
    assert reverse["objective/kl_loss"] == pytest.approx(reverse["objective/kl_exact"], rel=1e-5)
    assert forward["objective/kl_exact"] == reverse["objective/kl_exact"]  # the same samples
    # the forward KL differs from the reverse by far more than the rounding allowed above
    assert forward["objective/kl_loss"] != pytest.approx(forward["objective/kl_exact"], rel=1e-3)


def test_a_padded_teacher_is_cut_to_the_student_s_vocabulary(tiny_model_dir, tmp_path):
    # The SFT model itself with 16 untrained rows padded past its vocabulary: cut to the student's
    # rows, its distribution over the tokenizer's tokens is the student's start, so the first
    # batch's sampled KL is 0 within float32 rounding (the padded head is a matmul of another
    # shape, whose blocking may round otherwise: 6e-8 seen in one order of the suite); the exact
    # KL differs only by the pad row's mass (tether adds a pad row to the student, the teacher's
    # row there is HF's untrained one).
    teacher = make_teacher(str(tiny_model_dir), tmp_path / "padded", scale=0.0, extra_rows=16)
    ppo.run(DistillConfig(**settings(tmp_path, "padded", policy=str(tiny_model_dir),
                                     teacher=str(teacher), total_episodes=8)))
    first = metrics(tmp_path, "padded")[0]
    assert abs(first["objective/kl"]) < 1e-6 and abs(first["objective/kl_exact"]) < 1e-5


def test_the_sft_model_as_teacher_trains_bit_for_bit_as_without_one(tiny_llama_dir, tmp_path):
    def reward(prompts, responses):
        return [len(r) / 10 for r in responses]
    runs = {}
    for name, extra in (("plain", {}), ("teacher", {"teacher": str(tiny_llama_dir)})):
        cfg = GRPOConfig(**settings(tmp_path, name, policy=str(tiny_llama_dir), lr=1e-3, **extra))
        runs[name] = ppo.run(cfg, reward_fn=reward).output_path
    a = AutoModelForCausalLM.from_pretrained(runs["plain"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(runs["teacher"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    def untimed(name):
        return [{k: v for k, v in line.items() if not k.startswith(("time/", "perf/"))}
                for line in metrics(tmp_path, name)]
    # the teacher's run also logs the KL to the start, which is the anchor here: the same KL
    plain, teacher = untimed("plain"), untimed("teacher")
    for line in teacher:
        assert line.pop("objective/kl_sft") == pytest.approx(line["objective/kl_k1"], rel=1e-5, abs=1e-7)
        assert line.pop("objective/kl_sft_exact") == pytest.approx(line["objective/kl_exact"],
                                                                  rel=1e-5, abs=1e-7)
    assert plain == teacher


def test_distill_refuses_bad_input_in_one_line(tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "other"
    from tether.models.tiny import save_tiny
    save_tiny(other, ["zebra quantum " * 3, "xylophone jam"] * 40, vocab_size=120)
    teacher = make_teacher(str(tiny_model_dir), tmp_path / "teacher")
    classifier = tmp_path / "classifier"  # a reward model's kind, not a language model
    from transformers import AutoModelForSequenceClassification
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1
                                                       ).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(classifier)
    prompts = str(prompts_file(tmp_path))
    base = ["--policy", str(tiny_model_dir), "--prompts", prompts, "--output-dir",
            str(tmp_path / "runs"), "--device", "cpu"]
    cases = [
        (["distill", *base], "--teacher"),
        (["distill", *base, "--teacher", str(other)], "teacher's tokenizer has a different vocabulary"),
        (["distill", *base, "--teacher", str(teacher), "--jsd-beta", "1.5"], "--jsd-beta 1.5 must lie in [0, 1]"),
        (["distill", *base, "--teacher", str(classifier)], "is not a language model"),
        (["distill", *base, "--teacher", str(teacher), "--jsd-beta", "0.2"], "--jsd-beta"),
        (["distill", *base, "--teacher", str(teacher), "--ref-model", str(tiny_model_dir)], "drop --ref-model"),
        (["distill", *base, "--teacher", str(teacher), "--kl-in", "reward", "--kl-estimator", "forward"],
         "--kl-estimator forward is a loss term"),
        (["grpo", *base, "--teacher", str(teacher), "--kl-estimator", "jsd", "--kl-in", "reward"],
         "--kl-estimator jsd is a loss term"),
    ]
    for argv, says in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], (argv, err)
    assert not (tmp_path / "runs").exists()


def test_distill_s_defaults_are_on_policy_distillation():
    cfg = DistillConfig(policy="s", teacher="t", prompts="p")
    assert (cfg.kl_in, cfg.resolved_kl_estimator, cfg.beta, cfg.ppo_epochs) == ("loss", "exact", 1.0, 1)
    assert cfg.anchor == ("t", "teacher") and not cfg.uses_critic
    # the spelling, `tether distill --student S --teacher T`, is --policy's other name
    from tether.run.parse import parse_config
    for argv in (["--student", "s"], ["--student=s"], ["--policy", "s"]):
        parsed = parse_config(DistillConfig, [*argv, "--teacher", "t", "--prompts", "p"])
        assert parsed.policy.endswith("s") and parsed.teacher.endswith("t"), argv
    with pytest.raises(TetherError, match="unknown option --student"):  # distill's word only
        parse_config(GRPOConfig, ["--student", "s", "--prompts", "p"])


def test_a_teacher_needs_no_task_reward_but_a_plain_run_does(tiny_model_dir, tmp_path, capsys):
    prompts = str(prompts_file(tmp_path))
    argv = ["grpo", "--policy", str(tiny_model_dir), "--prompts", prompts, "--output-dir",
            str(tmp_path / "runs"), "--device", "cpu"]
    capsys.readouterr()
    assert main(argv) == 2
    assert "give exactly one reward" in capsys.readouterr().err


def test_a_lora_student_distills_and_its_start_is_the_base_with_its_adapter(tiny_llama_dir, tmp_path):
    # LoRA: the teacher loads apart; the start the metrics compare with is the student's own base
    # with its starting adapter (no copy of the weights), so the first batch's KL to it is 0
    teacher = make_teacher(str(tiny_llama_dir), tmp_path / "teacher")
    result = ppo.run(DistillConfig(**settings(tmp_path, "lora", policy=str(tiny_llama_dir),
                                              teacher=str(teacher), lora_r=8, lr=1e-2,
                                              merge_lora=True)))
    lines = metrics(tmp_path, "lora")
    assert lines[0]["objective/kl_sft"] == 0.0 and lines[0]["objective/kl_sft_exact"] == 0.0
    assert lines[-1]["objective/kl_exact"] < lines[0]["objective/kl_exact"]
    merged = tmp_path / "runs" / "lora" / "merged"
    assert kl_to(str(merged), teacher) < kl_to(str(tiny_llama_dir), teacher)
    assert result.output_path.exists()
