"""What a saved model can take, read from its config.json before any weights load (issue 33):
whether it is a language model at all, and how many positions it reads.

A sequence classifier (a reward model) loaded as a causal LM loses its head and gets a random LM
head in its place: training or sampling it runs on, exit 0, with only transformers' load table as
a sign. Where a stage needs a language model, a classifier is refused by its config's
`architectures`, a tether reward model by its `tether_reward.json`, a peft adapter by its
`task_type` (the reverse mix-up is `tether.models.hub_reward.reward_model_kind`'s).

A sequence longer than the positions fails deep inside a forward: GPT-2's learned position table
has `n_positions` rows, so a longer row is an IndexError mid-training or mid-sampling. A rotary
model (Llama, Qwen2, Mistral) would run on, but past `max_position_embeddings` it reads positions
it was never trained on (its attention degrades without a word), so both are refused alike. A
declared rope scaling (YaRN, linear, dynamic, Llama 3's) extends the limit to its factor times
`original_max_position_embeddings`, as the long-context recipes in the model cards configure it.

The stages' lengths are what they will actually feed the model (the longest encoded row, the
longest encoded prompt plus --max-new-tokens), not the options alone: the defaults (--max-length
512, --max-prompt-len 256) are caps that short data never reaches, on models of any size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from tether.errors import TetherError
from tether.models.lora import ADAPTER_CONFIG, adapter_base, is_adapter
from tether.models.reward_model import REWARD_JSON
from tether.run.config import ensemble_members


class Positions(NamedTuple):
    """The longest sequence `model` (as the user named it) reads, and the config field(s) that
    say so, for the error line."""

    model: str
    limit: int
    field: str


def saved_config(name_or_path: str, trust_remote_code: bool = False, base: str = ""):
    """The model's config (an adapter's: its base's), or None when it cannot be read: the load
    that follows then reports the problem in its own words."""
    from transformers import AutoConfig

    try:
        model_dir = adapter_base(name_or_path, base) if is_adapter(name_or_path) else name_or_path
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TetherError):
        return None


def positions(config, model: str) -> Positions | None:
    """`model`'s position limit from its `config` (None when it declares none, or `config` is
    None: no check)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # GPT-2 calls it n_positions; transformers maps max_position_embeddings onto it
    field = getattr(text, "attribute_map", {}).get("max_position_embeddings",
                                                   "max_position_embeddings")
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or not 0 < limit < 10**12:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings") or limit
        if int(factor * original) > limit:
            return Positions(model, int(factor * original),
                             f"{field} x rope_scaling factor {factor:g}")
    return Positions(model, limit, field)


def _not_a_language_model(name_or_path: str, trust_remote_code: bool, base: str):
    """What `name_or_path` is when it is a reward model or classifier (else None), and its
    config (None for an adapter or an unreadable one)."""
    local = Path(name_or_path).expanduser()
    if (local / REWARD_JSON).is_file():
        return f"a tether reward model (it has {REWARD_JSON}, what `tether rm` writes)", None
    if is_adapter(local):
        try:
            task = json.loads((local / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("task_type")
        except (OSError, ValueError, AttributeError):  # the adapter checks report a bad file
            task = None
        if task == "SEQ_CLS":
            return ("a peft adapter of task SEQ_CLS (a reward model or classifier), not "
                    "CAUSAL_LM"), None
    config = saved_config(name_or_path, trust_remote_code, base)
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and all(a.endswith("ForSequenceClassification") for a in architectures):
        return (f"{', '.join(architectures)}, a sequence-classification model (a reward model "
                "or classifier) with no LM head"), config
    return None, config


def language_model(name_or_path: str, option: str, *, trust_remote_code: bool = False,
                   base: str = "", takes_reward_model: bool = False) -> Positions | None:
    """Refuse a reward model or classifier given as `option` (where a causal LM is needed), from
    its config alone; return its positions (None when unknown). `takes_reward_model`: the stage
    has --reward-model, where such a model belongs."""
    what, config = _not_a_language_model(name_or_path, trust_remote_code, base)
    if what is not None:
        fix = (f"pass it as --reward-model, and a causal LM (e.g. the SFT model) as {option}"
               if takes_reward_model else
               f"pass a causal LM (e.g. the SFT model) as {option}; a reward model scores in "
               "tether ppo, rloo, grpo and eval (--reward-model)")
        raise TetherError(f"{option} {name_or_path} is not a language model: it is {what}; {fix}")
    return positions(config, name_or_path)


def model_positions(name_or_path: str, trust_remote_code: bool = False, base: str = ""
                    ) -> Positions | None:
    """The positions of any model (None when unknown), whatever its head."""
    return positions(saved_config(name_or_path, trust_remote_code, base), name_or_path)


def _tightest(models: Sequence[Positions | None], needed: int) -> Positions | None:
    """The model with the fewest positions among those `needed` tokens overrun (None: all fit)."""
    over = [m for m in models if m is not None and m.limit < needed]
    return min(over, key=lambda m: m.limit) if over else None


def _of(model: Positions) -> str:
    return (f"the {model.limit} positions of model {model.model} ({model.field} in its "
            "config.json)")


def longest_row(examples) -> int:
    """The most positions an encoded example (`tether.data.encoding.Encoded`) takes: its prompt
    and its longer response (DPO's shared row puts both responses at the same positions)."""
    return max((len(e.prompt) + max(map(len, e.responses)) for e in examples), default=0)


def check_rows_fit(models: Sequence[Positions | None], longest_row: int, max_length: int,
                   source: str) -> None:
    """SFT, RM and DPO: every encoded row (prompt and response, cut to --max-length) within the
    positions of each model that reads it."""
    model = _tightest(models, longest_row)
    if model is not None:
        raise TetherError(f"--max-length {max_length} lets rows of {source} reach {longest_row} "
                          f"tokens, more than {_of(model)}; lower --max-length to at most "
                          f"{model.limit}")


def check_samples_fit(models: Sequence[Positions | None], longest_prompt: int,
                      max_prompt_len: int, max_new_tokens: int, source: str) -> None:
    """Sampling: the longest encoded prompt (cut to --max-prompt-len) plus --max-new-tokens
    within the positions of each model that reads a sample (policy, reference, reward model)."""
    needed = longest_prompt + max_new_tokens
    model = _tightest(models, needed)
    if model is None:
        return
    limit, fixes = model.limit, []
    if longest_prompt < limit:
        fixes.append(f"--max-new-tokens to at most {limit - longest_prompt}")
    if max_new_tokens < limit:
        fixes.append(f"--max-prompt-len to at most {limit - max_new_tokens}")
    fixes = fixes or [f"--max-prompt-len and --max-new-tokens to at most {limit} together"]
    raise TetherError(f"the longest prompt of {source} ({longest_prompt} tokens, --max-prompt-len "
                      f"{max_prompt_len}) plus --max-new-tokens {max_new_tokens} is {needed} "
                      f"tokens, more than {_of(model)}; lower {' or '.join(fixes)}")


def check_turn_fits(models: Sequence[Positions | None], max_new_tokens: int) -> None:
    """Episodes: contexts are kept within the positions as they grow (`tether.rl.sources`), but
    one turn of --max-new-tokens after a prompt of at least one token must fit."""
    model = _tightest(models, max_new_tokens + 1)
    if model is not None:
        raise TetherError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt within "
                          f"{_of(model)}; lower --max-new-tokens to at most {model.limit - 1}")


def check_sampled_models(language_models: Sequence[tuple[str, str, str]], reward_model: str,
                         prompt_sets: dict[str, Sequence[Sequence[int]]], *, max_prompt_len: int,
                         max_new_tokens: int, episodic: bool, trust_remote_code: bool = False,
                         takes_reward_model: bool = True) -> None:
    """What the models' configs alone can refuse before any weights load, for every command that
    samples (the online stages, `tether eval`, `tether generate`): a reward model or classifier
    given where a causal LM belongs (`language_models`: (path, its option, its base) each), and
    samples longer than a model that reads them can take: each set's longest prompt plus
    --max-new-tokens (`prompt_sets`: source -> its encoded prompts), one turn for episodes."""
    models = [language_model(path, option, trust_remote_code=trust_remote_code, base=base,
                             takes_reward_model=takes_reward_model)
              for path, option, base in language_models]
    # a tether reward model reads the policy's ids as they are; a hub classifier re-tokenises
    # the text and checks each row as it scores
    for member in ensemble_members(reward_model) or [reward_model]:  # each of an ensemble
        if member and (Path(member).expanduser() / REWARD_JSON).is_file():
            models.append(model_positions(member, trust_remote_code))
    if episodic:
        check_turn_fits(models, max_new_tokens)
    for source, ids in prompt_sets.items():
        if ids:
            check_samples_fit(models, max(map(len, ids)), max_prompt_len, max_new_tokens, source)
