"""Reward models from outside tether: transformers sequence-classification checkpoints with one
label (`AutoModelForSequenceClassification`, e.g. trained by TRL's RewardTrainer), or a peft
adapter for one, scored the way their own training read them.

Such a model brings its own tokenizer and chat template, so it never reads the policy's ids: each
(prompt, response) is rendered as text and tokenised by the reward model's tokenizer.

    prompt            reward model           the text it reads
    chat messages     with a chat template   template(messages + [assistant: response])
    plain text        with a chat template   template([user: prompt, assistant: response])
    plain text        no chat template       prompt + response + EOS
    chat messages     no chat template       an error at start-up (nothing to render them with)

A rendered chat is tokenised without special tokens (the template writes its own, BOS included);
plain text with the tokenizer's special tokens and EOS appended. This is TRL's RewardTrainer's
tokenisation (trl/trainer/reward_trainer.py: `apply_chat_template` for conversational rows, the
tokenizer plus an appended EOS otherwise), the way most hub reward models were trained.

The score is the model's own forward, `model(input_ids, attention_mask).logits[:, 0]`, which reads
the head at the last token that is not `config.pad_token_id`. Rows are padded on the right with
that id: a causal model's real tokens then see exactly what they see unpadded (left padding would
shift absolute positions such as GPT-2's), so a batch scores each text as it scores alone. A
config without a pad id reads a single row's last token; a batch is then padded with an id no row
ends with, which reads the same token. A text longer than the model can read (its position limit
or its tokenizer's `model_max_length`) is an error, never a silent cut.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from tether.data.batches import pad_sequences
from tether.data.chat import is_messages, render_chat
from tether.errors import TetherError
from tether.models.adapter_checks import check_adapter_files
from tether.models.lora import ADAPTER_CONFIG, TRAINED, adapter_base, is_adapter, load_adapter
from tether.models.pretrained import _check_exists, _from_pretrained
from tether.models.reward_model import LOWER_LENGTHS, REWARD_JSON, position_limit
from tether.run.config import ENSEMBLE_JSON, ensemble_members, is_ensemble

CLASSIFIER = "classifier"  # reward_model_kind: a sequence-classification checkpoint
CLASSIFIER_ADAPTER = "classifier adapter"  # a peft adapter for one
TETHER = "tether"  # written by `tether rm`
NOT_A_REWARD_MODEL = ("train one with `tether rm`, or pass an AutoModelForSequenceClassification "
                      "checkpoint with num_labels=1")


def _config(name_or_path: str, trust_remote_code: bool):
    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        fix = ("pass --trust-remote-code if you trust its code" if "trust_remote_code" in first
               else NOT_A_REWARD_MODEL)
        raise TetherError(f"cannot read the reward model's config at {name_or_path} "
                          f"({type(exc).__name__}: {first}); {fix}") from None


def _a_file(name: str, local: Path) -> str:
    """The line for a --reward-model that names a file (a weights file, config.json, a script)."""
    fix = (f"a Python reward function goes to --reward-fn {name}:FUNCTION" if local.suffix == ".py"
           else f"pass the directory that holds it ({local.parent}) if that is the model")
    return (f"--reward-model {name} is a file; a reward model is a directory (a `tether rm` "
            f"run's final/, or a sequence classifier saved with save_pretrained): {fix}")


def reward_model_kind(name_or_path: str, trust_remote_code: bool = False) -> str:
    """`TETHER` (a directory `tether rm` wrote), `CLASSIFIER` (a sequence-classification
    checkpoint with one label) or `CLASSIFIER_ADAPTER` (a peft adapter of task SEQ_CLS); anything
    else is one TetherError line saying what was found and what to pass."""
    local = Path(name_or_path).expanduser()
    if (local / REWARD_JSON).is_file():
        return TETHER
    if is_ensemble(name_or_path):
        raise TetherError(f"{name_or_path} is an ensemble of reward models ({ENSEMBLE_JSON}), "
                          "which --reward-model reads; serve or load one of its members")
    _check_exists(name_or_path)
    if local.is_file():  # read as a config.json, a file gives a line about its contents
        raise TetherError(_a_file(name_or_path, local))
    if is_adapter(local):
        meta = json.loads((local / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        if meta.get("task_type") != "SEQ_CLS":
            raise TetherError(f"{name_or_path} is a peft adapter of task "
                              f"{meta.get('task_type') or 'unknown'}, not a reward model (no "
                              f"{REWARD_JSON}, not SEQ_CLS); {NOT_A_REWARD_MODEL}")
        return CLASSIFIER_ADAPTER
    config = _config(name_or_path, trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        found = ", ".join(architectures) or f"a {config.model_type} model of unknown class"
        raise TetherError(f"{name_or_path} is not a reward model: it has no {REWARD_JSON} (what "
                          f"`tether rm` writes) and is {found}, not a sequence-classification "
                          f"model; {NOT_A_REWARD_MODEL}")
    if config.num_labels != 1:
        raise TetherError(f"{name_or_path} is a sequence-classification model with "
                          f"{config.num_labels} labels; a reward model gives one score "
                          "(num_labels=1): for a classifier, turn its labels into one number in a "
                          "--reward-fn")
    return CLASSIFIER


def classifier_tokenizer(name: str, trust_remote_code: bool):
    """The tokenizer of the sequence-classification checkpoint `name` (`_tokenizer`), its ids
    checked to be within the model's embedding rows (`vocab_size`; more rows than ids, as Qwen2
    has, is fine): an id past them is an IndexError at the first batch that holds it."""
    tokenizer = _tokenizer(name, trust_remote_code)
    rows = _config(name, trust_remote_code).get_text_config().vocab_size
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise TetherError(f"reward model {name}: its tokenizer has {len(tokenizer)} tokens but "
                          f"the model has {rows} embedding rows (vocab_size in its config.json), "
                          f"so ids from {rows} on would index no row; save the tokenizer it was "
                          "trained with beside it, or resize its embeddings to the tokenizer "
                          "(model.resize_token_embeddings(len(tokenizer))) and save it again")
    return tokenizer


def check_reward_model(name_or_path: str, trust_remote_code: bool = False) -> str:
    """`reward_model_kind`, and for a sequence-classification checkpoint its tokenizer against its
    embedding rows: what a stage checks before any weights load."""
    if members := ensemble_members(name_or_path):
        # each member checked, and all of them on one base
        kinds = [check_reward_model(member, trust_remote_code) for member in members]
        bases = {_base(member, trust_remote_code): member for member in members}
        if len(bases) > 1:
            (one, first), (other, second) = list(bases.items())[:2]
            raise TetherError(f"the reward-model ensemble {name_or_path} mixes bases: {first} is "
                              f"{one}, {second} is {other}; train its members on one base "
                              "(tether rm --ensemble K does)")
        return kinds[0]
    kind = reward_model_kind(name_or_path, trust_remote_code)
    if kind == CLASSIFIER:
        classifier_tokenizer(name_or_path, trust_remote_code)
    return kind


def _base(member: str, trust_remote_code: bool) -> str:
    """What an ensemble member is built on: its LoRA base, or its architecture and sizes."""
    if is_adapter(member):
        return f"a LoRA adapter on {adapter_base(member)}"
    text = _config(member, trust_remote_code).get_text_config()
    return (f"a {text.model_type} of {text.num_hidden_layers} layers, width {text.hidden_size}, "
            f"{text.vocab_size} tokens")


def _tokenizer(name_or_path: str, trust_remote_code: bool):
    """The reward model's tokenizer as saved: no pad token added (it would be an id the model has
    no embedding for); padding is chosen at scoring time instead."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise TetherError(f"cannot load the reward model's tokenizer from {name_or_path} "
                          f"({first}); save the tokenizer beside the model") from None
    if len(tokenizer) < 8 or not tokenizer("a b c", add_special_tokens=False)["input_ids"]:
        raise TetherError(f"{name_or_path} has no usable tokenizer (vocabulary of "
                          f"{len(tokenizer)} tokens); save the tokenizer beside the model")
    return tokenizer


def load_hub_reward_model(name_or_path: str, dtype: str = "float32",
                          trust_remote_code: bool = False) -> HubRewardModel:
    """A sequence-classification reward model as it is saved (safetensors; its code only with
    `trust_remote_code`); a peft adapter for one is merged into its base."""
    kind = reward_model_kind(name_or_path, trust_remote_code)
    if kind == TETHER:
        raise TetherError(f"{name_or_path} is a tether reward model; load it with "
                          "RewardModel.from_pretrained")
    if kind == CLASSIFIER:
        tokenizer = classifier_tokenizer(name_or_path, trust_remote_code)
        model = _from_pretrained(AutoModelForSequenceClassification, "the reward model",
                                 name_or_path, dtype, trust_remote_code)
        return HubRewardModel(model, tokenizer, name_or_path)
    check_adapter_files(name_or_path)  # before its base is read
    base = adapter_base(name_or_path)
    try:  # the adapter's own tokenizer (it may have added a pad token), else its base's
        tokenizer = _tokenizer(name_or_path, trust_remote_code)
    except TetherError:
        tokenizer = _tokenizer(base, trust_remote_code)
    _check_exists(base)
    # a causal LM base under a reward adapter gets a one-score head, as TRL's RewardTrainer built
    # it (`num_labels=1`)
    model = _from_pretrained(AutoModelForSequenceClassification, "the reward adapter's base model",
                             base, dtype, trust_remote_code, num_labels=1)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    merged = load_adapter(model, name_or_path, TRAINED).merge_and_unload()
    return HubRewardModel(merged, tokenizer, name_or_path)


class HubRewardModel(nn.Module):
    """A sequence-classification model and its tokenizer, scoring (prompt, response) texts as the
    module docstring says. `backbone` and `head` (its trunk and a one-output `score`, when it has
    them) let a critic start from it."""

    def __init__(self, model: nn.Module, tokenizer, name: str):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_length = position_limit(model.config, tokenizer)

    @property
    def backbone(self) -> nn.Module:
        return self.model.base_model

    @property
    def head(self) -> nn.Linear | None:
        score = getattr(self.model, "score", None)
        return score if isinstance(score, nn.Linear) and score.out_features == 1 else None

    def encode(self, prompt: str | list[dict], response: str) -> list[int]:
        """The ids the reward model reads for one (prompt, response): see the module table."""
        tokenizer = self.tokenizer
        if is_messages(prompt) or getattr(tokenizer, "chat_template", None):
            turns = list(prompt) if is_messages(prompt) else [{"role": "user", "content": prompt}]
            text = render_chat(tokenizer, turns + [{"role": "assistant", "content": response}],
                               add_generation_prompt=False, where=f"reward model {self.name}")
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        text = prompt + response
        eos = tokenizer.eos_token
        if eos and not text.endswith(eos):
            text += eos
        return tokenizer(text)["input_ids"]

    def _pad_id(self, rows: list[list[int]]) -> tuple[int, bool]:
        """(the id to pad with, whether it is the config's own). Without one in the config, the
        smallest id no row ends with: the head is then read at each row's last token, as
        transformers reads a single unpadded row."""
        configured = self.model.config.get_text_config().pad_token_id
        if configured is not None:
            return configured, True
        last = {ids[-1] for ids in rows}
        return next(i for i in itertools.count() if i not in last), False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw scores `[B]`: the model's own forward, its one logit."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()

    def _score_rows(self, rows: list[list[int]]) -> torch.Tensor:
        pad, configured = self._pad_id(rows)
        # right padding (see the module docstring): each row a prompt with an empty response
        batch = pad_sequences(rows, [[] for _ in rows], pad)
        device = next(self.model.parameters()).device
        config = self.model.config.get_text_config()
        if not configured:  # transformers finds the read position through the config's pad id
            config.pad_token_id = pad
        try:
            return self(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        finally:
            if not configured:
                config.pad_token_id = None

    @torch.no_grad()
    def score_texts(self, prompts: list, responses: list[str], batch_size: int = 16,
                    too_long: str = LOWER_LENGTHS) -> torch.Tensor:
        """Scores `[N]` of (prompt, response) pairs, `batch_size` rows per forward; a prompt is a
        string or a list of chat messages. A row past the model's positions is one line ending
        in `too_long` (the fix the caller can give)."""
        rows = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        for i, ids in enumerate(rows):
            if self.max_length is not None and len(ids) > self.max_length:
                raise TetherError(f"reward model {self.name}: prompt + response {i} is {len(ids)} "
                                  f"tokens under its tokenizer, more than the {self.max_length} "
                                  f"it can read; {too_long}")
        return torch.cat([self._score_rows(rows[start:start + batch_size])
                          for start in range(0, len(rows), batch_size)])
