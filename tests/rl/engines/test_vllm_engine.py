"""The vLLM engine (`--engine vllm`) on these CPUs: it samples the trainer's policy, before and
after every weight sync (full weights, LoRA adapter only, merged), with tether's sampling rules,
and the online loop with it keeps its step-0 invariants and lands on the KL-regularised optimum.

The independent truth is the trainer's own recomputed log-probs (tether.models.trunk_head), its
softmax for the distribution test, and pi_ref exp(r / beta) / Z for the bandit. vLLM's CPU
attention needs a head size of 32 or more: the GPT-2 fixture has 32, the Llama-style model here
is built with hidden 128 and 4 heads (grouped-query, 2 KV heads, rotary, untied head, BOS).

These need vLLM (`pip install -e '.[vllm]'`); CI installs it and sets TETHER_REQUIRE_VLLM=1,
so there they fail instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("TETHER_REQUIRE_VLLM"):
        raise RuntimeError("TETHER_REQUIRE_VLLM is set but vllm is not installed: "
                           "pip install -e '.[vllm]'")
    pytest.skip("vllm is not installed (pip install -e '.[vllm]')", allow_module_level=True)

from conftest import sample_texts  # noqa: E402
from offline_fixtures import sft_rows, write_jsonl  # noqa: E402
from torchrun_helpers import torchrun  # noqa: E402

from tether.cli import main  # noqa: E402
from tether.models.lora import LoraSpec  # noqa: E402
from tether.models.prepare import disable_dropout, fuse_gelu  # noqa: E402
from tether.models.pretrained import load_tokenizer, load_trainable_lm  # noqa: E402
from tether.models.tiny import save_tiny_llama  # noqa: E402
from tether.models.trunk_head import score_responses  # noqa: E402
from tether.rl.engines.vllm_engine import EngineOptions, VLLMEngine  # noqa: E402
from tether.rl.rollout import left_pad, sampling_uniforms  # noqa: E402
from tether.run.distributed import current  # noqa: E402
from tether.train.ppo import run  # noqa: E402
from tether.train.ppo_config import GRPOConfig, PPOConfig  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = 1e-4  # fp32 on CPU: engine and trainer agree to ~1e-5 per token


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama128"), sample_texts(), vocab_size=300,
                           hidden_size=128, n_head=4)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_prompts")
    return write_jsonl(root / "prompts.jsonl", [{"prompt": r["prompt"]} for r in sft_rows(16)])


def prepared(model_dir, lora: LoraSpec | None = None):
    """The policy as the online loop prepares it, and its tokenizer."""
    tokenizer = load_tokenizer(str(model_dir))
    lm = load_trainable_lm(str(model_dir), tokenizer, lora)
    disable_dropout(lm.model)
    fuse_gelu(lm.model)
    lm.model.eval()
    return lm, tokenizer


def engine_on(lm, **kwargs) -> VLLMEngine:
    return VLLMEngine(lm.model, lm.peft, EngineOptions(64, "float32", 96, 0), current(), CPU,
                      **kwargs)


def prompt_batch(tokenizer, n: int = 6):
    texts = [r["prompt"] for r in sft_rows(n, seed=5)]
    return left_pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id, "cpu")


def sample(engine, tokenizer, ids, mask, temperature=0.8, max_new_tokens=12, seed=3, eos=None):
    return engine.sample(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                         eos_token_ids=eos or [tokenizer.eos_token_id],
                         pad_token_id=tokenizer.pad_token_id,
                         uniforms=sampling_uniforms(seed, len(ids), max_new_tokens))


def engine_vs_trainer(model, rollout) -> float:
    """max |engine log-prob - trainer log-prob| over the sampled tokens."""
    scores = score_responses(model, rollout.input_ids, rollout.attention_mask,
                             rollout.context_length, rollout.temperature, chunked=False)
    return ((scores.logprobs - rollout.engine_logprobs).abs() * rollout.response_mask).max().item()


def perturb(model, scale: float = 0.2, trainable_only: bool = False) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not trainable_only:
                p.add_(torch.randn(p.shape, generator=g) * scale)


# ----------------------------------------------------------------------------- the engine alone

@pytest.mark.parametrize("family", ["tiny_model_dir", "llama_dir"])
def test_engine_samples_the_trainers_weights_before_and_after_a_sync(family, request):
    lm, tokenizer = prepared(request.getfixturevalue(family))
    engine = engine_on(lm)
    try:
        ids, mask = prompt_batch(tokenizer)
        for temperature in (1.0, 0.7):
            rollout = sample(engine, tokenizer, ids, mask, temperature)
            assert engine_vs_trainer(lm.model, rollout) < TOLERANCE
        perturb(lm.model)
        stale = sample(engine, tokenizer, ids, mask)
        assert engine_vs_trainer(lm.model, stale) > 0.1  # what a missed sync looks like
        engine.sync()
        assert engine_vs_trainer(lm.model, sample(engine, tokenizer, ids, mask)) < TOLERANCE
    finally:
        engine.close()


def test_eos_set_padding_and_seeds_carry_over(tiny_model_dir):
    lm, tokenizer = prepared(tiny_model_dir)
    engine = engine_on(lm)
    try:
        ids, mask = prompt_batch(tokenizer, 8)
        # A second EOS id: the model's most likely next token after the first prompt, so some
        # responses end on it. The model's own EOS is not the engine's unless tether lists it.
        second = int(lm.model(ids[:1], attention_mask=mask[:1]).logits[0, -1].argmax())
        eos = [tokenizer.eos_token_id, second]
        rollout = sample(engine, tokenizer, ids, mask, eos=eos, max_new_tokens=10)
        ended_on = 0
        for row in range(len(rollout)):
            length = int(rollout.response_mask[row].sum())
            tokens = rollout.responses[row].tolist()
            stops = [i for i, t in enumerate(tokens[:length]) if t in eos]
            # each response ends at its first EOS (kept) or at max_new_tokens, then pads
            assert stops in ([], [length - 1])
            assert bool(rollout.ended[row]) == bool(stops) and (stops or length == 10)
            assert tokens[length:] == [tokenizer.pad_token_id] * (len(tokens) - length)
            ended_on += bool(stops) and tokens[length - 1] == second
        assert ended_on > 0
        # A row's tokens depend on its own noise, not on the batch it is sampled in.
        first, second_half = (sample(engine, tokenizer, ids[:3], mask[:3], eos=eos),
                              sample(engine, tokenizer, ids, mask, eos=eos))
        width = first.responses.shape[1]
        assert torch.equal(first.responses, second_half.responses[:3, :width])
    finally:
        engine.close()


def chi_square_quantile(df: int, z: float = 3.719) -> float:
    """The upper 1e-4 quantile of chi^2(df), Wilson-Hilferty (z: the normal's 1e-4 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic with tokens of expected count < 5 pooled into one bin."""
    expected = probs * n
    big = expected >= 5
    observed, expected = counts[big], expected[big]
    if not bool(big.all()):
        observed = torch.cat([observed, counts[~big].sum()[None]])
        expected = torch.cat([expected, (probs * n)[~big].sum()[None]])
    return float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_distribution_is_the_trainers_softmax(tiny_model_dir, temperature):
    lm, tokenizer = prepared(tiny_model_dir)
    with torch.no_grad():  # logits 8x larger: a peaked softmax, in which T matters
        lm.model.transformer.ln_f.weight.mul_(8.0)
        lm.model.transformer.ln_f.bias.mul_(8.0)
    engine = engine_on(lm)
    try:
        prompt = tokenizer("the cat sat on")["input_ids"]
        n = 4000
        ids, mask = left_pad([prompt] * n, tokenizer.pad_token_id, "cpu")
        rollout = sample(engine, tokenizer, ids, mask, temperature, max_new_tokens=1, seed=11)
        counts = torch.bincount(rollout.responses[:, 0], minlength=len(tokenizer)).double()
        with torch.no_grad():
            logits = lm.model(torch.tensor([prompt])).logits[0, -1].double()
        stat, df = chi_square(counts, torch.softmax(logits / temperature, -1), n)
        assert df >= 10 and stat < chi_square_quantile(df), (stat, df)
        # the test can tell temperatures apart: the other one's softmax is rejected
        other = 0.7 if temperature == 1.0 else 1.0
        wrong, wrong_df = chi_square(counts, torch.softmax(logits / other, -1), n)
        assert wrong > chi_square_quantile(wrong_df), (wrong, wrong_df)
    finally:
        engine.close()


def test_lora_adapter_sync_and_merged_serving_follow_the_trainers_adapter(llama_dir):
    lm, tokenizer = prepared(llama_dir, LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear"))
    ids, mask = prompt_batch(tokenizer)
    adapter = engine_on(lm)
    assert adapter.lora_mode == "adapter"
    try:
        assert engine_vs_trainer(lm.model, sample(adapter, tokenizer, ids, mask)) < TOLERANCE
        perturb(lm.model, 0.3, trainable_only=True)  # the adapter moves; the base does not
        stale = sample(adapter, tokenizer, ids, mask)
        assert engine_vs_trainer(lm.model, stale) > 0.1
        adapter.sync()  # the adapter's tensors only
        after = sample(adapter, tokenizer, ids, mask)
        assert engine_vs_trainer(lm.model, after) < TOLERANCE
    finally:
        adapter.close()
    merged = engine_on(lm, lora_mode="merged")
    try:
        again = sample(merged, tokenizer, ids, mask)
        assert engine_vs_trainer(lm.model, again) < TOLERANCE
        # same weights, same per-row seeds: the two ways of serving draw the same tokens
        assert torch.equal(again.responses, after.responses)
    finally:
        merged.close()


# ----------------------------------------------------------------------------- the loop with it

def length_reward(prompts, responses):
    return [float(len(r.split())) for r in responses]


def metrics_of(result_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (result_dir / "metrics.jsonl").read_text().splitlines()]


def grpo_run(model_dir, prompts, tmp_path, name, **overrides) -> list[dict]:
    """A GRPO run with the engine on 16-response batches (lr 5e-2, constant); its metric lines."""
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                  prompts=str(prompts), max_new_tokens=8, batch_size=16, total_episodes=16 * 5,
                  lr=5e-2, lr_schedule="constant", engine="vllm", device="cpu", save_every=0,
                  sample_every=0, seed=1) | overrides
    return metrics_of(Path(run(GRPOConfig(**values), reward_fn=length_reward).output_path).parent)


def lora_sft(model_dir: Path, out: Path) -> Path:
    """A LoRA SFT adapter trained away from its base (the run's starting point and reference)."""
    data = write_jsonl(out / "sft.jsonl", sft_rows())
    assert main(["sft", "--model", str(model_dir), "--data", str(data), "--run-name", "sft",
                 "--output-dir", str(out), "--device", "cpu", "--max-steps", "3",
                 "--batch-size", "4", "--lora-r", "4", "--lr", "1e-2"]) == 0
    return out / "sft" / "final"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_model_dir", "llama_dir"])
@pytest.mark.parametrize("start", ["base", "lora_sft"])
def test_grpo_with_the_engine_starts_on_policy_and_tracks_every_update(family, start, prompts,
                                                                        request, tmp_path):
    model_dir = request.getfixturevalue(family)
    policy = lora_sft(model_dir, tmp_path) if start == "lora_sft" else model_dir
    lines = grpo_run(policy, prompts, tmp_path, "g")
    # Step 0: the policy is the reference (the SFT adapter itself when starting from one, never
    # the bare base) and pi_old, and the engine serves that same model.
    assert lines[0]["objective/kl"] == 0.0 and lines[0]["policy/ratio_mean"] == 1.0
    # Every later batch: the engine still samples the trainer's policy while it moves away.
    assert max(x["rollout/engine_kl"] for x in lines) < 1e-6
    assert max(x["rollout/engine_max_logprob_diff"] for x in lines) < TOLERANCE
    assert lines[-1]["objective/kl"] > 0.05, [x["objective/kl"] for x in lines]


@pytest.mark.slow
def test_dynamic_sampling_keeps_the_engines_logprobs_with_their_tokens(tiny_model_dir, prompts,
                                                                       tmp_path):
    # A refilled batch joins rows of several engine rounds re-padded to one layout: each row's
    # engine log-probs must still sit on its tokens, or rollout/engine_kl would show it.
    def coarse(prompts, responses):  # two values: many groups score alike and are refilled
        return [float(len(r) % 3 == 0) for r in responses]
    values = dict(run_name="dynamic", output_dir=str(tmp_path / "runs"), policy=str(tiny_model_dir),
                  prompts=str(prompts), max_new_tokens=8, batch_size=8, samples_per_prompt=2,
                  total_episodes=8 * 3, lr=5e-2, engine="vllm", device="cpu", save_every=0,
                  sample_every=0, dynamic_sampling=3, mask_truncated=True)
    lines = metrics_of(Path(run(GRPOConfig(**values), reward_fn=coarse).output_path).parent)
    assert any(x["rollout/dynamic_rounds"] > 0 for x in lines)
    assert max(x["rollout/engine_kl"] for x in lines) < 1e-6
    assert max(x["rollout/engine_max_logprob_diff"] for x in lines) < TOLERANCE


class Hints:
    """Three turns; between them a hint that depends on the seed (context the policy reads)."""

    def reset(self, row, seed):
        self.turn, self.seed = 0, seed
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        hint = [" warmer", " colder", " the plot"][(self.seed + self.turn) % 3]
        return hint, len(action) / 10.0, self.turn == 3


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_model_dir", "llama_dir"])
def test_episodes_keep_the_engines_logprobs_on_the_policys_own_tokens(family, prompts, request,
                                                                      tmp_path):
    # Turn by turn the engine samples from contexts that hold its own earlier tokens and the
    # environment's: its log-probs must sit on the sampled tokens of every turn (the
    # observations have none), so the engine KL stays at float noise while the policy moves.
    lines = metrics_of(Path(run(GRPOConfig(
        run_name="episodes", output_dir=str(tmp_path / "runs"),
        policy=str(request.getfixturevalue(family)), prompts=str(prompts), max_new_tokens=6,
        batch_size=8, samples_per_prompt=2, total_episodes=8 * 4, lr=5e-2, engine="vllm",
        device="cpu", save_every=0, sample_every=0, max_turns=3, stop_strings=["a", "e", "o"]),
        env=Hints).output_path).parent)
    assert max(x["env/turns"] for x in lines) > 1.5
    assert max(x["rollout/engine_kl"] for x in lines) < 1e-6
    assert max(x["rollout/engine_max_logprob_diff"] for x in lines) < TOLERANCE
    assert lines[-1]["objective/kl"] > 0.01, [x["objective/kl"] for x in lines]


@pytest.mark.slow
def test_a_stale_engine_shows_in_the_engine_kl(tiny_model_dir, prompts, tmp_path, monkeypatch):
    real = VLLMEngine.sync  # the first push only: never synced after an update
    monkeypatch.setattr(VLLMEngine, "sync", lambda self: real(self) if self.version == 0 else None)
    lines = grpo_run(tiny_model_dir, prompts, tmp_path, "stale")
    assert lines[0]["rollout/engine_kl"] < 1e-6
    assert lines[-1]["rollout/engine_kl"] > 1e-3, [x["rollout/engine_kl"] for x in lines]


@pytest.mark.slow
def test_ppo_with_the_engine_lands_on_the_kl_regularised_optimum(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    # the bandit of tests/train/test_ppo_optimum.py, with the engine
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "train"))
    from test_ppo_optimum import PROMPT, TABLE, next_token_probs, optimum, table_reward, tv
    from transformers import AutoModelForCausalLM

    from tether.models.pretrained import load_causal_lm

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    decoded = [tokenizer.decode([i], skip_special_tokens=True) for i in range(len(tokenizer))]
    rewards = torch.tensor([TABLE.get(text, 0.0) for text in decoded], dtype=torch.float64)
    ref_probs = next_token_probs(load_causal_lm(str(tiny_model_dir), tokenizer).eval(), tokenizer)
    target = optimum(ref_probs, rewards, 1.0)
    assert tv(target, ref_probs) > 0.25
    cfg = PPOConfig(run_name="bandit", output_dir=str(tmp_path / "runs"),
                    policy=str(tiny_model_dir), prompts=str(tmp_path / "prompts.jsonl"),
                    max_new_tokens=1, batch_size=128, total_episodes=128 * 60, ppo_epochs=2,
                    lr=3e-3, lr_schedule="linear", max_grad_norm=0.0, kl_ctl="fixed", beta=1.0,
                    device="cpu", save_every=0, sample_every=0, engine="vllm")
    result = run(cfg, reward_fn=table_reward)
    policy = AutoModelForCausalLM.from_pretrained(result.output_path).eval()
    probs = next_token_probs(policy, tokenizer)
    assert tv(probs, target) < 0.05, (tv(probs, target), tv(probs, ref_probs))


@pytest.mark.slow
def test_two_ranks_engines_each_follow_the_policy(tiny_model_dir, prompts, tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def length(prompts, responses):\n"
                           "    return [float(len(r.split())) for r in responses]\n")
    config = dict(run_name="ddp", output_dir=str(tmp_path / "runs"), policy=str(tiny_model_dir),
                  prompts=str(prompts), reward_fn=f"{reward_file}:length", max_new_tokens=8,
                  batch_size=16, total_episodes=16 * 4, lr=5e-2, lr_schedule="constant",
                  engine="vllm", device="cpu", save_every=0, sample_every=0, seed=1)
    spec = tmp_path / "spec.json"
    # DDP, then FSDP2 (each sync gathers the shards whole) in the same launch
    spec.write_text(json.dumps([{"stage": "grpo", "config": config},
                                {"stage": "grpo", "config": config | {"run_name": "fsdp",
                                                                      "fsdp": True}}]))
    root = Path(__file__).resolve().parents[2]
    done = torchrun([str(root / "dist_driver.py"), str(spec)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("ddp", "fsdp"):
        lines = metrics_of(tmp_path / "runs" / name)
        # The gathered batch holds both ranks' rows: a rank whose engine missed an update
        # would show as engine_kl > 0 in every batch after it.
        assert len(lines) == 4 and lines[-1]["objective/kl"] > 0.05, name
        assert max(x["rollout/engine_kl"] for x in lines) < 1e-6, name


# ----------------------------------------------------------------------------- the tools

def test_generate_and_eval_with_the_engine(tiny_model_dir, prompts, tmp_path, capsys):
    out = tmp_path / "generated.jsonl"
    assert main(["generate", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--engine", "vllm", "--samples-per-prompt", "2", "--max-new-tokens", "6",
                 "--stop-strings", ".", "--output", str(out), "--device", "cpu"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 32 and [r["sample"] for r in rows[:4]] == [0, 1, 0, 1]
    for row in rows:  # a stop string ends the response, kept in it
        assert "." not in row["response"] or row["response"].rstrip().endswith(".")
        assert row["length"] <= 6
    eval_out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--engine", "vllm", "--reference", str(tiny_model_dir), "--output",
                 str(eval_out), "--device", "cpu"]) == 0
    metrics = json.loads(eval_out.read_text())["metrics"]
    # the policy is its own reference: both KLs vanish, on whatever the engine sampled
    assert abs(metrics["eval/kl"]) < 1e-5 and abs(metrics["eval/kl_exact"]) < 1e-5
    assert metrics["eval/response_len"] > 1


# ----------------------------------------------------------------------------- the options

class StartSpy:
    """Records each engine start's KV size and the size vLLM itself was given."""

    def __init__(self, monkeypatch):
        from tether.rl.engines import vllm_engine

        self.sizes: list[tuple[int, int]] = []
        real = vllm_engine.VLLMEngine.__init__

        def spy(engine, model, peft, options, *args, **kwargs):
            real(engine, model, peft, options, *args, **kwargs)
            cache = engine.llm.llm_engine.vllm_config.cache_config
            self.sizes.append((options.kv_cache_mb, cache.kv_cache_memory_bytes))
        monkeypatch.setattr(vllm_engine.VLLMEngine, "__init__", spy)


@pytest.mark.parametrize("tool", ["grpo", "generate", "eval", "bon", "interpolate"])
def test_engine_and_its_kv_cache_size_reach_vllm(tool, tiny_model_dir, prompts, tmp_path,
                                                  monkeypatch):
    spy = StartSpy(monkeypatch)
    common = ["--engine", "vllm", "--engine-kv-cache-mb", "48", "--device", "cpu",
              "--max-new-tokens", "4"]
    if tool == "grpo":
        argv = ["grpo", "--policy", str(tiny_model_dir), "--prompts", str(prompts),
                "--reward-fn", f"{Path(__file__).resolve()}:length_reward", "--batch-size", "8",
                "--total-episodes", "8", "--output-dir", str(tmp_path), "--save-every", "0"]
    elif tool == "interpolate":  # the line from the model to itself: each point's engine
        argv = [tool, "--from", str(tiny_model_dir), "--to", str(tiny_model_dir), "--points",
                "0,1", "--output-dir", str(tmp_path / "line"), "--prompts", str(prompts)]
    else:
        argv = [tool, "--model", str(tiny_model_dir), "--prompts", str(prompts), "--output",
                str(tmp_path / f"out.{'jsonl' if tool == 'generate' else 'json'}"),
                *(["--n", "2", "--reward-fn", f"{Path(__file__).resolve()}:length_reward"]
                  if tool == "bon" else [])]
    assert main(argv + common) == 0
    assert spy.sizes == [(48, 48 << 20)] * (2 if tool == "interpolate" else 1)


def offset_engine_logprobs(monkeypatch, offset: float) -> None:
    """The engine reports log-probs `offset` away from its true ones, as an engine with other
    kernels would: pi_old / pi_engine = exp(-offset) at every token."""
    real = VLLMEngine.sample

    def sample(self, *args, **kwargs):
        rollout = real(self, *args, **kwargs)
        rollout.engine_logprobs = (rollout.engine_logprobs + offset) * rollout.response_mask
        return rollout
    monkeypatch.setattr(VLLMEngine, "sample", sample)


def corrected_run(model_dir, prompts, tmp_path, name, **overrides) -> list[dict]:
    return grpo_run(model_dir, prompts, tmp_path, name, max_new_tokens=6, total_episodes=16 * 2,
                    seed=2, **overrides)


@pytest.mark.slow
def test_truncated_importance_weights_and_row_masking_act_on_the_update(tiny_model_dir, prompts,
                                                                         tmp_path, monkeypatch):
    offset_engine_logprobs(monkeypatch, -0.5)  # every ratio pi_old / pi_engine = e^0.5 = 1.65
    capped = corrected_run(tiny_model_dir, prompts, tmp_path, "capped", engine_is_cap=1.2)
    assert capped[0]["rollout/engine_is_weight"] == pytest.approx(1.2)  # every token at the cap
    assert capped[0]["rollout/engine_is_truncated"] == 1.0
    assert capped[0]["rollout/engine_masked_rows"] == 0.0
    # each row's summed k3 is (e^0.5 - 1.5) = 0.149 nats per token: every row passes 0.1
    masked = corrected_run(tiny_model_dir, prompts, tmp_path, "masked", engine_mask_kl=0.1)
    assert masked[0]["rollout/engine_masked_rows"] == 1.0
    assert masked[0]["rollout/engine_is_weight"] == 0.0
    # No row has a policy gradient, and GRPO's KL term has none at pi = pi_ref: the first
    # update leaves the policy where it was, which the second batch's KL shows.
    assert masked[1]["objective/kl"] == 0.0
    plain = corrected_run(tiny_model_dir, prompts, tmp_path, "plain")
    assert plain[1]["objective/kl"] != 0.0 and "rollout/engine_is_weight" not in plain[0]


@pytest.mark.slow
def test_a_resumed_run_samples_what_the_uninterrupted_one_did(llama_dir, prompts, tmp_path):
    from safetensors.torch import load_file

    from tether.errors import TetherError

    def config(name, **extra):
        return GRPOConfig(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(llama_dir),
                          prompts=str(prompts), max_new_tokens=6, batch_size=8,
                          total_episodes=8 * 4, lr=2e-2, engine="vllm", device="cpu",
                          save_every=1, sample_every=0, seed=3, **extra)
    full = run(config("full"), reward_fn=length_reward)
    calls = {"n": 0}

    def crashes_on_third_batch(prompts_, responses):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("reward server went away")
        return length_reward(prompts_, responses)
    with pytest.raises(TetherError, match="reward server went away"):
        run(config("resumed"), reward_fn=crashes_on_third_batch)
    resumed = run(config("resumed", resume=True), reward_fn=length_reward)
    # The engine got the restored weights and each row its own seed back: the same responses,
    # so the same scores and the same final weights.
    keys = ("objective/score", "rollout/response_len", "objective/kl")
    assert ([[x[k] for k in keys] for x in metrics_of(tmp_path / "runs" / "resumed")]
            == [[x[k] for k in keys] for x in metrics_of(tmp_path / "runs" / "full")])
    a = load_file(str(full.output_path / "model.safetensors"))
    b = load_file(str(resumed.output_path / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_model_vllm_cannot_run_on_cpu_is_one_line_and_writes_nothing(tiny_llama_dir, prompts,
                                                                       tmp_path, capsys):
    # the suite's tiny Llama has head size 16: vLLM's CPU attention has no kernel for it
    code = main(["grpo", "--policy", str(tiny_llama_dir), "--prompts", str(prompts),
                 "--reward-fn", f"{Path(__file__).resolve()}:length_reward", "--engine", "vllm",
                 "--output-dir", str(tmp_path / "runs"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "no kernel for head size 16" in err[0] and "--engine native" in err[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_distill_samples_the_student_with_the_engine(llama_dir, prompts, tmp_path):
    """tether distill with --engine vllm: the engine samples the student, the teacher (the
    model with seeded noise on its weights, as tests/train/test_distill.py makes one) scores;
    the first batch starts at the SFT model (KL 0 to it) and the KL to the teacher falls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.train.ppo_config import DistillConfig

    teacher = AutoModelForCausalLM.from_pretrained(llama_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(4.0 * p.std() * torch.randn(p.shape, generator=gen))
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(tmp_path / "teacher")
    result = run(DistillConfig(run_name="d", output_dir=str(tmp_path / "runs"),
                               policy=str(llama_dir), teacher=str(tmp_path / "teacher"),
                               prompts=str(prompts), max_new_tokens=8, batch_size=16,
                               total_episodes=16 * 8, lr=3e-3, engine="vllm", device="cpu",
                               save_every=0, sample_every=0))
    lines = metrics_of(Path(result.output_path).parent)
    assert lines[0]["objective/kl_sft"] == 0.0
    per_token = [line["objective/kl_exact"] / line["rollout/response_len"] for line in lines]
    assert sum(per_token[-3:]) / 3 < 0.8 * per_token[0], per_token
    assert all(line["rollout/engine_kl"] < 0.1 for line in lines)  # it samples the student
