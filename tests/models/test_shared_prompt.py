"""Rows that repeat a prompt run it once (tether.models.forward): same numbers as the plain pass.

The truth each test compares against is the plain single forward over the whole [B, P + R]
batch (sharing switched off), which other tests check against rows run one by one. Every model
family runs: GPT-2 (absolute positions), Llama (rotary, GQA, BOS), Mistral (a sliding window of 8
that the rows outgrow, so the window cuts into the prompt) and Qwen2 (full and windowed layers).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import tether.models.forward as shared_prompt
from tether.models.critic import ValueModel
from tether.models.forward import can_share, prompt_groups, sharing
from tether.models.reward_model import RewardModel
from tether.models.tiny import make_lm
from tether.models.trunk_head import score_responses

K, GROUPS, P, R = 3, 3, 7, 9


def rollout_batch(vocab: int, seed: int = 0):
    """[K * GROUPS, P + R] ids and mask in rollout layout: GROUPS prompts of different lengths
    (left-padded), each repeated K times, with responses of different lengths (right-padded)."""
    gen = torch.Generator().manual_seed(seed)
    rows = K * GROUPS
    ids = torch.randint(1, vocab - 1, (rows, P + R), generator=gen)
    mask = torch.ones(rows, P + R, dtype=torch.long)
    for g in range(GROUPS):
        block = slice(g * K, (g + 1) * K)
        ids[block, :P] = ids[g * K, :P]
        mask[block, :g * 2] = 0  # prompts of P, P - 2, P - 4 tokens
        ids[block, :g * 2] = 0
    for row, length in enumerate([9, 4, 1, 9, 7, 2, 5, 9, 3]):
        mask[row, P + length:] = 0
        ids[row, P + length:] = 0
    return ids, mask


@pytest.fixture
def plain(monkeypatch):
    """A function that runs `fn()` with prompt sharing off."""
    def run(fn):
        with monkeypatch.context() as patch:
            patch.setattr(shared_prompt, "can_share", lambda model: False)
            return fn()
    return run


@pytest.fixture
def family_dir(request, tiny_model_dir, tiny_llama_dir, tiny_mistral_dir, tiny_qwen2_dir):
    return {"gpt2": tiny_model_dir, "llama": tiny_llama_dir, "mistral": tiny_mistral_dir,
            "qwen2": tiny_qwen2_dir}[request.param]


FAMILIES = ["gpt2", "llama", "mistral", "qwen2"]


def test_prompt_groups_by_ids_and_mask():
    ids = torch.tensor([[5, 6, 1], [5, 6, 2], [5, 6, 3], [9, 9, 1], [5, 6, 4]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    groups = prompt_groups(ids, mask, context_length=2)
    # rows 0, 1, 4 share [5, 6]; row 2 has the same ids but a padded first column: its own prompt
    assert groups is not None
    inverse = groups.inverse.tolist()
    assert inverse[0] == inverse[1] == inverse[4]
    assert len(set(inverse)) == 3 and inverse[2] != inverse[0] and inverse[3] != inverse[0]
    assert sorted(groups.first.tolist()) == [0, 2, 3]
    assert (groups.inverse[groups.first] == torch.arange(3)).all()  # first rows map to themselves
    assert prompt_groups(ids[[0, 2, 3]], mask[[0, 2, 3]], context_length=2) is None
    assert prompt_groups(ids, mask, context_length=0) is None


@pytest.mark.parametrize("family_dir", FAMILIES, indirect=True)
@pytest.mark.parametrize("chunked", [True, False])
def test_response_scores_match_the_plain_pass(chunked, family_dir, plain):
    model = AutoModelForCausalLM.from_pretrained(family_dir).eval()
    ids, mask = rollout_batch(model.config.vocab_size)
    assert sharing(model, ids, mask, P) is not None  # the shared path does run

    def score():
        return score_responses(model, ids, mask, P, 0.7, chunked=chunked, entropy=True,
                               hidden=True)
    with torch.no_grad():
        got, want = score(), plain(score)
    real = mask[:, P:].bool()
    for field in ("logprobs", "entropy", "hidden"):
        diff = (getattr(got, field) - getattr(want, field))[real].abs().max().item()
        assert diff < 2e-5, (field, diff)


@pytest.mark.parametrize("family_dir", ["llama", "mistral"], indirect=True)
def test_gradients_match_the_plain_pass(family_dir, plain):
    """The copied-out cache sums each prompt's K gradients: parameter gradients of a loss on
    the response log-probs equal the plain pass's."""
    model = AutoModelForCausalLM.from_pretrained(family_dir).train()
    for module in model.modules():  # no dropout: both passes see the same function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids, mask = rollout_batch(model.config.vocab_size, seed=1)
    weights = torch.randn(ids.shape[0], R, generator=torch.Generator().manual_seed(2))

    def grads():
        model.zero_grad()
        scores = score_responses(model, ids, mask, P, 1.0, chunked=True)
        (scores.logprobs * weights * mask[:, P:]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    got, want = grads(), plain(grads)
    for n, g in want.items():
        assert torch.allclose(got[n], g, rtol=1e-4, atol=1e-6), n
    embed = model.get_input_embeddings().weight.grad
    prompt_tokens = ids[:, :P][mask[:, :P].bool()].unique()
    assert embed[prompt_tokens].abs().sum() > 0  # the prompt columns do get gradient


@pytest.mark.parametrize("family_dir", ["gpt2", "llama"], indirect=True)
def test_values_and_rewards_match_the_plain_pass(family_dir, plain):
    from transformers import AutoTokenizer

    rm = RewardModel.from_causal_lm(str(family_dir),
                                    AutoTokenizer.from_pretrained(family_dir)).eval()
    torch.nn.init.normal_(rm.head.weight, std=0.5, generator=torch.Generator().manual_seed(3))
    critic = ValueModel.from_reward_model(rm).eval()
    ids, mask = rollout_batch(rm.backbone.config.vocab_size)

    def both():
        return rm(ids, mask, context_length=P), critic(ids, mask, P)
    with torch.no_grad():
        got, want = both(), plain(both)
        unshared = rm(ids, mask)  # no context length: the plain pass
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert torch.allclose(got[0], unshared, atol=1e-5)
    assert got[0].std() > 0  # scores that differ between rows, read at each row's end
    real = mask[:, P:].bool()
    assert (got[1] - want[1])[real].abs().max() < 1e-5


def test_reward_with_an_empty_response_takes_the_plain_pass(tiny_model_dir):
    from transformers import AutoTokenizer

    rm = RewardModel.from_causal_lm(str(tiny_model_dir),
                                    AutoTokenizer.from_pretrained(tiny_model_dir)).eval()
    ids, mask = rollout_batch(rm.backbone.config.vocab_size)
    mask[4, P:] = 0  # row 4's response is empty: its score is read at its prompt's last token
    with torch.no_grad():
        assert torch.allclose(rm(ids, mask, context_length=P), rm(ids, mask), atol=1e-6)


def lora_policy(model_dir):
    from transformers import AutoTokenizer

    from tether.models.lora import LoraSpec
    from tether.models.pretrained import load_trainable_lm

    lm = load_trainable_lm(str(model_dir), AutoTokenizer.from_pretrained(model_dir),
                           LoraSpec(r=4, alpha=8, dropout=0.0, target_modules="all-linear"))
    for name, param in lm.peft.named_parameters():  # a non-zero adapter: B starts at 0
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(4))
    return lm


@pytest.mark.parametrize("chunked", [True, False])
def test_lora_policy_and_its_adapter_view_reference_match_the_plain_pass(chunked, plain,
                                                                         tiny_llama_dir):
    from tether.models.lora import AdapterView

    lm = lora_policy(tiny_llama_dir)
    policy, reference = lm.peft.eval(), AdapterView(lm.peft, None)  # the base, adapter off
    ids, mask = rollout_batch(lm.model.config.vocab_size)
    real = mask[:, P:].bool()
    for model in (policy, reference):
        assert can_share(model)

        def score(model=model):
            return score_responses(model, ids, mask, P, 1.0, chunked=chunked).logprobs
        with torch.no_grad():
            got, want = score(), plain(score)
        assert (got - want)[real].abs().max() < 2e-5
    with torch.no_grad():
        assert (score_responses(policy, ids, mask, P, 1.0, chunked=chunked).logprobs
                - score_responses(reference, ids, mask, P, 1.0, chunked=chunked).logprobs
                )[real].abs().max() > 1e-3  # the view really runs without the adapter


def test_adapter_views_follow_the_shared_model_into_checkpointing(tiny_model_dir):
    """A LoRA critic's or reward model's trunk is an AdapterView that registers no module; its
    shared model's checkpointing (which drops the cache in training) must still turn sharing off."""
    from tether.models.lora import AdapterView

    lm = lora_policy(tiny_model_dir)
    trunk_view = AdapterView(lm.peft, None, part="trunk")
    assert can_share(trunk_view)
    lm.peft.get_base_model().gradient_checkpointing_enable()
    assert not can_share(trunk_view) and not can_share(lm.peft)


def test_models_that_cannot_share():
    model = make_lm(50, n_layer=1, n_embd=16, n_head=2)
    assert can_share(model)
    model.gradient_checkpointing_enable()  # transformers drops the cache of it in training
    assert not can_share(model.train())
    assert not can_share(model.eval())  # its scoring must take the path its update takes


@pytest.mark.parametrize("family_dir", ["gpt2", "llama"], indirect=True)
def test_the_grpo_loop_runs_each_prompt_once(family_dir, tmp_path, monkeypatch):
    """One `tether grpo` batch of 2 prompts x 4 samples: with sharing, every layer of the
    reference, the reward model, the sampler's prefill and the update sees the 2 distinct prompts
    in one call and the 8 responses in another; switched off, each forward sees 8 rows."""
    import json

    from scale_helpers import layer_calls

    from tether.train.ppo import run
    from tether.train.ppo_config import GRPOConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie", "a film"]))

    def one_batch(name):
        cfg = GRPOConfig(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(family_dir),
                         prompts=str(prompts), batch_size=8, total_episodes=8, max_new_tokens=5,
                         device="cpu", save_every=0, sample_every=0, report_to="none")
        with layer_calls() as calls:
            run(cfg, reward_fn=lambda prompts, responses: [len(r) / 10 for r in responses])
        return calls

    shared = one_batch("shared")
    with monkeypatch.context() as patch:
        patch.setattr(shared_prompt, "can_share", lambda model: False)
        patch.setattr(shared_prompt, "prompt_groups", lambda *args: None)
        unshared = one_batch("unshared")
    trained = {rows for rows, grad in shared if grad}
    assert trained == {2, 8}  # the update: prompts once, then responses on their cache
    assert {rows for rows, grad in unshared if grad} == {8}
    # no-grad calls: prefill, decode steps, reference; 2-row calls only with sharing
    assert 2 in {rows for rows, grad in shared if not grad}
    assert 2 not in {rows for rows, _ in unshared}
