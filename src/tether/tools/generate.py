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

from tether.data.prompts import load_prompts
from tether.data.rows import load_rows
from tether.models.base_location import check_base_option
from tether.models.limits import check_sampled_models
from tether.models.pretrained import load_tokenizer, policy_eos_ids
from tether.rl.engines import RolloutEngine, check_engine_settings, make_engine
from tether.rl.env.load import load_environment
from tether.rl.evaluation import EVAL_SEED_OFFSET, eval_inputs
from tether.rl.rollout import apply_stop_strings, decode_responses, left_pad
from tether.rl.sources import load_tools
from tether.run.atomic import atomic_write_bytes
from tether.run.distributed import on_device
from tether.run.launch import resolve_device
from tether.tools.config import GenerateConfig
from tether.tools.evaluate import evaluation_source, load_policy
from tether.tools.outputs import check_output

SAMPLE_SEED_STRIDE = 1_000_003  # sample s of an episode draws the noise of seed + s strides


@torch.no_grad()
def generate(cfg: GenerateConfig) -> list[dict]:
    """One row {prompt, response, sample, ended, length} per sample, `samples_per_prompt`
    consecutive rows per prompt, in prompt order; with an environment (--env or --tools) one row
    per episode (`tether.rl.env.episodes.record`, with its row and sample)."""
    device = resolve_device(cfg.device)
    check_base_option(cfg.model, cfg.base)
    env = load_environment(cfg.env, cfg.max_turns) if cfg.env else None  # before any model loads
    tools = load_tools(cfg.tools)
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, base=cfg.base)
    episodic = env is not None or bool(tools)
    # a bad file, prompts too long for the model or engine settings it cannot run with fail
    # before the model loads
    prompt_ids = [] if episodic else load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)[1]
    check_sampled_models([(cfg.model, "--model", cfg.base)], "", {cfg.prompts: prompt_ids},
                         max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_new_tokens,
                         episodic=episodic, trust_remote_code=cfg.trust_remote_code,
                         takes_reward_model=False)
    if episodic:
        return _episodes(cfg, tokenizer, env, tools, device)
    check_engine_settings(cfg, cfg.base or cfg.model, longest_prompt=max(map(len, prompt_ids)),
                          device=device, trust_remote_code=cfg.trust_remote_code)
    policy = load_policy(cfg, tokenizer, device)
    inputs = eval_inputs(tokenizer, cfg.prompts, policy_eos_ids(tokenizer, policy, cfg.model), cfg)
    # One sample of each prompt per draw uses the evaluation's stream: sample 0 is what
    # `tether eval` scores with the same settings.
    gen = torch.Generator(device).manual_seed(inputs.seed)
    engine = make_engine(cfg, policy, longest_prompt=max(map(len, inputs.prompt_ids)),
                         d=on_device(device))
    try:
        return _sample_all(cfg, tokenizer, engine, inputs, gen, device)
    finally:
        engine.close()


def _sample_all(cfg: GenerateConfig, tokenizer, engine: RolloutEngine, inputs,
                gen: torch.Generator, device) -> list[dict]:
    """Each prompt's rows, `samples_per_prompt` draws of every chunk of prompts, prompt after
    prompt."""
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
            lengths = rollout.action_mask.sum(1).tolist()
            for offset, text in enumerate(decode_responses(tokenizer, rollout)):
                i = start + offset
                by_prompt[i].append({"prompt": inputs.prompts[i], "response": text,
                                     "sample": sample, "ended": bool(rollout.ended[offset]),
                                     "length": int(lengths[offset])})
    return [row for group in by_prompt for row in group]


def _episodes(cfg: GenerateConfig, tokenizer, env, tools: list, device) -> list[dict]:
    """Every prompt row's `samples_per_prompt` episodes, each sample drawing its own noise; the
    environment seeds follow the rows (sample s of a row meets the environment sample 0 met)."""
    rows = load_rows(cfg.prompts)
    policy = load_policy(cfg, tokenizer, device)
    engine, source = evaluation_source(cfg, policy, tokenizer, device, rows, True, None, env,
                                       tools)
    indices = list(range(len(rows)))
    out: list[list[dict]] = [[] for _ in rows]
    try:
        for sample in range(cfg.samples_per_prompt):
            for start in range(0, len(rows), cfg.batch_size):
                part = source.collect(indices, slice(start, start + cfg.batch_size),
                                      cfg.seed + EVAL_SEED_OFFSET + sample * SAMPLE_SEED_STRIDE)
                for offset, record in enumerate(part.records):
                    if tools:  # generate gives --tools no reward function: no reward to write
                        record |= {"reward": None, "turn_rewards": None}
                    out[start + offset].append({"row": start + offset, "sample": sample} | record)
    finally:
        source.close()
        engine.close()
    return [record for group in out for record in group]


def cli(argv: list[str]) -> int:
    """`tether generate --model M --prompts P [--output FILE.jsonl] [--samples-per-prompt K]`."""
    from tether.run.parse import parse_config

    cfg = parse_config(GenerateConfig, argv, prog="tether generate")
    if cfg.output:  # before the model loads: never a directory, the prompts or a model file
        check_output(cfg.output, [("--prompts", cfg.prompts), ("--model", cfg.model),
                                  ("--base", cfg.base)],
                     "generations.jsonl")
    rows = generate(cfg)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if cfg.output:
        atomic_write_bytes(Path(cfg.output), text.encode("utf-8"))
        what = "episodes" if cfg.env or cfg.tools else "responses"
        print(f"{len(rows)} {what} written to {cfg.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
