"""LoRA on one shared base: target checks, adapter switching, every stage's outputs, the reference
(KL exactly 0 at the first step, never the bare base when starting from a LoRA SFT adapter), one
copy of the base for every PPO role, and bit-identical resume."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from update_helpers import prompt_batch

from tether.cli import main
from tether.errors import TetherError
from tether.models.lora import (
    AdapterView,
    LoraSpec,
    _tuner_layers,
    add_adapter,
    linear_layer_names,
    load_adapter,
    resolve_targets,
    set_trainable,
    use_adapter,
)
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.models.reward_model import RewardModel
from tether.rl.engines.native import sample_responses
from tether.rl.scoring import score_rollout
from tether.train.ppo import PPOConfig, run
from tether.train.ppo_setup import build

MODELS = ["tiny_model_dir", "tiny_llama_dir"]


def active_adapter(model) -> str | None:
    """The adapter the LoRA layers of `model` use now (None when disabled or there are none)."""
    layers = _tuner_layers(model)
    if not layers or layers[0]._disable_adapters:
        return None
    active = layers[0]._active_adapter
    return active[0] if isinstance(active, list) else active


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_data")
    return {"sft": write_jsonl(root / "sft.jsonl", sft_rows()),
            "prefs": write_jsonl(root / "prefs.jsonl", preference_rows()),
            "prompts": write_jsonl(root / "prompts.jsonl",
                                   [{"prompt": r["prompt"]} for r in sft_rows(16, seed=3)])}


def _offline(stage, model, data_file, out, name, *extra, steps=3):
    return main([stage, "--model", str(model), "--data", str(data_file), "--run-name", name,
                 "--output-dir", str(out), "--device", "cpu", "--max-steps", str(steps),
                 "--batch-size", "4", "--lora-r", "4", *extra])


@pytest.fixture(scope="module", params=MODELS)
def lora_runs(request, data, tmp_path_factory):
    """A LoRA SFT adapter (trained enough to move away from the base) and a LoRA reward model
    trained from it, for GPT-2 and the Llama-style model."""
    base = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("lora_runs")
    assert _offline("sft", base, data["sft"], out, "sft", "--lr", "1e-2", "--merge-lora") == 0
    assert _offline("rm", out / "sft" / "final", data["prefs"], out, "rm", "--lr", "1e-2",
                    "--merge-lora", steps=4) == 0
    return {"base": base, "out": out, "sft": out / "sft" / "final", "rm": out / "rm" / "final"}


# ----------------------------------------------------------------------------- building blocks

def test_target_names_checked_against_the_models_linear_layers(tiny_model_dir, tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    llama = load_causal_lm(str(tiny_llama_dir), tok)
    assert linear_layer_names(llama) == ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj",
                                         "q_proj", "up_proj", "v_proj"]
    assert resolve_targets(llama, "q_proj, v_proj") == ["q_proj", "v_proj"]
    assert resolve_targets(llama, "all-linear") == "all-linear"
    with pytest.raises(TetherError, match="q_projx matches no linear layer.*down_proj, gate_proj"):
        resolve_targets(llama, "q_proj,q_projx")
    gpt2 = load_causal_lm(str(tiny_model_dir), load_tokenizer(str(tiny_model_dir)))
    assert linear_layer_names(gpt2) == ["c_attn", "c_fc", "c_proj", "lm_head"]  # Conv1D counts


def test_bad_target_module_is_one_line_and_writes_nothing(tiny_llama_dir, data, tmp_path, capsys):
    code = _offline("sft", tiny_llama_dir, data["sft"], tmp_path, "bad", "--lora-target-modules",
                    "qkv")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "qkv matches no linear layer" in err[0] and "q_proj" in err[0]
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("argv, message", [
    (["dpo", "--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout must be 0 for dpo"),
    (["rm", "--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout must be 0 for a reward"),
    (["sft", "--merge-lora"], "--merge-lora applies with --lora-r above 0"),
    (["sft", "--lora-r", "-1"], "'lora_r' must be >= 0"),
    (["sft", "--lora-r", "4", "--lora-alpha", "0"], "'lora_alpha' must be > 0"),
])
def test_bad_lora_settings(argv, message, tiny_model_dir, data, tmp_path, capsys):
    stage, *rest = argv
    data_file = data["sft"] if stage == "sft" else data["prefs"]
    code = main([stage, "--model", str(tiny_model_dir), "--data", str(data_file), "--run-name",
                 "x", "--output-dir", str(tmp_path), *rest])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "x").exists()


def test_ppo_rejects_lora_dropout():
    with pytest.raises(TetherError, match="--lora-dropout must be 0 for ppo"):
        PPOConfig(policy="p", prompts="q", reward_fn="m:f", lora_r=4, lora_dropout=0.1).validate()


def test_use_adapter_switches_and_restores_without_touching_gradients(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    spec = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    peft = add_adapter(load_causal_lm(str(tiny_llama_dir), tok), spec)
    add_adapter(peft, spec, "critic")
    with torch.no_grad():  # give both adapters non-zero B so they change the output
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    set_trainable(peft, ["default", "critic"])
    grads = {n: p.requires_grad for n, p in peft.named_parameters()}
    ids = torch.tensor([tok("the movie was good")["input_ids"]])
    lm = peft.get_base_model()
    with torch.no_grad():
        default = lm(input_ids=ids).logits
        with use_adapter(peft, "critic"):
            critic = lm(input_ids=ids).logits
            assert active_adapter(peft) == "critic"
        with use_adapter(peft, None):
            bare = lm(input_ids=ids).logits
            assert active_adapter(peft) is None
        again = lm(input_ids=ids).logits
    assert active_adapter(peft) == "default"
    assert torch.equal(default, again)
    assert (default - critic).abs().max() > 1e-3 and (default - bare).abs().max() > 1e-3
    assert {n: p.requires_grad for n, p in peft.named_parameters()} == grads
    # The bare base through a view equals the model before any adapter was added.
    fresh = load_causal_lm(str(tiny_llama_dir), tok)
    with torch.no_grad():
        assert torch.equal(AdapterView(peft, None)(input_ids=ids).logits, fresh(input_ids=ids).logits)
    assert list(AdapterView(peft, None).parameters()) == []  # a view owns no weights


# ----------------------------------------------------------------------------- offline outputs

def test_sft_adapter_loads_with_peft_and_merged_with_transformers(lora_runs):
    sft, base = lora_runs["sft"], lora_runs["base"]
    config = json.loads((sft / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    trained = load_file(str(sft / "adapter_model.safetensors"))
    # The adapter, plus the embedding and output layers: both fixtures have no spare row, so the
    # pad token grew them (300 -> 301 rows), and a standard loader needs the new row.
    grown = {k for k in trained if "lora_" not in k}
    assert grown and all(trained[k].shape[0] == 301 for k in grown), grown
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # it trained
    resized = AutoModelForCausalLM.from_pretrained(base)
    resized.resize_token_embeddings(301)  # peft's recipe; the adapter's rows overwrite the new one
    with_peft = PeftModel.from_pretrained(resized, str(sft))
    merged = AutoModelForCausalLM.from_pretrained(lora_runs["out"] / "sft" / "merged")
    bare = AutoModelForCausalLM.from_pretrained(base)
    ids = torch.tensor([[5, 17, 40, 33, 9, 21]])
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (with_peft, merged, bare))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # the pad row's logit included
    assert (a[..., :300] - c).abs().max() > 1e-3  # and the adapter really changes the base


def test_reward_adapter_and_merged_reward_model_score_alike(lora_runs, data):
    rm_dir = lora_runs["rm"]
    # v2: the head lives in the adapter (peft's modules_to_save `score`), not beside it
    assert (rm_dir / "adapter_config.json").is_file() and (rm_dir / "tether_reward.json").is_file()
    assert not (rm_dir / "reward_head.safetensors").exists()
    lora_rm = RewardModel.from_pretrained(rm_dir)
    merged_rm = RewardModel.from_pretrained(lora_runs["out"] / "rm" / "merged")
    assert lora_rm.lora is not None and merged_rm.lora is None
    tok = lora_rm.tokenizer
    rows = preference_rows(8, seed=5)
    texts = [r["prompt"] + r["chosen"] for r in rows] + [r["prompt"] + r["rejected"] for r in rows]
    batch = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = lora_rm.score(batch["input_ids"], batch["attention_mask"])
        b = merged_rm.score(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a[:8] > a[8:]).float().mean() >= 0.75  # it learned the preference rule


@pytest.mark.parametrize("start", ["base", "sft"])
def test_dpo_starts_at_the_reference(lora_runs, data, tmp_path, start):
    """First step: policy == reference, so the loss is exactly ln 2 and both rewards exactly 0,
    whether LoRA starts fresh on a base or continues a LoRA SFT adapter."""
    model = lora_runs["base"] if start == "base" else lora_runs["sft"]
    assert _offline("dpo", model, data["prefs"], tmp_path, "d", "--log-every", "1", steps=2) == 0
    first = json.loads((tmp_path / "d" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-7)
    # The policy's log-probs are the starting model's, not the bare base's.
    assert (tmp_path / "d" / "final" / "adapter_config.json").is_file()


# ----------------------------------------------------------------------------- PPO on one base

def _ppo_cfg(data, policy, out, name, **kw):
    values = dict(run_name=name, output_dir=str(out), policy=str(policy), prompts=str(data["prompts"]),
                  batch_size=4, total_episodes=8, max_new_tokens=5, lr=1e-2, device="cpu",
                  save_every=0, sample_every=0, lora_r=4)
    values.update(kw)
    return PPOConfig(**values)


def _first_batch(setup, cfg):
    _, ids, mask = prompt_batch(setup, cfg, 0)
    rollout = sample_responses(setup.policy, ids, mask, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_ids=setup.eos_token_ids,
                               pad_token_id=setup.tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    return rollout, score_rollout(setup.policy, setup.reference, setup.critic, rollout,
                                  cfg.temperature, cfg.batch_size)


def _storages(*modules) -> dict[int, int]:
    """data_ptr -> bytes of every parameter reachable from `modules` (views included)."""
    found = {}
    for module in modules:
        for m in (module, *module.modules()):
            shared = m.__dict__.get("shared")
            for p in (shared.parameters() if shared is not None else m.parameters(recurse=False)):
                found[p.data_ptr()] = p.numel() * p.element_size()
    return found


@pytest.mark.parametrize("start", ["base", "sft"])
def test_ppo_lora_roles_share_one_base_and_start_at_kl_zero(lora_runs, data, tmp_path, start):
    policy = lora_runs["base"] if start == "base" else lora_runs["sft"]
    cfg = _ppo_cfg(data, policy, tmp_path, "p", reward_model=str(lora_runs["rm"]))
    setup = build(cfg)
    peft = setup.lm.peft
    assert isinstance(setup.reference, AdapterView)
    assert setup.reference.adapter == (None if start == "base" else "reference")
    assert isinstance(setup.critic.backbone, AdapterView) and setup.critic.backbone.adapter == "critic"
    assert set(peft.peft_config) == {"default", "critic", "reward"} | (
        {"reference"} if start == "sft" else set())
    assert active_adapter(peft) == "default"
    # Trainable: the policy and critic adapters and the value head; nothing of the base.
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n or ".critic." in n for n in trainable)
    optimized = {id(p) for g in setup.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in peft.parameters() if p.requires_grad} | {
        id(p) for p in setup.critic.head.parameters()}
    # One copy of the base: every role's weights are the shared model's (plus two small heads).
    def size(params):
        return sum(p.numel() * p.element_size() for p in params)

    assert isinstance(setup.reward_model.backbone, AdapterView)
    base = size(p for n, p in peft.named_parameters() if "lora_" not in n)
    adapters = size(p for n, p in peft.named_parameters() if "lora_" in n)
    heads = size([*setup.critic.head.parameters(), *setup.reward_model.head.parameters()])
    roles = _storages(setup.policy, setup.reference, setup.critic, setup.reward_model)
    assert sum(roles.values()) == base + adapters + heads  # no second copy of anything

    rollout, old = _first_batch(setup, cfg)
    mask = rollout.response_mask
    assert torch.equal(old.logprobs, old.ref_logprobs)  # KL exactly 0 at the first step
    # The reference is the starting model: for a LoRA SFT start that is not the bare base.
    with torch.no_grad(), use_adapter(peft, None):
        bare = score_rollout(setup.policy, setup.policy, setup.critic, rollout, 1.0, 4)
    gap = ((bare.logprobs - old.ref_logprobs) * mask).abs().max()
    assert (gap > 1e-2) if start == "sft" else (gap == 0)
    # The critic starts as the reward model: its value at the last real token is the raw RM score.
    assert old.values.abs().max() > 0


def test_ppo_without_shared_reward_model_gets_a_fresh_critic_adapter(lora_runs, data, tmp_path):
    cfg = _ppo_cfg(data, lora_runs["sft"], tmp_path, "f")
    setup = build(cfg, reward_fn=lambda prompts, responses: [0.0] * len(responses))
    assert setup.critic.backbone.adapter == "critic"
    assert set(setup.lm.peft.peft_config) == {"default", "reference", "critic"}
    assert torch.count_nonzero(setup.critic.head.weight) == 0  # zero head: V = 0 at the start
    _, old = _first_batch(setup, cfg)
    assert torch.equal(old.values, torch.zeros_like(old.values))


def test_ppo_lora_trains_saves_and_merges(lora_runs, data, tmp_path):
    cfg = _ppo_cfg(data, lora_runs["sft"], tmp_path, "t", reward_model=str(lora_runs["rm"]),
                   merge_lora=True, ppo_epochs=1)  # one update per batch: its ratio is the first
    result = run(cfg)
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["objective/kl"] == 0.0 and lines[0]["policy/ratio_mean"] == pytest.approx(1.0)
    assert (result.output_path / "adapter_config.json").is_file()
    saved = load_file(str(result.output_path / "adapter_model.safetensors"))
    assert not any("critic" in k or "reward" in k for k in saved)  # the policy's adapter alone
    # beside the LoRA weights: the embedding and output layers the pad row grew (300 -> 301)
    assert {v.shape[0] for k, v in saved.items() if "lora_" not in k} == {301}
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "t" / "merged")
    resized = AutoModelForCausalLM.from_pretrained(lora_runs["base"])
    resized.resize_token_embeddings(301)
    with_peft = PeftModel.from_pretrained(resized, str(result.output_path))
    ids = torch.tensor([[5, 17, 40, 33]])
    with torch.no_grad():
        a, b = with_peft(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_ppo_lora_resume_is_bit_identical(lora_runs, data, tmp_path):
    """Policy adapter, critic adapter and head, optimizer and RNG all come back: a run that died
    at its third batch and was resumed ends with the uninterrupted run's adapter, bit for bit."""
    def reward(prompts, responses):
        return [len(r) / 10.0 for r in responses]

    kw = dict(total_episodes=12, save_every=1)
    full = run(_ppo_cfg(data, lora_runs["sft"], tmp_path, "full", **kw), reward_fn=reward)
    calls = {"n": 0}

    def crashes_on_third_batch(prompts, responses):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("reward server went away")
        return reward(prompts, responses)

    with pytest.raises(TetherError, match="reward server went away"):
        run(_ppo_cfg(data, lora_runs["sft"], tmp_path, "part", **kw), reward_fn=crashes_on_third_batch)
    ckpt = load_file(str(tmp_path / "part" / "checkpoints" / "step_2" / "policy.safetensors"))
    assert ckpt and all("lora_" in k for k in ckpt)  # trainable tensors only, not the base
    assert any(".critic." in k for k in ckpt) and not any(".reference." in k for k in ckpt)
    resumed = run(_ppo_cfg(data, lora_runs["sft"], tmp_path, "part", resume=True, **kw),
                  reward_fn=reward)
    a = load_file(str(full.output_path / "adapter_model.safetensors"))
    b = load_file(str(resumed.output_path / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = load_file(str(tmp_path / "full" / "checkpoints" / "step_3" / "policy.safetensors"))
    assert any(not torch.equal(last[k], ckpt[k]) for k in ckpt)  # batch 3 did train


def _lora_grads(lora_runs, data, tmp_path, checkpointing: bool, recompute_context: bool = True):
    """Gradients of every trainable tensor after one PPO minibatch loss on the first batch
    (LoRA policy and critic adapters on one base, shared LoRA reward model)."""
    from update_helpers import loss_on

    import tether.train.ppo_setup as ppo_setup
    from tether.advantages import gae, kl_shaped_rewards
    from tether.rl.scoring import update_mode

    cfg = _ppo_cfg(data, lora_runs["base"], tmp_path, f"g{checkpointing}{recompute_context}",
                   reward_model=str(lora_runs["rm"]), gradient_checkpointing=checkpointing)
    original = ppo_setup.adapter_recompute_context
    if not recompute_context:  # what a naive setup would do: recompute under the active adapter
        ppo_setup.adapter_recompute_context = lambda model: None
    try:
        torch.manual_seed(0)
        setup = build(cfg)
    finally:
        ppo_setup.adapter_recompute_context = original
    with torch.no_grad():  # the critic adapter must differ from the policy's for the test to bite
        for name, p in setup.lm.peft.named_parameters():
            if ".critic." in name and "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rollout, old = _first_batch(setup, cfg)
    scores = torch.linspace(-1, 1, len(rollout))
    rewards, _ = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, rollout.response_mask, 0.1)
    advantages, returns = gae(rewards, old.values, rollout.response_mask)
    with update_mode(cfg.gradient_checkpointing, setup.policy, setup.critic):
        loss, _ = loss_on(setup, rollout, old, advantages, returns, 0.0)
        loss.backward()
    params = [*setup.lm.peft.named_parameters(), *setup.critic.head.named_parameters()]
    return {n: p.grad.clone() for n, p in params if p.requires_grad}


def test_gradient_checkpointing_with_lora_roles_keeps_each_adapters_gradients(lora_runs, data,
                                                                               tmp_path):
    plain = _lora_grads(lora_runs, data, tmp_path, checkpointing=False)
    checkpointed = _lora_grads(lora_runs, data, tmp_path, checkpointing=True)
    assert plain.keys() == checkpointed.keys() and any(".critic." in k for k in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # Without recomputing under the adapter a layer ran with, the critic's layers would be
    # recomputed under the policy's adapter in backward(), and its gradients would be wrong.
    naive = _lora_grads(lora_runs, data, tmp_path, checkpointing=True, recompute_context=False)
    worst = max(float((naive[k] - plain[k]).abs().max()) for k in plain if ".critic." in k)
    assert worst > 1e-4


def test_wrapping_and_loading_an_adapter_prints_no_deprecation_of_transformers(tiny_llama_dir,
                                                                              tmp_path):
    # peft before 0.22 asks the model `is_gradient_checkpointing`, deprecated by transformers:
    # tether's own LoRA calls must not print that FutureWarning (it came on every eval and
    # generate load). Newer peft asks the new name; the filter must then still be harmless.
    import warnings

    from tether.models.lora import peft_quietly

    spec = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), spec)
        wrapped.save_pretrained(tmp_path / "adapter")
        load_adapter(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), tmp_path / "adapter",
                     "trained")
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not any("is_gradient_checkpointing" in m for m in messages), messages
    # The filter itself, on the deprecated property directly (whatever peft's version asks):
    # outside it the warning is real, inside it is gone.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    if "is_gradient_checkpointing" not in dir(type(model)):
        pytest.skip("this transformers has dropped is_gradient_checkpointing")
    for quiet, expected in ((False, 1), (True, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with peft_quietly() if quiet else contextlib.nullcontext():
                _ = model.is_gradient_checkpointing
        assert sum("is_gradient_checkpointing" in str(w.message) for w in caught) == expected
