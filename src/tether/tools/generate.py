"""`tether generate`: sample responses to prompts from any saved policy, as JSONL.

Prompts are encoded by the rule every stage uses and responses end on every EOS the tokenizer
and model declare (tether.rl.evaluation.eval_inputs), sampled plainly at the temperature (no top-k
or top-p), seeded: what PPO would have sampled from this policy, to read or to score elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tether.data.prompts import left_pad, load_prompts
from tether.models.prepare import load_frozen_lm
from tether.models.pretrained import load_tokenizer, policy_eos_ids
from tether.rl.engines import RolloutEngine, make_engine
from tether.rl.evaluation import eval_inputs
from tether.rl.rollout import apply_stop_strings, decode_responses
from tether.run.checkpoint import atomic_write_bytes
from tether.run.distributed import on_device
from tether.run.launch import resolve_device
from tether.run.threads import use_threads
from tether.tools.config import GenerateConfig
from tether.tools.outputs import check_output


@torch.no_grad()
def generate(cfg: GenerateConfig) -> list[dict]:
    """One row {prompt, response, sample, ended, length} per sample, `samples_per_prompt`
    consecutive rows per prompt, in prompt order."""
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)  # a bad file fails before the model
    policy = load_frozen_lm(cfg.model, tokenizer, cfg.dtype, cfg.trust_remote_code, device)
    use_threads(cfg.threads, policy, device)
    inputs = eval_inputs(tokenizer, cfg.prompts, policy_eos_ids(tokenizer, policy, cfg.model), cfg)
    # One sample of each prompt per draw uses the evaluation's stream: sample 0 is what
    # `tether eval` scores with the same settings.
    gen = torch.Generator(device).manual_seed(inputs.seed)
    engine = make_engine(cfg, policy, prompt_ids=inputs.prompt_ids, d=on_device(device))
    try:
        by_prompt = _sample_all(cfg, tokenizer, engine, inputs, gen, device)
    finally:
        engine.close()
    return [row for group in by_prompt for row in group]


def _sample_all(cfg: GenerateConfig, tokenizer, engine: RolloutEngine, inputs,
                gen: torch.Generator, device) -> list[list[dict]]:
    """Each prompt's rows, `samples_per_prompt` draws of every chunk of prompts."""
    pad = tokenizer.pad_token_id
    by_prompt: list[list[dict]] = [[] for _ in inputs.prompts]
    for sample in range(cfg.samples_per_prompt):
        for start in range(0, len(inputs.prompts), cfg.batch_size):
            ids, mask = left_pad(inputs.prompt_ids[start:start + cfg.batch_size], pad, device)
            rollout = engine.sample(ids, mask, max_new_tokens=cfg.max_new_tokens,
                                    temperature=cfg.temperature,
                                    eos_token_ids=inputs.eos_token_ids, pad_token_id=pad,
                                    generator=gen)
            rollout = apply_stop_strings(rollout, tokenizer, cfg.stop_strings, pad)
            texts = decode_responses(tokenizer, rollout)
            lengths = rollout.action_mask.sum(1).tolist()
            for offset, text in enumerate(texts):
                i = start + offset
                by_prompt[i].append({"prompt": inputs.prompts[i], "response": text,
                                     "sample": sample, "ended": bool(rollout.ended[offset]),
                                     "length": int(lengths[offset])})
    return by_prompt


def cli(argv: list[str]) -> int:
    """`tether generate --model M --prompts P [--output FILE.jsonl] [--samples-per-prompt K]`."""
    from tether.run.parse import parse_config

    cfg = parse_config(GenerateConfig, argv, prog="tether generate")
    if cfg.output:  # before the model loads: never a directory, the prompts or a model file
        check_output(cfg.output, [("--prompts", cfg.prompts), ("--model", cfg.model)],
                     "generations.jsonl")
    rows = generate(cfg)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if cfg.output:
        atomic_write_bytes(Path(cfg.output), text.encode("utf-8"))
        print(f"{len(rows)} responses written to {cfg.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
