"""The lean decode step (tether.decode.LeanDecoder) against two independent truths: the model's full
forward over the whole sequence (no cache), and the samples of the model-forward sampler
(`sample_responses(..., lean=False)`), on GPT-2, Llama (rotary, GQA, BOS), Mistral (sliding
window of 8 columns) and Qwen2 (full attention below, a window of 8 above), plain and with LoRA."""

from __future__ import annotations

import pytest
import torch
from conftest import sample_texts

from tether.data.prompts import left_pad
from tether.models.forward import position_ids_from_mask
from tether.models.lora import LoraSpec, add_adapter
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.rl.engines.lean import LeanDecoder, lean_architecture
from tether.rl.engines.native import ModelForward, prefill, sample_responses
from tether.rl.rollout import sampling_uniforms

TEXTS = ["the", "a good film and the plot was very long and boring but the", "the movie was",
         "it", "fun and quite loved", "the ending was short and the music was dull and"]
FIXTURES = {"gpt2": "tiny_model_dir", "llama": "tiny_llama_dir", "mistral": "tiny_mistral_dir",
            "qwen2": "tiny_qwen2_dir"}
CASES = ["gpt2", "llama", "mistral", "qwen2", "gpt2+lora", "llama+lora"]


def _model(request, case: str, dtype=torch.float32, peft_wrapper: bool = False):
    """(tokenizer, model in eval mode); "+lora": peft LoRA on every linear layer with non-zero B,
    so the adapter changes the output and the lean step must run it (the PeftModel itself with
    `peft_wrapper`, else the transformers model it injected the LoRA layers into)."""
    path = str(request.getfixturevalue(FIXTURES[case.split("+")[0]]))
    tokenizer = load_tokenizer(path)
    model = disable_dropout(load_causal_lm(path, tokenizer)).to(dtype).eval()
    if case.endswith("+lora"):
        peft = add_adapter(model, LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear"))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
        # PPO samples from the transformers model, its LoRA layers injected in place.
        model = peft if peft_wrapper else peft.get_base_model()
    return tokenizer, model


def _prompts(tokenizer, repeats: int = 1, more: int = 0):
    """TEXTS (+ `more` random ones), each `repeats` times in a row, left-padded."""
    texts = TEXTS + sample_texts(more, seed=7)
    rows = [tokenizer(t)["input_ids"] for t in texts for _ in range(repeats)]
    return left_pad(rows, tokenizer.pad_token_id, "cpu")


@pytest.mark.parametrize("case", CASES + ["llama-bf16"])
def test_lean_step_logits_match_the_full_forward(request, case):
    # Teacher-forced tokens; rows finish at different steps (then feed pads with attention 0).
    # Each step's logits on rows still alive must equal the full forward's at that column: the
    # forward without any cache, positions from the mask, transformers' own masks (padding,
    # sliding window over columns). 12 steps pass Mistral's and Qwen2's window of 8.
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    tokenizer, model = _model(request, case.removesuffix("-bf16"), dtype)
    assert lean_architecture(model) is not None
    ids, mask = _prompts(tokenizer)
    batch, width = ids.shape
    steps = 12
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, len(tokenizer), (batch, steps), generator=gen)
    finish = torch.tensor([steps, 3, steps, 7, 10, steps])  # row b is alive at step t < finish
    alive = torch.arange(steps)[None, :] < finish[:, None]  # [B, steps]
    with torch.no_grad():
        positions = position_ids_from_mask(mask)
        first, cache = prefill(model, ids, mask, positions, dedupe=False)
        decoder = LeanDecoder.build(model, cache, mask, positions[:, -1:] + 1, steps + 1)
        for layer, keys, values in zip(cache.layers, decoder.keys, decoder.values, strict=True):
            # NaN in every column the step must not read before writing: the buffer is left
            # uninitialised there (the prompt columns a sliding layer dropped, all new columns).
            kept = layer.keys.shape[-2]
            for buffer in (keys, values):
                buffer[:, :, :width - kept] = float("nan")
                buffer[:, :, width:] = float("nan")
        lean = [first] + [decoder.step(tokens[:, t], alive[:, t]) for t in range(steps)]
        full_ids = torch.cat([ids, torch.where(alive, tokens, tokenizer.pad_token_id)], 1)
        full_mask = torch.cat([mask, alive.long()], 1)
        full = model(input_ids=full_ids, attention_mask=full_mask,
                     position_ids=position_ids_from_mask(full_mask)).logits
    # Logits are ~0.5 in size: float32 agrees to ~2e-7 (measured); bfloat16 to within 2 of its
    # ulps (2^-8 at 0.5): the forward's own rounding, not a wrong column or position.
    tol = dict(rtol=0, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for t in range(steps + 1):
        rows = alive[:, t - 1] if t > 0 else torch.ones(batch, dtype=torch.bool)
        torch.testing.assert_close(lean[t][rows].float(), full[rows, width - 1 + t].float(), **tol)
    assert full[:, width:].float().abs().max() > 0.3  # not vacuous: differences would show


@pytest.mark.parametrize("case", CASES)
def test_lean_samples_equal_the_model_forward_samples(request, case):
    # The same uniforms through both samplers: identical tokens, masks and `ended` on 72 rows,
    # 24 prompts three times each (the prefill runs each once), a sixth of the vocabulary ending
    # a response, so rows stop at many different steps and some outlive the window of 8.
    tokenizer, model = _model(request, case)
    ids, mask = _prompts(tokenizer, repeats=3, more=18)
    kw = dict(max_new_tokens=20, temperature=0.9, eos_token_ids=list(range(0, len(tokenizer), 6)),
              pad_token_id=tokenizer.pad_token_id, uniforms=sampling_uniforms(3, len(ids), 20))
    lean = sample_responses(model, ids, mask, **kw)
    forward = sample_responses(model, ids, mask, lean=False, **kw)
    assert lean.input_ids.equal(forward.input_ids)
    assert lean.response_mask.equal(forward.response_mask) and lean.ended.equal(forward.ended)
    lengths = lean.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 4 and (lengths > 10).any() and lean.ended.any()


def test_peft_model_and_its_disabled_adapter_sample_alike_on_both_paths(request):
    # The PeftModel itself (unwrapped to its transformers model) and, inside disable_adapter(),
    # the reference it stands for: each samples the same tokens on both paths, and the two differ.
    tokenizer, peft = _model(request, "llama+lora", peft_wrapper=True)
    assert lean_architecture(peft) == "llama"
    ids, mask = _prompts(tokenizer, repeats=2)
    kw = dict(max_new_tokens=12, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
              pad_token_id=tokenizer.pad_token_id, uniforms=sampling_uniforms(5, len(ids), 12))
    policy = sample_responses(peft, ids, mask, **kw).input_ids
    assert policy.equal(sample_responses(peft, ids, mask, lean=False, **kw).input_ids)
    with peft.disable_adapter():
        reference = sample_responses(peft, ids, mask, **kw).input_ids
        assert reference.equal(sample_responses(peft, ids, mask, lean=False, **kw).input_ids)
    assert not reference.equal(policy)


def test_autocast_lean_step_matches_the_forward_step(request):
    # Under bf16 autocast (mixed_precision) the lean step runs the same modules in the same
    # dtypes as the forward: logits agree to bf16 rounding.
    tokenizer, model = _model(request, "llama")
    ids, mask = _prompts(tokenizer)
    positions = position_ids_from_mask(mask)
    token = torch.full((len(ids),), 5)
    alive = torch.ones(len(ids), dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = prefill(model, ids, mask, positions, dedupe=False)
        lean = LeanDecoder.build(model, cache, mask, positions[:, -1:] + 1, 4).step(token, alive)
        _, cache = prefill(model, ids, mask, positions, dedupe=False)
        forward = ModelForward(model, cache, mask, positions[:, -1:] + 1).step(token, alive)
    assert lean.dtype == forward.dtype == torch.bfloat16
    torch.testing.assert_close(lean.float(), forward.float(), rtol=0, atol=8e-3)


def test_prefill_runs_each_distinct_prompt_once(request):
    tokenizer, model = _model(request, "llama")
    ids, mask = _prompts(tokenizer, repeats=4)  # 24 rows, 6 distinct
    positions = position_ids_from_mask(mask)
    batches = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: batches.append(args[0].shape[0]))
    with torch.no_grad():
        logits, cache = prefill(model, ids, mask, positions)
        hook.remove()
        whole, whole_cache = prefill(model, ids, mask, positions, dedupe=False)
    assert batches == [6]
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-6)
    for part, full in zip(cache.layers, whole_cache.layers, strict=True):
        torch.testing.assert_close(part.keys, full.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part.values, full.values, rtol=1e-5, atol=1e-6)


def test_models_the_lean_step_does_not_cover_fall_back(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    tokenizer = load_tokenizer(str(tiny_model_dir))
    gpt2 = load_causal_lm(str(tiny_model_dir), tokenizer)
    assert lean_architecture(gpt2.eval()) == "gpt2"
    assert lean_architecture(gpt2.train()) is None  # dropout on: its draws would differ
    gpt2.eval().config._attn_implementation = "flash_attention_2"
    assert lean_architecture(gpt2) is None
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64)
    neox = AutoModelForCausalLM.from_config(config).eval()
    assert lean_architecture(neox) is None
    ids, mask = _prompts(tokenizer, repeats=2)
    kw = dict(max_new_tokens=6, temperature=1.0, eos_token_ids=[tokenizer.eos_token_id],
              pad_token_id=tokenizer.pad_token_id, uniforms=sampling_uniforms(0, len(ids), 6))
    # The other architecture samples through its own forward, continuing from the cache of the
    # distinct prompts copied to their rows, as the path before does from the whole batch's.
    assert sample_responses(neox, ids, mask, **kw).input_ids.equal(
        sample_responses(neox, ids, mask, lean=False, **kw).input_ids)


def test_fsdp2_sharded_models_keep_the_model_forward():
    # Under FSDP2 a layer's parameters are whole only inside its forward (its hooks gather
    # them), so the lean step, which calls the submodules directly, must not run: one process
    # group of one rank is enough to shard the layers and see the choice.
    import torch.distributed as dist
    from test_distributed_offline import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tether.models.tiny import make_lm
    from tether.run.distributed import transformer_layers

    model = make_lm(50, n_layer=2, n_embd=16, n_head=2).eval()
    assert lean_architecture(model) == "gpt2"
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in transformer_layers(model):
            fully_shard(layer, mesh=mesh)
        assert lean_architecture(model) is None
    finally:
        dist.destroy_process_group()
