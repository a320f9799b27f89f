"""Moving references (--ref-update; tether.rl.anchor, docs/ppo.md "Moving references").

Independent truth: a reference that never moves (ema:0, mix:0,N, reset past the run's end) trains
bit for bit as the frozen one; one reset to the policy after every batch has a KL of exactly 0 to
it at the next batch's start (the same weights score the same tokens); the mix equals TRL's
formula on the same tensors; reset:N is, bit for bit, a run stopped after N batches whose
checkpointed reference is overwritten by hand with its policy and then resumed; a resumed run
anchors where the uninterrupted one did.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tether.choices import RefUpdate
from tether.cli import main
from tether.errors import TetherError
from tether.rl.anchor import Anchor, mix
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_update")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def config(env, model_dir, name, cls=PPOConfig, **overrides):
    values = dict(run_name=name, output_dir=str(env / "runs"), policy=str(model_dir),
                  prompts=str(env / "prompts.jsonl"), batch_size=8, total_episodes=8 * 4,
                  max_new_tokens=5, lr=3e-3, device="cpu", save_every=0, sample_every=0,
                  beta=0.1)
    return cls(**(values | overrides))


def raising_on_third_call(message):
    """`length_reward` that raises `message` on its third call: a run stopped in batch 3, after
    the checkpoint of batch 2."""
    calls = {"n": 0}

    def reward(prompts, responses):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError(message)
        return length_reward(prompts, responses)
    return reward


def lines_of(env, name):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (env / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def weights(result):
    return load_file(str(result.output_path / "model.safetensors"))


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_a_reference_that_never_moves_trains_as_the_frozen_one(env, family, request):
    model_dir = request.getfixturevalue(family)
    frozen = run(config(env, model_dir, f"none-{family}"), reward_fn=length_reward)
    for spec in ("ema:0", "mix:0,2"):  # alpha 0: nothing moves, nothing more is logged
        name = f"{spec}-{family}".replace(":", "_").replace(",", "_")
        result = run(config(env, model_dir, name, ref_update=spec), reward_fn=length_reward)
        assert same(weights(frozen), weights(result)), spec
        assert lines_of(env, f"none-{family}") == lines_of(env, name), spec
    # reset past the run's end: the same weights; the KL to the start is logged, and it is the
    # KL to the anchor, which is still the start
    name = f"reset_far-{family}"
    result = run(config(env, model_dir, name, ref_update="reset:100"), reward_fn=length_reward)
    assert same(weights(frozen), weights(result))
    for line in lines_of(env, name):
        assert line["objective/kl_sft"] == pytest.approx(line["objective/kl_k1"], rel=1e-5, abs=1e-7)


def test_a_reference_reset_after_every_batch_starts_each_batch_at_kl_zero(env, tiny_model_dir):
    for spec in ("reset:1", "mix:1,1"):
        name = spec.replace(":", "_").replace(",", "_")
        run(config(env, tiny_model_dir, name, ref_update=spec), reward_fn=length_reward)
        lines = lines_of(env, name)
        # after batch 1 the reference is the policy that samples batch 2: the same weights score
        # the same tokens, so every KL to the anchor is exactly 0 from batch 2 on (the first
        # batch's is 0 too: the reference starts as the policy)
        assert all(line["objective/kl_k1"] == 0.0 and line["objective/kl_exact"] == 0.0
                   for line in lines), name
        # while the policy has moved away from the SFT model
        assert lines[-1]["objective/kl_sft_exact"] > 1e-4, name


def test_mix_is_trls_formula_on_the_same_tensors():
    gen = torch.Generator().manual_seed(0)
    policy, reference = nn.Linear(5, 3), nn.Linear(5, 3)
    for p in (*policy.parameters(), *reference.parameters()):
        p.data = torch.randn(p.shape, generator=gen)
    expected = {name: r.detach().clone().mul_(1 - 0.3).add_(dict(policy.named_parameters())[name]
                                                            .detach(), alpha=0.3)
                for name, r in reference.named_parameters()}  # TRL's SyncRefModelCallback
    exact = {name: 0.3 * dict(policy.named_parameters())[name].double() + 0.7 * r.double()
             for name, r in reference.named_parameters()}
    mix(dict(reference.named_parameters()), dict(policy.named_parameters()), 0.3)
    for name, r in reference.named_parameters():
        assert torch.equal(r, expected[name])
        torch.testing.assert_close(r.double(), exact[name], rtol=0, atol=1e-6)
    mix(dict(reference.named_parameters()), dict(policy.named_parameters()), 1.0)  # a reset copies
    assert all(torch.equal(r, p) for r, p in zip(reference.parameters(), policy.parameters()))


def test_schedule_and_the_optimizer_reset():
    assert [RefUpdate.parse("mix:0.5,3").alpha_after(b) for b in range(1, 7)] == \
        [None, None, 0.5, None, None, 0.5]
    assert RefUpdate.parse("ema:0.25").alpha_after(7) == 0.25
    assert RefUpdate.parse("reset:2").alpha_after(4) == 1.0
    assert RefUpdate.parse("ema:0").alpha_after(1) is None and not RefUpdate.parse("ema:0").moves
    model = nn.Linear(2, 2)
    for reset in (False, True):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        pairs = (dict(nn.Linear(2, 2).named_parameters()), dict(model.named_parameters()))
        anchor = Anchor(lambda pairs=pairs: pairs, None, RefUpdate.parse("reset:1"), reset)
        anchor.after_batch(1, optimizer)
        assert bool(optimizer.state) is not reset  # AdamW's moments cleared only when asked


def test_a_resumed_run_anchors_where_the_uninterrupted_one_did(env, tiny_model_dir):
    common = dict(total_episodes=8 * 4, save_every=1, ref_update="ema:0.5")
    full = run(config(env, tiny_model_dir, "ema-full", **common), reward_fn=length_reward)
    crashes_on_third_batch = raising_on_third_call("reward server went away")
    with pytest.raises(TetherError, match="reward server went away"):
        run(config(env, tiny_model_dir, "ema-resumed", **common), reward_fn=crashes_on_third_batch)
    resumed = run(config(env, tiny_model_dir, "ema-resumed", resume=True, **common),
                  reward_fn=length_reward)
    assert same(weights(full), weights(resumed))

    def unnamed(lines):  # the first two lines name the crashing function's reward/<name>
        return [{k: v for k, v in line.items() if not k.startswith("reward/")} for line in lines]
    assert unnamed(lines_of(env, "ema-full")) == unnamed(lines_of(env, "ema-resumed"))


def test_reset_is_a_run_stopped_and_continued_with_its_policy_as_the_reference(env, tiny_model_dir):
    # The definition of reset:N, built by hand: a run whose reference never moves
    # (reset past its end, so its checkpoints hold the reference) stops after 2 batches; its
    # checkpoint's reference tensors are overwritten with the policy's own, and the run goes on
    # (same seeds, optimizer kept). That must be, bit for bit, the run with reset:2.
    from safetensors.torch import save_file
    common = dict(total_episodes=8 * 4, save_every=1)
    reset = run(config(env, tiny_model_dir, "reset2", ref_update="reset:2", **common),
                reward_fn=length_reward)
    stops_at_third_batch = raising_on_third_call("stopped after two batches")
    by_hand = config(env, tiny_model_dir, "by-hand", ref_update="reset:1000", **common)
    with pytest.raises(TetherError, match="stopped after two batches"):
        run(by_hand, reward_fn=stops_at_third_batch)
    step = env / "runs" / "by-hand" / "checkpoints" / "step_2"
    policy, extra = load_file(str(step / "policy.safetensors")), load_file(str(step / "tensors.safetensors"))
    anchored = {k for k in extra if k.startswith("anchor/")}
    assert anchored == {"anchor/" + k for k in policy}  # the whole policy, under its names
    assert any(not torch.equal(extra["anchor/" + k], policy[k]) for k in policy)  # still the SFT
    save_file(extra | {"anchor/" + k: v for k, v in policy.items()}, str(step / "tensors.safetensors"))
    continued = run(config(env, tiny_model_dir, "by-hand", ref_update="reset:1000", resume=True,
                           **common), reward_fn=length_reward)
    assert same(weights(reset), weights(continued))
    assert lines_of(env, "reset2")[2:] == lines_of(env, "by-hand")[2:]  # batches 3 and 4
    # and the reset was real: the KL to the anchor restarts at 0, the exact KL to the start does not
    assert lines_of(env, "reset2")[2]["objective/kl_k1"] == 0.0
    assert lines_of(env, "reset2")[2]["objective/kl_sft_exact"] > 1e-4


def test_ref_update_refuses_bad_input_in_one_line(env, tiny_model_dir, capsys):
    base = ["grpo", "--policy", str(tiny_model_dir), "--prompts", str(env / "prompts.jsonl"),
            "--reward-fn", "rewards.py:f", "--output-dir", str(env / "bad"), "--device", "cpu"]
    cases = [
        (["--ref-update", "reset"], "is not one of none, reset:N, mix:ALPHA,N, ema:ALPHA"),
        (["--ref-update", "mix:0.5"], "is not one of"),
        (["--ref-update", "mix:1.5,2"], "ALPHA must lie in [0, 1]"),
        (["--ref-update", "reset:0"], "N be at least 1 batch"),
        (["--ref-update", "ema:0.1", "--teacher", str(tiny_model_dir)], "a teacher does not move"),
        (["--ref-update", "ema:0.1", "--lora-r", "4"], "use reset:N"),
        (["--ref-update", "ema:0.1", "--ref-model", str(tiny_model_dir)], "--ref-model"),
        (["--ref-reset-optimizer"], "pass --ref-update reset:N"),
    ]
    for extra, says in cases:
        capsys.readouterr()
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], (extra, err)
    assert not (env / "bad").exists()


def test_grpo_with_a_moving_reference_logs_both_kls(env, tiny_llama_dir):
    run(config(env, tiny_llama_dir, "grpo-mix", cls=GRPOConfig, ref_update="mix:0.5,2"),
        reward_fn=length_reward)
    lines = lines_of(env, "grpo-mix")
    assert all("objective/kl_sft" in line and "objective/kl_sft_exact" in line for line in lines)
    # the anchor moved halfway toward the policy after batch 2: from then on the KL to it is
    # smaller than the KL to the start
    assert lines[-1]["objective/kl_exact"] < lines[-1]["objective/kl_sft_exact"]


def test_evaluations_log_the_kl_to_the_sft_model_beside_the_anchor(env, tiny_model_dir):
    run(config(env, tiny_model_dir, "eval-reset", ref_update="reset:1",
               eval_prompts=str(env / "prompts.jsonl"), eval_every=2), reward_fn=length_reward)
    evals = [line for line in lines_of(env, "eval-reset") if "eval/score" in line]
    assert [line["step"] for line in evals] == [0, 2, 4]
    # step 0: the anchor is the SFT model, both KLs are the same (0: the policy is the start)
    assert evals[0]["eval/kl_sft_exact"] == evals[0]["eval/kl_exact"] == 0.0
    # later the anchor is the policy after the last batch, which is what evaluates: KL 0 to it,
    # while the KL to the SFT model has grown
    assert evals[-1]["eval/kl_exact"] == 0.0 and evals[-1]["eval/kl_sft_exact"] > 1e-4


def test_max_kl_can_cap_the_kl_to_the_sft_model(env, tiny_model_dir):
    # reset after every batch: the KL to the anchor is 0 at every batch, the KL to the SFT model
    # grows; --max-kl-to sft stops the run on the second, --max-kl alone never does
    common = dict(ref_update="reset:1", lr=1e-2, total_episodes=8 * 4)
    run(config(env, tiny_model_dir, "cap-anchor", max_kl=1e-4, **common), reward_fn=length_reward)
    grown = [line["objective/kl_sft"] for line in lines_of(env, "cap-anchor")]
    assert max(grown) > 1e-4  # the ceiling is crossed by the KL to the SFT model
    with pytest.raises(TetherError, match=r"the KL to the SFT model is .* past --max-kl 0\.0001 "
                                          r"\(--max-kl-to sft\)"):
        run(config(env, tiny_model_dir, "cap-sft", max_kl=1e-4, max_kl_to="sft", **common),
            reward_fn=length_reward)


def test_ref_reset_optimizer_clears_adams_state_at_each_reset(env, tiny_model_dir):
    # the same run with and without --ref-reset-optimizer: the batches after the first reset
    # start AdamW from fresh moments in one and not the other, so the weights part
    common = dict(ref_update="reset:2", total_episodes=8 * 4)
    kept = run(config(env, tiny_model_dir, "adam-kept", **common), reward_fn=length_reward)
    cleared = run(config(env, tiny_model_dir, "adam-cleared", ref_reset_optimizer=True, **common),
                  reward_fn=length_reward)
    assert not same(weights(kept), weights(cleared))
    # up to the first reset (after batch 2) the two runs are the same run
    assert lines_of(env, "adam-kept")[:2] == lines_of(env, "adam-cleared")[:2]


@pytest.mark.parametrize("spec", ["reset:1", "reset:100"])
def test_a_lora_reference_resets_as_an_adapter_of_its_own(env, tiny_llama_dir, spec):
    # LoRA: the moving reference is an adapter of its own on the shared base (a copy of the
    # trained one, zero at the start, as the base is), the start the bare base. reset:1: every
    # KL to the anchor is exactly 0 (the reference is the policy that samples); reset past the
    # end: the frozen run's weights and, the anchor being the start, kl_sft equal to kl.
    name = f"lora-{spec}".replace(":", "_")
    lora = dict(lora_r=4, lr=1e-2)
    result = run(config(env, tiny_llama_dir, name, ref_update=spec, **lora), reward_fn=length_reward)
    lines = lines_of(env, name)
    if spec == "reset:1":
        assert all(line["objective/kl_k1"] == 0.0 and line["objective/kl_exact"] == 0.0
                   for line in lines)
        assert lines[-1]["objective/kl_sft_exact"] > 1e-4
        return
    frozen = run(config(env, tiny_llama_dir, "lora-frozen", **lora), reward_fn=length_reward)
    adapter = "adapter_model.safetensors"
    assert same(load_file(str(frozen.output_path / adapter)),
                load_file(str(result.output_path / adapter)))
    for line in lines:
        assert line["objective/kl_sft"] == pytest.approx(line["objective/kl_k1"], rel=1e-5, abs=1e-7)
    # the anchor adapter is not saved with the policy's
    assert not any("anchor" in key for key in load_file(str(result.output_path / adapter)))
