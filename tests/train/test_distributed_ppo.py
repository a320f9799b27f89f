"""The online loop (ppo, rloo, grpo) under torchrun with 2 gloo processes equals the 1-process run
of the same config: final weights within 1e-5, the same beta sequence, the same metrics; with
DDP and FSDP2, full fine-tuning and the LoRA shared base, GPT-2 and Llama-style; and a 2-process
checkpoint resumes on 1 process.

Independent truth: the 1-process loop (train/ppo.py without any collective), run in this
process. Each config moves the weights by far more than the tolerance (checked), so a rank that
updated on the wrong rows, a loss divided by a per-rank count, or a missing gradient reduction
shows up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_distill import make_teacher
from torchrun_helpers import ROOT, torchrun

from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.run.distributed import Dist
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig, RLOOConfig
from tether.train.ppo_setup import check_world

pytestmark = [pytest.mark.slow, pytest.mark.across_processes]

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music",
           "the actor"]
REWARDS = "def length_reward(prompts, responses):\n    return [len(r) / 10.0 for r in responses]\n"
# Two values only: many groups score alike, so --dynamic-sampling refills batches.
REWARDS += "def coarse_reward(prompts, responses):\n    return [float(len(r) % 3 == 0) for r in responses]\n"
# An environment whose episodes last 1, 2 or 3 turns by prompt (a turn ends at a vowel: the tiny
# untrained model writes bytes, and a turn cut by its budget would end the episode): the
# ranks' episodes end at different turns, and every rank must keep sampling while any has a live
# one (FSDP2 gathers the layers in every rank's sampling call together).
REWARDS += """
class Turns:
    def reset(self, row, seed):
        self.turn, self.turns = 0, 1 + len(row["prompt"]) % 3
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        done = self.turn == self.turns
        return (None if done else " and then"), len(action) / 10.0, done
"""
CONFIGS = {"ppo": PPOConfig, "rloo": RLOOConfig, "grpo": GRPOConfig}
# A different computation (tests/processes.py): the ranks reduce each gradient as two halves, so
# its sums round otherwise than the one process's, by a few FLOAT32_EPS relative. Adam normalises
# each step to at most ~lr per weight, so the runs drift apart by about eps x |weight| per step
# and more where a gradient's second moment sits near Adam's epsilon: 1e-5 is ~80 float32
# roundings of a weight of magnitude 1 over these runs of 2-3 batches of 1-4 steps, and every
# config moves the weights by more than 30 times it (checked), so a real difference shows.
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_ppo")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARDS)
    return root


def base_args(env: Path, model_dir: Path, name: str) -> dict[str, object]:
    # lr 3e-4: Adam moves every weight by ~lr a step (far past the tolerance) while the float
    # noise between batch shapes, which Adam amplifies on tiny gradients, stays well inside it.
    return {"policy": str(model_dir), "prompts": str(env / "prompts.jsonl"),
            "reward_fn": f"{env / 'rewards.py'}:length_reward", "batch_size": 8,
            "total_episodes": 24, "max_new_tokens": 6, "lr": 3e-4, "device": "cpu",
            "save_every": 0, "sample_every": 0, "output_dir": str(env / "runs"), "run_name": name}


def torchrun_driver(specs: list[dict], spec_path: Path, nproc: int = 2
                    ) -> subprocess.CompletedProcess:
    """Every config of `specs` in turn in one torchrun launch (tests/dist_driver.py)."""
    spec_path.write_text(json.dumps(specs))
    return torchrun([str(ROOT / "tests" / "dist_driver.py"), str(spec_path)], timeout=600,
                    nproc=nproc)


def one_process(stage: str, values: dict[str, object]):
    values = {k: v for k, v in values.items() if k != "fsdp"}
    return run(CONFIGS[stage](**values))


def final_weights(run_dir: Path) -> dict:
    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_config.json").exists() \
        else "model.safetensors"
    return load_file(str(final / name))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_weights(model_dir: Path, lora: bool) -> dict | None:
    return None if lora else load_file(str(model_dir / "model.safetensors"))


def assert_same_run(one: Path, two: Path, start: dict | None) -> None:
    w1, w2 = final_weights(one), final_weights(two)
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert worst < WEIGHT_ATOL, worst
    # The run really moved the weights (LoRA: B starts at 0, so the adapter itself is the move).
    # (The tokenizer's added pad token grows the embeddings: those are compared where they fit.)
    moved = max(float((w1[k] - start[k] if start else w1[k]).abs().max()) for k in w1
                if not start or (k in start and start[k].shape == w1[k].shape))
    assert moved > 30 * WEIGHT_ATOL, moved
    m1, m2 = metrics(one), metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2]
    # The adaptive controller's error is clipped at every batch of these configs (a tiny KL
    # target), so beta is a function of the batch count alone and must agree bit for bit; every
    # rank checked its beta against rank 0's each batch (tether.rl.roles.check_same_beta).
    assert [m.get("objective/beta") for m in m1] == [m.get("objective/beta") for m in m2]
    # The gradient norm too: Adam's step does not change when every gradient is scaled alike
    # (a loss divided by a per-rank count, a missing grad_scale), the norm does.
    keys = ("objective/kl", "objective/score", "policy/entropy", "policy/loss", "value/loss",
            "policy/grad_norm",
            "rollout/response_len", "policy/updates", "policy/approx_kl", "eval/score", "eval/kl",
            "eval/entropy", "eval/response_len", "rollout/varied_groups", "rollout/dynamic_rounds",
            "policy/skipped_minibatches", "env/turns", "env/action_tokens",
            "env/observation_tokens", "objective/kl_exact", "objective/kl_sft",
            "objective/kl_sft_exact", "objective/kl_loss")
    for a, b in zip(m1, m2, strict=True):
        assert a.keys() == b.keys()
        for key in keys:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


CASES = {
    # stage, model, extra config
    "ppo-gae-gpt2-ddp-full": ("ppo", "gpt2", {"num_minibatches": 2, "ppo_epochs": 2,
                                              "micro_batch_size": 2, "score_norm": "running"}),
    "ppo-gae-gpt2-fsdp-lora-shared": ("ppo", "gpt2", {"fsdp": True, "lora_r": 4,
                                                      "num_minibatches": 2, "ppo_epochs": 2}),
    "rloo-llama-fsdp-lora": ("rloo", "llama", {"fsdp": True, "lora_r": 4,
                                               "samples_per_prompt": 2}),
    # --target-kl stops every rank's epochs at the same minibatch (the approx KL is global);
    # the evaluation runs on every rank, rank 0 logs it.
    "grpo-llama-ddp-full": ("grpo", "llama", {"samples_per_prompt": 4, "num_minibatches": 2,
                                              "ppo_epochs": 2, "target_kl": 1e-7,
                                              "eval_every": 2, "eval_prompts": "PROMPTS"}),
    # DAPO's batch options: every rank keeps the same groups, the same rows leave the loss.
    "grpo-gpt2-ddp-dapo": ("grpo", "gpt2", {"samples_per_prompt": 2, "dynamic_sampling": 2,
                                            "mask_truncated": True, "loss_aggregation": "sequence",
                                            "num_minibatches": 2, "reward_fn": "COARSE",
                                            # some responses end at an "a" (a stop string), the rest run out
                                            "stop_strings": ["a"]}),
    # Episodes of several turns, sharded, on a LoRA adapter: lock-step turns, rows of each
    # rank's own width.
    # Anchors beyond the SFT model: a teacher scored on every rank (sharded under FSDP2 with the
    # start the metrics compare with), and a reference every rank moves alike.
    "grpo-gpt2-ddp-teacher-exact": ("grpo", "gpt2", {"teacher": "TEACHER", "kl_estimator": "exact",
                                                     "samples_per_prompt": 2}),
    "rloo-llama-fsdp-teacher": ("rloo", "llama", {"fsdp": True, "teacher": "TEACHER",
                                                  "samples_per_prompt": 2}),
    "ppo-gpt2-ddp-ema": ("ppo", "gpt2", {"ref_update": "ema:0.5"}),
    "ppo-gpt2-fsdp-mix": ("ppo", "gpt2", {"fsdp": True, "ref_update": "mix:0.5,2", "save_every": 2}),
    "grpo-llama-fsdp-lora-reset": ("grpo", "llama", {"fsdp": True, "lora_r": 4,
                                                     "samples_per_prompt": 2,
                                                     "ref_update": "reset:1"}),
    "grpo-llama-fsdp-lora-env": ("grpo", "llama", {"fsdp": True, "lora_r": 4,
                                                   "samples_per_prompt": 2, "env": "ENV",
                                                   "max_turns": 3,
                                                   "stop_strings": ["a", "e", "o"]}),
}
# A 3-batch run that checkpoints at batches 2 and 3, resumed on 1 process from batch 2.
# FSDP2: the checkpoint's weights and optimizer state are gathered from shards. A reward model
# (sharded under FSDP2 like the reference) scores, and the critic starts from it.
RESUME = ("ppo", "gpt2", {"save_every": 2, "score_norm": "running", "num_minibatches": 2,
                          "fsdp": True, "reward_model": "RM"})


# A LoRA run on the Llama-style model saved by 1 process at batch 2 and finished by 2 (FSDP2).
RESUME_BACK = ("ppo", "llama", {"save_every": 2, "score_norm": "running", "num_minibatches": 2,
                                "lora_r": 4})


def case_config(env: Path, model_dir: Path, name: str, stage: str, extra: dict) -> dict:
    values = base_args(env, model_dir, name) | extra
    if values.get("eval_prompts") == "PROMPTS":
        values["eval_prompts"] = values["prompts"]
    if values.get("reward_fn") == "COARSE":
        values["reward_fn"] = f"{env / 'rewards.py'}:coarse_reward"
    if values.get("env") == "ENV":
        values |= {"env": f"{env / 'rewards.py'}:Turns", "reward_fn": ""}
    if values.get("teacher") == "TEACHER":  # built by two_process_runs for each model
        values["teacher"] = str(env / f"teacher-{model_dir.name}")
    if values.get("reward_model") == "RM":
        values |= {"reward_model": str(env / "rm"), "reward_fn": ""}
    if stage == "ppo":  # adaptive beta, its error clipped each batch: beta moves every batch
        values |= {"kl_ctl": "adaptive", "kl_target": 1e-4, "kl_horizon": 100}
    return values


@pytest.fixture(scope="module")
def two_process_runs(env, tiny_model_dir, tiny_llama_dir):
    """Every case's 2-process run, and the first part of the resumed run, in one launch."""
    dirs = {"gpt2": tiny_model_dir, "llama": tiny_llama_dir}
    for model_dir in dirs.values():  # the teachers of the TEACHER cases (test_distill's)
        make_teacher(str(model_dir), env / f"teacher-{model_dir.name}")
    tokenizer = load_tokenizer(str(tiny_model_dir))  # an untrained reward model on GPT-2
    RewardModel.from_causal_lm(str(tiny_model_dir), tokenizer).save_pretrained(env / "rm",
                                                                               tokenizer)
    specs = [{"stage": stage, "config": case_config(env, dirs[model], f"{case}-2", stage, extra)}
             for case, (stage, model, extra) in CASES.items()]
    stage, model, extra = RESUME
    specs.append({"stage": stage,
                  "config": case_config(env, dirs[model], "resume", stage, extra)})
    # The other way: 1 process runs RESUME_BACK cut off after batch 2, 2 processes finish it.
    stage, model, extra = RESUME_BACK
    back = case_config(env, dirs[model], "resume-back", stage, extra)
    one_process(stage, back)
    shutil.rmtree(env / "runs" / "resume-back" / "final")
    shutil.rmtree(env / "runs" / "resume-back" / "checkpoints" / "step_3")
    specs.append({"stage": stage, "config": back | {"resume": True, "fsdp": True,
                                                   "resume_allow_changes": True}})
    result = torchrun_driver(specs, env / "spec.json")
    assert result.returncode == 0, result.stderr[-4000:]
    return dirs


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(env, two_process_runs, case):
    stage, model, extra = CASES[case]
    model_dir = two_process_runs[model]
    one_process(stage, case_config(env, model_dir, f"{case}-1", stage, extra))
    runs = env / "runs"
    assert_same_run(runs / f"{case}-1", runs / f"{case}-2",
                    start_weights(model_dir, bool(extra.get("lora_r"))))
    if stage == "ppo":
        betas = [m["objective/beta"] for m in metrics(runs / f"{case}-2")]
        assert len(set(betas)) == len(betas)  # it did move
    if "target_kl" in extra:  # each batch: the on-policy first minibatch's step, then the guard
        lines = [m for m in metrics(runs / f"{case}-2") if "policy/updates" in m]
        assert [m["policy/updates"] for m in lines] == [1.0] * 3
        assert all(m["policy/early_stopped"] == 1.0 for m in lines)
    if case == "grpo-gpt2-ddp-dapo":  # the refill ran: some round-0 groups were all equal
        lines = metrics(runs / f"{case}-2")
        assert any(m["rollout/equal_groups_first"] > 0 for m in lines)
        assert any(m["rollout/dynamic_rounds"] > 0 for m in lines)
    if extra.get("env"):  # the episodes went on past their first turn, and not all alike
        turns = [m["env/turns"] for m in metrics(runs / f"{case}-2")]
        assert max(turns) > 1 and all(t < 3 for t in turns), turns
    if extra.get("ref_update"):  # the anchor moved alike on every rank, toward the policy
        lines = metrics(runs / f"{case}-2")
        assert lines[-1]["objective/kl_exact"] < lines[-1]["objective/kl_sft_exact"]
        if extra["ref_update"] == "reset:1":  # the policy that samples is the anchor: KL 0
            assert all(m["objective/kl_k1"] == 0.0 for m in lines)
    if stage == "rloo":  # one epoch of one minibatch: each rank updates the rows it scored
        assert all(m["policy/approx_kl"] == 0.0 and m["policy/ratio_mean"] == 1.0
                   for m in metrics(runs / f"{case}-2"))


def test_two_process_checkpoint_resumes_on_one(env, two_process_runs):
    # 2 processes ran 3 batches and saved after batches 2 and 3; without its final model and
    # last checkpoint the run looks cut off after batch 2, and 1 process resumes it there with the
    # same config: the result is the uninterrupted 1-process run's.
    stage, model, extra = RESUME
    model_dir = two_process_runs[model]
    run_dir = env / "runs" / "resume"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]
    shutil.rmtree(run_dir / "final")
    shutil.rmtree(run_dir / "checkpoints" / "step_3")
    values = case_config(env, model_dir, "resume", stage, extra)
    one_process(stage, values | {"resume": True, "resume_allow_changes": True})  # fsdp: off
    one_process(stage, values | {"run_name": "resume-ref"})
    assert_same_run(env / "runs" / "resume-ref", run_dir, start_weights(model_dir, lora=False))


def test_a_batch_the_ranks_cannot_split_is_refused():
    # 6 rows in groups of 2 over 2 ranks: 3 rows each, not whole groups. A minibatch of 8 rows
    # over 2 ranks with micro-batches of 3: 4 rows each, not whole micro-batches.
    two = Dist(rank=1, world_size=2)
    rloo = PPOConfig(policy="p", prompts="p", advantage="rloo", batch_size=6,
                     samples_per_prompt=2)
    with pytest.raises(TetherError, match="must split over 2 processes in whole groups"):
        check_world(rloo, two)
    micro = PPOConfig(policy="p", prompts="p", batch_size=8, micro_batch_size=3)
    with pytest.raises(TetherError, match="whole micro-batches of --micro-batch-size 3"):
        check_world(micro, two)
    check_world(PPOConfig(policy="p", prompts="p", batch_size=8, micro_batch_size=2), two)
    check_world(rloo, Dist())  # one process: anything the config accepts


def test_one_process_checkpoint_resumes_on_two(env, two_process_runs):
    stage, model, extra = RESUME_BACK
    model_dir = two_process_runs[model]
    one_process(stage, case_config(env, model_dir, "resume-back-ref", stage, extra))
    assert_same_run(env / "runs" / "resume-back-ref", env / "runs" / "resume-back", None)
