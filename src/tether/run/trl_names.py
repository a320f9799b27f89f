"""TRL's option names, and what each one is in tether: the hint for a TRL flag or YAML key that
tether does not know (`--num-generations` -> `--samples-per-prompt`).

`ROWS` is the one table; docs/from_trl.md holds the same mapping for people, and
tests/run/test_trl_names.py checks that the two agree. A row is
`(TRL name, TRL value, tether's spelling, note, stages)`:

- TRL value: the row holds only when the user gave this value (`loss_type dr_grpo`); `None` is
  any value. Values are compared lowercased, so YAML's `true` and the CLI's `True` are one.
- tether's spelling: flags as they are typed, ` | ` between alternatives; "" where tether has no
  such option (the note then says what to do instead).
- stages: the commands the row speaks for (`ALL`: any).

A stage takes the first row for its name (the rows for the value given, if there are any, else
the any-value ones) that speaks for it and whose option it has: that is how one TRL name maps to different options by
stage (`num_train_epochs`: `--epochs` offline, `--total-episodes` online). When no row fits, the
hint says that this stage has no such option rather than point to another stage's.
"""

from __future__ import annotations

import re
from typing import NamedTuple

ALL = ("*",)
ONLINE = ("ppo", "rloo", "grpo")
OFFLINE = ("sft", "rm", "dpo")
DOC = "docs/from_trl.md"


class Row(NamedTuple):
    trl: str
    value: str | None
    tether: str
    note: str = ""
    stages: tuple[str, ...] = ALL


_DPO_NOT_BUILT = "its DPO losses are --loss sigmoid and --loss ipo"
_ONE_PASS = ("it never cuts the prompt (one leaving no room is an error, or skipped with "
             "--on-long-prompt skip) and cuts responses at --max-length")

ROWS: tuple[Row, ...] = (
    # ---- every stage: TRL's script arguments and TrainingArguments
    Row("model_name_or_path", None, "--model", "", OFFLINE),
    Row("model_name_or_path", None, "--policy", "", ONLINE),
    Row("model_name_or_path", None, "--model"),  # generate, eval
    Row("dataset_name", None, "--data", "", OFFLINE),
    Row("dataset_name", None, "--prompts", "", ONLINE),
    Row("learning_rate", None, "--lr"),
    Row("per_device_train_batch_size", None, "--batch-size",
        "global: TRL's per-device size x accumulation steps x processes"),
    Row("gradient_accumulation_steps", None, "--grad-accum-steps", "", OFFLINE),
    Row("gradient_accumulation_steps", None, "--micro-batch-size",
        "rows per forward/backward, gradients accumulated over the minibatch", ONLINE),
    Row("num_train_epochs", None, "--epochs", "", OFFLINE),
    Row("num_train_epochs", None, "--total-episodes", "responses sampled over the run", ONLINE),
    Row("warmup_steps", None, "--warmup-batches", "", ONLINE),
    Row("lr_scheduler_type", None, "--lr-schedule", "constant, linear or cosine"),
    Row("logging_steps", None, "--log-every"),
    Row("save_steps", None, "--save-every"),
    Row("eval_steps", None, "--eval-every"),
    Row("resume_from_checkpoint", None, "--resume", "it resumes the run directory's last checkpoint"),
    Row("bf16", "false", "--mixed-precision no"),
    Row("bf16", None, "--mixed-precision bf16"),
    Row("disable_dropout", None, "", "dropout is always off here (--lora-dropout must be 0)",
        ONLINE + ("rm", "dpo")),
    Row("sync_ref_model", None, "", "the reference stays the starting model",
        ONLINE + ("dpo",)),
    # ---- GRPO and RLOO
    Row("num_generations", None, "--samples-per-prompt"),
    Row("max_completion_length", None, "--max-new-tokens"),
    Row("num_iterations", None, "--ppo-epochs"),
    Row("epsilon", None, "--clip-range"),
    Row("epsilon_high", None, "--clip-high",
        "with --policy-loss cispo TRL's epsilon_high e is --clip-high e - 1"),
    Row("importance_sampling_level", "token", "--importance-level token"),
    Row("importance_sampling_level", None, "--importance-level sequence"),
    Row("scale_rewards", "true", "--scale-rewards group"),
    Row("scale_rewards", "false", "--scale-rewards none"),
    *(Row("scale_rewards", name, f"--scale-rewards {name}") for name in ("group", "batch", "none")),
    Row("scale_rewards", None, "--scale-rewards", "group, batch or none"),
    Row("loss_type", "dapo", "--loss-aggregation token",
        "tether grpo's default, with --kl-per-token-mean", ONLINE),
    Row("loss_type", "grpo", "--loss-aggregation sequence", "", ONLINE),
    Row("loss_type", "bnpo", "--loss-aggregation token",
        "under several processes tether's token mean is global", ONLINE),
    Row("loss_type", "dr_grpo", "--loss-aggregation sum",
        "its loss is TRL's times max_completion_length: divide --lr by that under SGD", ONLINE),
    Row("loss_type", "cispo", "--policy-loss cispo",
        "it caps the ratio at 1 + --clip-high: TRL's epsilon_high 5.0 is --clip-high 4", ONLINE),
    *(Row("loss_type", name, "", "not built yet", ONLINE) for name in ("sapo", "vespo", "luspo")),
    *(Row("loss_type", name, f"--loss {name}", "", ("dpo",)) for name in ("sigmoid", "ipo")),
    *(Row("loss_type", name, "", _DPO_NOT_BUILT, ("dpo",))
      for name in ("hinge", "robust", "exo_pair", "bco_pair", "nca_pair", "sppo_hard", "aot",
                   "apo_zero", "apo_down", "discopop")),
    Row("loss_type", "nll", "", "tether sft trains the next-token loss: drop the option", ("sft",)),
    Row("loss_type", "dft", "", "tether sft trains the next-token loss only", ("sft",)),
    Row("loss_type", None, "--loss-aggregation | --policy-loss cispo", "", ONLINE),
    Row("loss_type", None, "--loss", "", ("dpo",)),
    Row("mask_truncated_completions", None, "--mask-truncated"),
    Row("use_bias_correction_kl", None, "--kl-estimator k3_ratio", "the default with --kl-in loss"),
    *(Row(name, None, "", "not built yet", ONLINE)
      for name in ("delta", "normalize_advantages", "top_entropy_quantile")),
    Row("reward_clip_range", None, "--reward-clip", "symmetric, [-c, c], after --score-norm"),
    Row("reward_funcs", None, "--reward-fn FILE.py:FUNCTION | --reward-model MODEL",
        "several functions as --reward-fn a.py:f,b.py:g, summed with --reward-weights"),
    Row("reward_weights", None, "--reward-weights", "one weight per --reward-fn function"),
    Row("reward_processing_classes", None, "--reward-model",
        "it scores with the model's own tokenizer and chat template"),
    *(Row(name, None, "", "it samples plain softmax(z / T), so the log-probs it scores are the "
          "sampler's") for name in ("top_p", "top_k", "min_p", "repetition_penalty")),
    Row("use_vllm", "false", "--engine native"),
    Row("use_vllm", None, "--engine vllm"),
    Row("vllm_mode", "server", "", "tether's vLLM runs colocated (--engine vllm)"),
    Row("vllm_mode", None, "--engine vllm"),
    Row("vllm_gpu_memory_utilization", None, "--engine-kv-cache-mb", "an absolute size in MiB"),
    Row("vllm_enable_sleep_mode", None, "", "it does that by itself on a GPU"),
    Row("vllm_importance_sampling_correction", None, "--engine-is-cap | --engine-mask-kl",
        "both off by default (docs/engine.md)"),
    Row("steps_per_generation", None, "--num-minibatches", "optimizer steps per rollout batch"),
    # ---- SFT
    Row("dataset_text_field", None, "", "{text} rows are read from the column named text"),
    Row("completion_only_loss", None, "",
        "{prompt, completion} rows always train the completion only"),
    Row("assistant_only_loss", None, "",
        "{messages} rows train the assistant turns only (--loss-on all or --loss-on last)"),
    Row("truncation_mode", None, "", _ONE_PASS, OFFLINE),
    *(Row(name, None, "--pack", "each forward on packed rows, attention and positions kept "
          "within each row (docs/scaling.md)") for name in ("packing", "padding_free")),
    *(Row(name, None, "", "it ends responses with the tokenizer's EOS and adds a pad token "
          "that is never an EOS id (docs/loading.md)") for name in ("eos_token", "pad_token")),
    Row("chat_template_path", None, "", "it uses the tokenizer's own chat template: save yours "
        "with the tokenizer"),
    Row("peft_config", None, "--lora-r", "with --lora-alpha and --lora-target-modules"),
    # ---- reward modelling and DPO
    Row("center_rewards_coefficient", None, "--center-rewards-coef"),
    Row("precompute_ref_log_probs", None, "--precompute-ref-logprobs"),
    Row("loss_weights", None, "", "it trains one loss (--loss)", ("dpo",)),
    *(Row(name, None, "", "", ("dpo",))
      for name in ("f_divergence_type", "use_weighting", "ld_alpha")),
)


def options_in(text: str) -> list[str]:
    """The option names (underscored) that `text` spells as flags: '--engine vllm' -> engine."""
    return [flag.replace("-", "_") for flag in re.findall(r"--([a-z][a-z0-9-]*)", text)]


def fits(row: Row, stage: str | None, fields: set[str]) -> bool:
    """A row fits a stage it speaks for when the stage has one of its options (a row without
    options: always). A config without a stage (generate, eval) is judged by its fields alone."""
    if stage is not None and row.stages != ALL and stage not in row.stages:
        return False
    alternatives = [options_in(alt) for alt in row.tether.split(" | ") if alt]
    return not alternatives or any(set(names) <= fields for names in alternatives)


def _candidates(name: str, value: object) -> list[Row]:
    """The rows for this value of `name` when there are any (`loss_type sigmoid` is DPO's even
    in tether grpo), else its any-value rows."""
    given = None if value is None else str(value).strip().strip("\"'").lower()
    rows = [row for row in ROWS if row.trl == name]
    return [row for row in rows if row.value == given] or [row for row in rows if row.value is None]


def hint(name: str, value: object, fields: set[str], stage: str | None, prog: str,
         shown: tuple[str, str], as_key: bool = False) -> str | None:
    """The one-line hint for TRL's `name` (underscored) given `value`, or None when it is not
    one of TRL's names. `shown` is how the user wrote it, without and with its value (a row
    for one value shows it); `as_key` spells tether's options as YAML keys (`engine: vllm`)
    instead of flags (`--engine vllm`)."""
    rows = _candidates(name, value)
    if not rows:
        return None
    said, shown = ("name", shown[0]) if rows[0].value is None else ("setting", shown[1])
    fitting = [row for row in rows if fits(row, stage, fields)]
    if not fitting:  # another stage's option: say so rather than point to it as if it were here
        first = rows[0]
        if not first.tether:
            return f"{shown} is TRL's {said}; {prog} has no such option ({DOC})"
        wanted = " or ".join(_spell(alt, as_key) for alt in first.tether.split(" | "))
        return f"{shown} is TRL's {said} for tether's {wanted}, which {prog} does not have ({DOC})"
    row = fitting[0]
    note = _prose(row.note, as_key)
    if not row.tether:
        return f"{shown} is TRL's {said}; tether has no such option{': ' + note if note else ''} ({DOC})"
    present = " or ".join(_spell(alt, as_key) for alt in row.tether.split(" | ")
                          if set(options_in(alt)) <= fields)
    return f"{shown} is TRL's {said}; tether's is {present}{'; ' + note if note else ''} ({DOC})"


def _spell(option: str, as_key: bool) -> str:
    """One of tether's spellings, '--engine vllm', as a flag or as a YAML key ('engine: vllm')."""
    return _prose(option.replace(" ", ": ", 1), as_key) if as_key else option


def _prose(text: str, as_key: bool) -> str:
    """A note's flags ('--lora-dropout must be 0') as YAML keys ('lora_dropout must be 0')."""
    if not as_key:
        return text
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), text)
