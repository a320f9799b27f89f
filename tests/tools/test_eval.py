"""`tether eval` and `tether generate`, and the one evaluation helper: a policy scored offline
gives exactly the numbers PPO logs for it at step 0 (same prompt ids, EOS set, chunks, seed)."""

from __future__ import annotations

import json

import pytest

from tether.cli import main
from tether.demo import pipeline, task
from tether.demo.config import DemoConfig
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.rl.evaluation import distinct_n
from tether.tools import evaluate
from tether.tools.config import EvalConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music",
           "the actor", "loved the story but", "the scene"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def good_count(prompts, responses):
    return [float(r.count("good")) - 0.1 * len(r.split()) for r in responses]


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_task")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def reward_model_for(model_dir, out_dir):
    tokenizer = load_tokenizer(str(model_dir))
    RewardModel.from_causal_lm(str(model_dir), tokenizer).save_pretrained(out_dir, tokenizer)
    return str(out_dir)


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_demo_sft_evaluation_equals_ppo_step_zero(task_files, family, request, tmp_path,
                                                  monkeypatch):
    # The demo's own code paths, on a tiny task: one PPO batch evaluated at step 0 (the SFT
    # policy, untouched), and the demo's offline evaluation of that same SFT policy.
    model_dir = str(request.getfixturevalue(family))
    monkeypatch.setattr(task, "gold_reward", good_count)
    rm = reward_model_for(model_dir, tmp_path / "rm")
    paths = {"prompts": str(task_files / "prompts.jsonl"),
             "eval_prompts": str(task_files / "prompts.jsonl")}
    cfg = DemoConfig(output_dir=str(tmp_path), ppo_batches=1, seed=3)
    ppo_curve = pipeline.run_ppo(tmp_path, cfg, paths, model_dir, rm, "ppo-fixed", 3)
    sft_curve = pipeline.evaluate_model(model_dir, model_dir, rm, paths, "sft", cfg,
                                        tmp_path / "sft-eval" / "eval.json")
    at_zero = {k: v[0] for k, v in ppo_curve.values.items() if k.startswith("eval/")}
    offline = {k: v[0] for k, v in sft_curve.values.items()}
    assert set(at_zero) == set(offline) and "eval/kl_exact" in offline
    assert offline == at_zero  # exactly: the same ids, the same draws, the same arithmetic
    assert offline["eval/kl"] == 0.0 and offline["eval/kl_exact"] == 0.0
    assert sft_curve.samples[0] == ppo_curve.samples[0]


def test_a_different_seed_samples_differently(task_files, tiny_model_dir, tmp_path):
    # The equality above could hold vacuously if the seed did nothing; it does not.
    def run(seed):
        cfg = EvalConfig(model=str(tiny_model_dir), prompts=str(task_files / "prompts.jsonl"),
                         seed=seed, device="cpu", max_new_tokens=8)
        return evaluate.run(cfg, reward_fn=length_reward, write=False).samples
    assert run(0) == run(0) and run(0) != run(1)


@pytest.fixture(scope="module")
def trained(task_files, tiny_llama_dir):
    """A LoRA SFT adapter on the Llama-style model and a one-batch PPO run from it (full)."""
    from tether.train import ppo, sft

    root = task_files / "runs"
    data = task_files / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": " was good."}) + "\n"
                            for p in PROMPTS))
    adapter = sft.run(sft.SFTConfig(run_name="sft-lora", output_dir=str(root),
                                    model=str(tiny_llama_dir), data=str(data), lora_r=4,
                                    max_steps=2, lr=1e-2, batch_size=4, save_every=0,
                                    device="cpu")).output_path
    policy = ppo.run(ppo.PPOConfig(run_name="ppo", output_dir=str(root), policy=str(tiny_llama_dir),
                                   prompts=str(task_files / "prompts.jsonl"), batch_size=8,
                                   total_episodes=8, max_new_tokens=6, lr=1e-2, device="cpu",
                                   save_every=0, sample_every=0),
                     reward_fn=length_reward).output_path
    return {"adapter": str(adapter), "ppo": str(policy), "base": str(tiny_llama_dir)}


def eval_cli(task_files, model, *extra):
    return main(["eval", "--model", model, "--prompts", str(task_files / "prompts.jsonl"),
                 "--reward-fn", f"{__file__}:length_reward", "--gold-fn",
                 f"{__file__}:good_count", "--device", "cpu", "--max-new-tokens", "8", *extra])


@pytest.mark.parametrize("which", ["adapter", "ppo"])
def test_eval_cli_on_a_stage_output(task_files, trained, which, capsys):
    model = trained[which]
    assert eval_cli(task_files, model) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    run = task_files / "runs" / ("sft-lora" if which == "adapter" else "ppo")
    record = json.loads((run / "final.eval.json").read_text())  # beside final/, never inside
    assert not (run / "final" / "eval.json").exists()
    metrics, samples = record["metrics"], record["samples"]
    # The reference defaults to the run's starting model, read from its config.yaml.
    assert record["reference"] == trained["base"]
    assert metrics["eval/kl_exact"] > 0  # trained away from it (exact KL is never negative)
    # Every metric recomputed from the samples by hand: the same numbers.
    responses = [s["response"] for s in samples]
    assert [s["prompt"] for s in samples] == PROMPTS
    assert metrics["eval/score"] == pytest.approx(sum(length_reward(PROMPTS, responses)) / 8)
    assert metrics["eval/gold_score"] == pytest.approx(sum(good_count(PROMPTS, responses)) / 8)
    assert metrics["eval/distinct_2"] == distinct_n(responses, 2)
    assert 1 <= metrics["eval/response_len"] <= 8 and 0 <= metrics["eval/eos_rate"] <= 1
    assert "eval/kl_exact" in out and "eval/gold_score" in out


def test_eval_against_itself_has_zero_kl(task_files, trained, tmp_path, capsys):
    out = tmp_path / "self.json"
    assert eval_cli(task_files, trained["ppo"], "--reference", trained["ppo"], "--output",
                    str(out)) == 0, capsys.readouterr().err
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["eval/kl"] == 0.0 and metrics["eval/kl_exact"] == 0.0


def test_generate_writes_samples_eval_scores_the_first(task_files, trained, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    common = ["--model", trained["ppo"], "--prompts", str(task_files / "prompts.jsonl"),
              "--device", "cpu", "--max-new-tokens", "8"]
    assert main(["generate", *common, "--samples-per-prompt", "3", "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, k) for p in PROMPTS for k in range(3)]
    assert all(1 <= r["length"] <= 8 for r in rows)
    assert len({r["response"] for r in rows}) > len(PROMPTS)  # samples differ, not copies
    # Sample 0 of each prompt is the response `tether eval` scores with the same settings.
    result = evaluate.run(EvalConfig(model=trained["ppo"], prompts=str(task_files / "prompts.jsonl"),
                                         device="cpu", max_new_tokens=8), write=False)
    assert [r["response"] for r in rows if r["sample"] == 0] == [
        s["response"] for s in result.samples]
    # Without --output the lines go to stdout.
    capsys.readouterr()
    assert main(["generate", *common]) == 0
    assert [json.loads(x)["response"] for x in capsys.readouterr().out.splitlines()] == [
        s["response"] for s in result.samples]


@pytest.mark.parametrize("args, message", [
    (["--model", "no/such/dir"], "no/such/dir"),
    (["--reward-fn", "x.py:f", "--reward-model", "rm"], "at most one proxy reward"),
    (["--temperature", "0"], "temperature"),
    (["--engine", "sglang"], "'engine' must be one of"),
    (["--engine", "vllm", "--engine-kv-cache-mb", "-5"], "'engine_kv_cache_mb' must be > 0"),
])
def test_eval_bad_input_is_one_line(task_files, tiny_model_dir, tmp_path, args, message, capsys):
    base = ["eval", "--model", str(tiny_model_dir), "--prompts", str(task_files / "prompts.jsonl"),
            "--device", "cpu", "--output", str(tmp_path / "e.json")]
    assert main(base + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err
    assert not (tmp_path / "e.json").exists()


def test_eval_with_a_lora_reward_model(task_files, trained, tmp_path, capsys):
    # The proxy from a LoRA reward model (`tether rm --lora-r`), scoring a LoRA SFT policy.
    from tether.models.reward_model import RewardModel
    from tether.train import reward

    pairs = task_files / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": " good.", "rejected": " bad."})
                             + "\n" for p in PROMPTS))
    rm_dir = reward.run(reward.RMConfig(run_name="rm-lora", output_dir=str(tmp_path),
                                        model=trained["base"], data=str(pairs), lora_r=4,
                                        max_steps=2, batch_size=4, save_every=0,
                                        eval_fraction=0.25, device="cpu")).output_path
    assert (rm_dir / "adapter_config.json").is_file()  # really an adapter
    out = tmp_path / "e.json"
    assert main(["eval", "--model", trained["adapter"], "--prompts",
                 str(task_files / "prompts.jsonl"), "--reward-model", str(rm_dir), "--device",
                 "cpu", "--max-new-tokens", "8", "--output", str(out)]) == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    scores = [s["score"] for s in record["samples"]]
    assert record["metrics"]["eval/score"] == pytest.approx(sum(scores) / len(scores))
    assert len(set(scores)) > 1 and "eval/gold_score" not in record["metrics"]
    assert RewardModel.from_pretrained(rm_dir).lora is not None


def test_gold_scores_every_chunk_of_prompts(task_files, tiny_model_dir):
    # Batches of 3 over 8 prompts: three chunks, each scored by the gold function (the gold
    # step once replaced the prompt rows still to collect by the chunk's, and the second
    # chunk found none).
    cfg = EvalConfig(model=str(tiny_model_dir), prompts=str(task_files / "prompts.jsonl"),
                     batch_size=3, device="cpu", max_new_tokens=4)
    result = evaluate.run(cfg, reward_fn=length_reward, gold_fn=good_count, write=False)
    assert [s["prompt"] for s in result.samples] == PROMPTS
    assert all(s["gold_score"] is not None for s in result.samples)
