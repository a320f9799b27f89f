"""Reward models trained outside tether (transformers sequence-classification checkpoints with
their own tokenizer and chat template) as `--reward-model` of ppo, grpo and eval.

The independent truth is the model's own forward on one text at a time, unpadded, with the ids
its own tokenizer gives (`apply_chat_template` for a chat, the tokenizer plus EOS for plain text:
how TRL's RewardTrainer tokenised its training rows), computed here without tether's encoder.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import sample_texts
from offline_fixtures import RM_TEMPLATE, write_jsonl
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
)

from tether.cli import main
from tether.data.prompts import format_prompt
from tether.errors import TetherError
from tether.models.hub_reward import HubRewardModel, load_hub_reward_model
from tether.models.pretrained import load_tokenizer
from tether.models.tiny import EOS, make_llama_tokenizer, make_tokenizer
from tether.rl.reward.models import load_reward_model, prompt_originals
from tether.train.ppo import PPOConfig
from tether.train.ppo_setup import build

CHATS = [[{"role": "user", "content": "the movie was"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a film with a long plot and"}],
         [{"role": "user", "content": "it"}],
         [{"role": "user", "content": "the ending was very"}]]
PLAIN = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
RESPONSES = [" good fun.", " the actor was great and the music loved it", "", " dull."]


def _other_texts():
    # another corpus and vocabulary size than the policies' (sample_texts(), 300 tokens)
    return [t.upper() + " " + t for t in sample_texts(200, seed=11)]


def _spread_head(model):
    with torch.no_grad():  # a random head of std 0.02 gives near-equal scores; spread them
        model.score.weight.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def hub_rms(tmp_path_factory):
    """Two hub-style reward models "trained outside tether", saved with save_pretrained:
    - gpt2: GPT2ForSequenceClassification, a 200-token BPE, no chat template, pad = EOS (what
      TRL's RewardTrainer sets when a tokenizer has no pad token);
    - llama: LlamaForSequenceClassification, a 260-token Llama-style tokenizer (adds BOS) with its
      own chat template, and no pad token at all (config.pad_token_id None)."""
    root = tmp_path_factory.mktemp("hub_rms")
    tok = make_tokenizer(_other_texts(), vocab_size=200)
    tok.pad_token = EOS
    torch.manual_seed(1)
    gpt2 = AutoModelForSequenceClassification.from_config(GPT2Config(
        vocab_size=len(tok), n_layer=2, n_embd=32, n_head=2, n_positions=128, num_labels=1,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    _spread_head(gpt2).save_pretrained(root / "gpt2")
    tok.save_pretrained(root / "gpt2")

    ltok = make_llama_tokenizer(_other_texts(), vocab_size=260)
    ltok.chat_template = RM_TEMPLATE
    torch.manual_seed(2)
    llama = AutoModelForSequenceClassification.from_config(LlamaConfig(
        vocab_size=len(ltok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
        bos_token_id=ltok.bos_token_id, eos_token_id=ltok.eos_token_id))
    assert llama.config.pad_token_id is None
    _spread_head(llama).save_pretrained(root / "llama")
    ltok.save_pretrained(root / "llama")
    return {"gpt2": root / "gpt2", "llama": root / "llama"}


def own_forward_scores(path, prompts, responses) -> list[float]:
    """The model's own forward, one text at a time, unpadded, on its own tokenizer's ids."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        if tok.chat_template:
            turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(turns + [{"role": "assistant", "content": response}],
                                          tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tok(prompt + response + tok.eos_token)["input_ids"]
        with torch.no_grad():
            scores.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return scores


@pytest.mark.parametrize("which, prompts", [("gpt2", PLAIN), ("llama", PLAIN), ("llama", CHATS)])
def test_scores_are_the_models_own_forward_one_text_at_a_time(hub_rms, which, prompts):
    rm = load_hub_reward_model(str(hub_rms[which])).eval()
    expected = own_forward_scores(hub_rms[which], prompts, RESPONSES)
    # batches of 3 and 4 rows of different lengths, padded on the right with the model's pad id
    # (gpt2: EOS, which every plain text ends with; llama: none configured, one chosen per batch)
    for batch_size in (3, 4):
        got = rm.score_texts(prompts, RESPONSES, batch_size=batch_size)
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert len(set(expected)) == len(expected)  # the texts really score apart


def test_dtype_reaches_the_hub_rm(hub_rms):
    rm = load_hub_reward_model(str(hub_rms["llama"]), dtype="bfloat16").eval()
    assert rm.model.dtype == torch.bfloat16
    got = rm.score_texts(CHATS, RESPONSES, batch_size=4)
    assert got.dtype == torch.float32  # scores leave in fp32 whatever the model computes in
    expected = torch.tensor(own_forward_scores(hub_rms["llama"], CHATS, RESPONSES))
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # bf16 rounding only


def test_gpt2_rm_with_pad_eos_reads_the_last_response_token(hub_rms):
    # pad = EOS: transformers reads the last token that is not EOS, here the response's last
    # token; the same position in a padded batch as alone. Checked against the trunk + head.
    rm = load_hub_reward_model(str(hub_rms["gpt2"])).eval()
    tok = rm.tokenizer
    ids = tok("the movie was good fun." + tok.eos_token)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    with torch.no_grad():
        hidden = rm.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, -2]
        by_hand = (rm.head.weight[0] @ hidden).item()
    got = rm.score_texts(["the movie was", "it"], [" good fun.", " a long plot"], batch_size=2)
    assert got[0].item() == pytest.approx(by_hand, abs=1e-5)


def test_the_reward_reads_each_chat_as_its_row_gave_it(hub_rms, tiny_llama_dir, tmp_path):
    # The policy's prompt texts are rendered with the POLICY's template; the reward model must
    # see the original messages under ITS template, found through the prompt-row mapping.
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": c} for c in CHATS[:2]]
                          + [{"prompt": p} for p in PLAIN[2:]])
    policy_tok = load_tokenizer(str(tiny_llama_dir))
    originals = prompt_originals(policy_tok, str(prompts))
    rows = [{"messages": c} for c in CHATS[:2]] + [{"prompt": p} for p in PLAIN[2:]]
    texts = [format_prompt(policy_tok, r) for r in rows]
    assert texts[0].startswith(policy_tok.bos_token + "<|user|>")  # the policy's rendering
    loaded = load_reward_model(str(hub_rms["llama"]), policy_tok, originals, 2, "cpu")
    assert isinstance(loaded.model, HubRewardModel) and loaded.critic_init is None  # other vocab
    got = loaded.reward(texts, RESPONSES, None).scores
    expected = own_forward_scores(hub_rms["llama"], CHATS[:2] + PLAIN[2:], RESPONSES)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_text_longer_than_the_rm_reads_is_an_error(hub_rms):
    rm = load_hub_reward_model(str(hub_rms["gpt2"]))  # n_positions 128
    with pytest.raises(TetherError, match="more than the 128 it can read; lower --max-prompt-len"):
        rm.score_texts(["the movie was"], [" the movie was good" * 30])


def test_chat_prompts_need_an_rm_with_a_chat_template(hub_rms, tiny_llama_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": c} for c in CHATS])
    policy_tok = load_tokenizer(str(tiny_llama_dir))
    with pytest.raises(TetherError, match="chat messages but the reward model .* no chat template"):
        load_reward_model(str(hub_rms["gpt2"]), policy_tok,
                          prompt_originals(policy_tok, str(prompts)), 2, "cpu")


def _ppo_cfg(policy, prompts, rm, out, name, **kw):
    values = dict(run_name=name, output_dir=str(out), policy=str(policy), prompts=str(prompts),
                  reward_model=str(rm), batch_size=4, total_episodes=4, max_new_tokens=6,
                  device="cpu", save_every=0, sample_every=0)
    return PPOConfig(**(values | kw))


def test_ppo_critic_starts_from_the_policy_when_the_rm_reads_another_vocabulary(
        hub_rms, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PLAIN])
    setup = build(_ppo_cfg(tiny_model_dir, prompts, hub_rms["gpt2"], tmp_path, "c"))
    # the RM's trunk cannot read the policy's ids: the value model is the policy's trunk, zero head
    trunk = dict(setup.critic.backbone.named_parameters())
    for name, param in setup.policy.base_model.named_parameters():
        assert torch.equal(trunk[name], param), name
    assert setup.critic.head.weight.abs().max() == 0
    # and the loop's reward is the hub model's own score of the decoded texts
    got = setup.source.reward(setup.source.prompts[:4], RESPONSES, None).scores
    torch.testing.assert_close(got, torch.tensor(own_forward_scores(hub_rms["gpt2"], PLAIN,
                                                                    RESPONSES)),
                               rtol=1e-5, atol=1e-5)


def test_ppo_critic_starts_from_a_hub_rm_on_the_policys_vocabulary(tiny_model_dir, tmp_path):
    # A sequence-classification RM built on the policy's own tokenizer (no pad token: tether gave
    # the policy one, so its vocabulary is the RM's plus <|pad|>): the critic copies its trunk
    # (grown by the pad row) and its `score` as the value head, with a zero bias.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(GPT2Config(
        vocab_size=len(tok), n_layer=2, n_embd=64, n_head=2, n_positions=256, num_labels=1,
        pad_token_id=tok.eos_token_id))
    _spread_head(rm).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PLAIN])
    setup = build(_ppo_cfg(tiny_model_dir, prompts, tmp_path / "rm", tmp_path, "s"))
    assert torch.equal(setup.critic.head.weight, rm.score.weight)
    assert setup.critic.head.bias.item() == 0.0
    rows = setup.policy.get_input_embeddings().weight.shape[0]
    assert setup.critic.backbone.get_input_embeddings().weight.shape[0] == rows == len(tok) + 1
    assert torch.equal(setup.critic.backbone.h[0].attn.c_attn.weight,
                       rm.transformer.h[0].attn.c_attn.weight)


@pytest.mark.parametrize("stage, policy, rm, chat", [
    ("grpo", "tiny_llama_dir", "llama", True),
    ("ppo", "tiny_model_dir", "gpt2", False),
    ("ppo", "tiny_llama_dir", "llama", True),
])
def test_hub_rm_drives_the_online_stages(stage, policy, rm, chat, hub_rms, request, tmp_path):
    rows = [{"messages": c} for c in CHATS] if chat else [{"prompt": p} for p in PLAIN]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    argv = [stage, "--policy", str(request.getfixturevalue(policy)), "--prompts", str(prompts),
            "--reward-model", str(hub_rms[rm]), "--run-name", "h", "--output-dir",
            str(tmp_path / "runs"), "--batch-size", "4", "--total-episodes", "8",
            "--max-new-tokens", "6", "--device", "cpu", "--save-every", "0"]
    assert main(argv + (["--samples-per-prompt", "2"] if stage == "grpo" else [])) == 0
    lines = [json.loads(x) for x in (tmp_path / "runs" / "h" / "metrics.jsonl").read_text()
             .splitlines() if "objective/score" in x]
    assert len(lines) == 2 and all(abs(x["objective/score"]) < 50 for x in lines)
    assert lines[0]["objective/score"] != lines[1]["objective/score"]  # the RM scores samples


@pytest.mark.parametrize("policy, rm, chat", [("tiny_llama_dir", "llama", True),
                                              ("tiny_model_dir", "gpt2", False)])
def test_eval_scores_samples_with_the_hub_rm(policy, rm, chat, hub_rms, request, tmp_path,
                                             capsys):
    originals = CHATS if chat else PLAIN
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": c} if chat else {"prompt": c}
                                                 for c in originals])
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(request.getfixturevalue(policy)), "--prompts",
                 str(prompts), "--reward-model", str(hub_rms[rm]), "--max-new-tokens", "6",
                 "--output", str(out), "--device", "cpu"]) == 0
    samples = json.loads(out.read_text())["samples"]
    expected = own_forward_scores(hub_rms[rm], originals, [s["response"] for s in samples])
    assert [s["score"] for s in samples] == pytest.approx(expected, abs=1e-5)


def test_eval_refuses_a_causal_lm_as_reward_model(tiny_model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PLAIN])
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--reward-model", str(tiny_model_dir), "--output", str(tmp_path / "e.json"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert "is not a reward model" in err and "num_labels=1" in err
    assert not (tmp_path / "e.json").exists()
