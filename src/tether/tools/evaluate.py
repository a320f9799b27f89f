"""`tether eval`: the held-out evaluation PPO runs, on any saved policy.

    policy (any stage's final/, full or LoRA) and its reference, frozen
    prompts -> tether.rl.evaluation.eval_inputs      the one encoding, EOS set, chunking and seed
    tether.rl.evaluation.evaluate_policy             proxy, gold, KL (k1, exact), entropy, ...
    -> <model dir>.eval.json beside the model (never inside it) and a table on stdout

The models are loaded and prepared as PPO prepares its own (dropout off, the fused GELU, eval
mode), and rewards come through the same adapters (tether.rl.reward), so the SFT model evaluated
here with a PPO run's settings gives the numbers that run logged at step 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tether.data.prompts import load_prompts
from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.adapter_checks import read_base_record
from tether.models.base_location import check_base_option, write_json
from tether.models.limits import check_sampled_models
from tether.models.lora import adapter_base, is_adapter
from tether.models.prepare import load_frozen_lm
from tether.models.pretrained import (
    check_same_vocabulary,
    load_tokenizer,
    policy_eos_ids,
)
from tether.models.reward_model import position_limit
from tether.rl.engines import RolloutEngine, check_engine_settings, make_engine
from tether.rl.evaluation import (
    EVAL_SEED_OFFSET,
    Evaluation,
    eval_inputs,
    evaluate_policy,
    measure_responses,
)
from tether.rl.reward import wiring
from tether.rl.sources import longest_prompt, make_source
from tether.run.atomic import read_record
from tether.run.config import config_to_dict
from tether.run.distributed import on_device
from tether.run.launch import resolve_device
from tether.run.paths import check_local_path, recorded_input_path
from tether.run.threads import use_threads
from tether.tools.config import EvalConfig, SamplingConfig
from tether.tools.outputs import check_output, function_file

# The config fields that name a run's starting model, in the order that decides it: an explicit
# reference first (ppo --ref-model, dpo --ref-model), then the policy a PPO run started from,
# then the model an offline stage started from.
STARTING_MODEL_FIELDS = ("ref_model", "policy", "model")


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict]
    output_path: Path | None


def default_reference(model_path: str, base: str = "") -> str:
    """The starting model of the run that wrote `model_path` (runs/<name>/final), read from the
    run's config.yaml; empty when there is none to read. When that is the base of the LoRA
    adapter at `model_path`, the base is where the policy's is found (`base`, else the adapter's
    records), so a run directory that moved with its base, or onto a base passed with --base,
    compares with the same model its policy is built on."""
    config_path = Path(model_path).parent / "config.yaml"
    saved = read_record(config_path)  # None: absent, unreadable or broken
    if not isinstance(saved, dict):  # a list or a scalar records no model, as a broken file
        return ""
    for name in STARTING_MODEL_FIELDS:
        if isinstance(saved.get(name), str) and saved[name]:
            start = recorded_input_path(saved[name], config_path, name)
            return adapter_base(model_path, base) if _is_its_base(model_path, start) else start
    return ""


def _is_its_base(model_path: str, start: str) -> bool:
    """True when `start` (a run's starting model, as config.yaml records it) is the base the
    LoRA adapter at `model_path` was saved on."""
    if not is_adapter(model_path):
        return False
    record = read_base_record(model_path) or {}
    saved_at = record.get("base_absolute") or record.get("base")
    return isinstance(saved_at, str) and os.path.realpath(saved_at) == os.path.realpath(start)


def output_path(cfg: EvalConfig) -> Path:
    """Where the results go (--output, else beside the model directory, named after it:
    runs/x/final -> runs/x/final.eval.json, so the artefact evaluated is never changed, and a
    run's final/ and merged/ each get their own file), checked before any model loads
    (tether.tools.outputs): not a directory, nor a file of the command's inputs, nor inside a
    model directory it reads."""
    check_local_path(cfg.model)  # a typo is named as one, not as a hub name needing --output
    if not cfg.output and not Path(cfg.model).is_dir():
        raise TetherError(f"--model {cfg.model} is not a local directory; pass --output FILE.json")
    model_dir = Path(os.path.abspath(os.path.expanduser(cfg.model)))
    inputs = [("--prompts", cfg.prompts), ("--reward-fn", function_file(cfg.reward_fn)),
              ("--gold-fn", function_file(cfg.gold_fn)), ("--model", cfg.model),
              ("--base", cfg.base),
              ("--reference", cfg.reference or default_reference(cfg.model, cfg.base)),
              ("--reward-model", cfg.reward_model)]
    return check_output(cfg.output or model_dir.with_name(f"{model_dir.name}.eval.json"), inputs,
                        "eval.json")


def checked_reference(cfg: EvalConfig, tokenizer) -> str:
    """The model the KL is measured against: --reference, else the run's starting model
    (`default_reference`), else the policy itself (KL 0); another model must share the policy's
    vocabulary, checked from its tokenizer before any model loads."""
    path = cfg.reference or default_reference(cfg.model, cfg.base) or cfg.model
    if path != cfg.model:
        ref_tokenizer = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
        check_same_vocabulary(tokenizer, {"reference model": (ref_tokenizer, None)})
    return path


def load_policy(cfg: SamplingConfig, tokenizer, device):
    """The policy `cfg.model` (on --base) frozen on `device`, prepared as PPO prepares its own,
    with torch's threads set for it."""
    policy = load_frozen_lm(cfg.model, tokenizer, cfg.dtype, cfg.trust_remote_code, device,
                            base=cfg.base)
    use_threads(cfg.threads, policy, device)
    return policy


def evaluation_source(cfg: SamplingConfig, policy, tokenizer, device, rows: list[dict],
                      episodic: bool, reward, env, tools: list) -> tuple[RolloutEngine, Any]:
    """The engine and the rollout source that sample `policy` as PPO's held-out evaluation does:
    the prompts encoded by `eval_inputs`, or (`episodic`) each row an episode of `env` or
    `tools`, within the model's positions, its environment seeded apart from training's. The
    caller closes both."""
    eos = policy_eos_ids(tokenizer, policy, cfg.model)
    inputs = eval_inputs(tokenizer, cfg.prompts, eos, cfg) if not episodic else None
    limit = position_limit(policy.config, tokenizer) if episodic else None
    engine = make_engine(cfg, policy, d=on_device(device), longest_prompt=longest_prompt(
        cfg, inputs.prompt_ids if inputs else [], limit))
    return engine, make_source(cfg, engine, tokenizer, prompts=inputs.prompts if inputs else [],
                               prompt_ids=inputs.prompt_ids if inputs else [], rows=rows,
                               reward=reward, env=env, tools=tools, eos_token_ids=eos,
                               device=device, source_name=cfg.prompts, context_limit=limit,
                               env_seed_base=cfg.seed + EVAL_SEED_OFFSET)


def run(cfg: EvalConfig, reward_fn: Callable | None = None, gold_fn: Callable | None = None,
        write: bool = True) -> EvalResult:
    """Evaluate `cfg.model`; returns the metrics and samples (also written as JSON when
    `write`). `reward_fn` / `gold_fn`: Python callables instead of --reward-fn / --gold-fn."""
    device = resolve_device(cfg.device)
    check_base_option(cfg.model, cfg.base)
    out = output_path(cfg) if write else None
    with held_out(cfg, device, reward_fn, gold_fn, checked_reference) as (evaluation, measure,
                                                                          gold, reference_path):
        metrics, samples = evaluate_policy(evaluation(cfg.seed + EVAL_SEED_OFFSET), measure, gold)
    if out is not None:
        write_json(out, {"metrics": metrics, "reference": reference_path,
                         "config": config_to_dict(cfg), "samples": samples}, indent=1)
    return EvalResult(metrics, samples, out)


def lengths_only(rollout) -> dict[str, torch.Tensor]:
    """A measure with no KL (tether bon: every response is the model's own sample): lengths and
    EOS flags, the entropy left at 0."""
    mask = rollout.action_mask.float()
    return {"ent": torch.zeros(len(mask)), "len": mask.sum(1).cpu(),
            "eos": rollout.ended.float().cpu()}


@contextmanager
def held_out(cfg: SamplingConfig, device, reward_fn, gold_fn, reference_of=None):
    """What `tether eval` measures with, checked and loaded: yields (the `Evaluation` at a seed,
    the measure, the gold reward, the reference's path); closes the engine and source after.
    `reference_of(cfg, tokenizer)`: the model the KL is measured against; None: none is
    (`lengths_only`, tether bon)."""
    # What needs no model first: a bad function, prompt file or reference fails in seconds.
    user = wiring.user_code(cfg, reward_fn, gold_fn, training=False)
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, base=cfg.base)
    rows = load_rows(cfg.prompts)
    # (prompts checked now; encoded for the run below)
    prompt_ids = [] if cfg.episodic else load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len)[1]
    reference_path = reference_of(cfg, tokenizer) if reference_of else cfg.model
    models = [(cfg.model, "--model", cfg.base)] + ([(reference_path, "--reference", "")]
                                                   if reference_path != cfg.model else [])
    check_sampled_models(models, cfg.reward_model, {cfg.prompts: prompt_ids},
                         max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_new_tokens,
                         episodic=cfg.episodic, trust_remote_code=cfg.trust_remote_code)
    served = wiring.remote(cfg, tokenizer, (cfg.prompts,))  # every endpoint answers first
    if not cfg.episodic:  # what the engine needs of the model, from its config.json
        check_engine_settings(cfg, cfg.base or cfg.model, device=device,
                              longest_prompt=longest_prompt(cfg, prompt_ids),
                              trust_remote_code=cfg.trust_remote_code)
    policy = load_policy(cfg, tokenizer, device)
    measure = lengths_only
    if reference_of:
        reference = load_frozen_lm(reference_path, tokenizer, cfg.dtype, cfg.trust_remote_code,
                                   device, base=cfg.base if reference_path == cfg.model else "")
        measure = partial(measure_responses, policy, reference,
                          chunked_lm_head=cfg.chunked_lm_head)
    # A reward model scores a sampling chunk at a time (PPO: micro-batches of micro_batch_rows,
    # the whole chunk by default; a smaller one may differ in rounding).
    rewards = wiring.build(cfg, user, tokenizer, device, served=served,
                           prompt_files=(cfg.prompts,), chunk=cfg.batch_size)
    engine, source = evaluation_source(cfg, policy, tokenizer, device, rows, cfg.episodic,
                                       rewards.reward or rewards.functions, user.env, user.tools)
    try:
        yield (lambda seed: Evaluation(source, len(rows), cfg.batch_size, seed), measure,
               rewards.gold, reference_path)
    finally:
        source.close()
        engine.close()


def cli(argv: list[str]) -> int:
    """`tether eval --model M --prompts P [--reference R] [--reward-model RM] [--gold-fn mod:f]`."""
    from tether.run.parse import parse_config

    result = run(parse_config(EvalConfig, argv, prog="tether eval"))
    width = max(len(name) for name in result.metrics)  # `metric  value` lines, aligned
    print("\n".join(f"{name:<{width}}  {value:+.4f}" for name, value in result.metrics.items()))
    print(f"written to {result.output_path}")
    return 0
