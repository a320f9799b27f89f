"""Saved models sample what tether trained and scored: their generation_config is plain
softmax(z / T) at the run's temperature, stopping at tether's EOS set, whatever sampling the base
model shipped (Llama 3 ships temperature 0.6 and top-p 0.9)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from transformers import AutoModelForCausalLM, GenerationConfig

from tether.models.pretrained import load_tokenizer
from tether.train.ppo import run as ppo_run
from tether.train.ppo_config import GRPOConfig
from tether.train.sft import SFTConfig
from tether.train.sft import run as sft_run


@pytest.fixture
def chatty_base(tiny_llama_dir, tmp_path):
    """The tiny Llama with a base model's sampling saved beside it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    config = GenerationConfig.from_pretrained(base)
    config.do_sample, config.temperature, config.top_p, config.top_k = True, 0.6, 0.9, 40
    config.repetition_penalty = 1.3
    config.save_pretrained(base)
    return base


def plain(directory, temperature):
    config = json.loads((directory / "generation_config.json").read_text())
    tokenizer = load_tokenizer(str(directory))
    assert config["do_sample"] is True and config["temperature"] == temperature
    assert config["top_k"] == 0 and config["top_p"] == 1.0
    assert config.get("repetition_penalty", 1.0) == 1.0
    assert config["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.eos_token_id in config["eos_token_id"]
    return config


def test_sft_and_its_merged_model_save_plain_sampling(chatty_base, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    for name, extra in (("full", {}), ("lora", {"lora_r": 4, "merge_lora": True})):
        sft_run(SFTConfig(run_name=name, output_dir=str(tmp_path / "runs"), model=str(chatty_base),
                          data=str(data), max_steps=1, batch_size=4, device="cpu", **extra))
    plain(tmp_path / "runs" / "full" / "final", 1.0)
    plain(tmp_path / "runs" / "lora" / "merged", 1.0)
    # and transformers samples from it as from softmax(z): with the base's config the same seed
    # draws other tokens (top-k 40, top-p 0.9, T 0.6 and the repetition penalty reshape it)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "full" / "final")
    ids = torch.tensor([[1, 50, 60]])
    logits = model(ids).logits[0, -1]
    processors = model._get_logits_processor(
        generation_config=model.generation_config, input_ids_seq_length=3, encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None, logits_processor=None, device="cpu")
    assert torch.equal(processors(ids, logits[None].clone())[0], logits)  # T = 1, nothing else


def test_online_run_saves_its_temperature(chatty_base, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("the movie", "a film")))
    ppo_run(GRPOConfig(run_name="g", output_dir=str(tmp_path / "runs"), policy=str(chatty_base),
                       prompts=str(prompts), batch_size=4, samples_per_prompt=2, total_episodes=4,
                       max_new_tokens=3, temperature=0.7, device="cpu", save_every=0,
                       sample_every=0, report_to="none"),
            reward_fn=lambda prompts, responses: [float(len(r)) for r in responses])
    plain(tmp_path / "runs" / "g" / "final", 0.7)
