"""The reward model: a causal LM's trunk plus a scalar head read at the last non-pad token.

Saved in the format the ecosystem reads (`tether-reward-v2`): a transformers sequence-
classification checkpoint with one label (`XForSequenceClassification`: the trunk and the head as
`score`), or with LoRA a peft adapter for that model (the head as its `modules_to_save`), plus
`tether_reward.json`, the score normalisation that tether applies on top:

    transformers: AutoModelForSequenceClassification(...)(ids).logits[:, 0] = raw score
    tether:       RewardModel.score(...)                                = (raw - mean) / std

Directories written before v2 (the trunk, `reward_head.safetensors` with a bias, the json) load
as before.

As PPO's reward: a LoRA reward model trained on the policy's base (`tether rm --lora-r ...`) joins
the policy's PeftModel as the frozen adapter "reward" plus its scalar head (`shared_reward_model`:
one copy of the base in memory); a reward model on another base, or a fully fine-tuned one, stays
a separate model (`RewardModel.from_pretrained`: it cannot share weights it does not have).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForSequenceClassification

from tether.data.batches import collate_sft
from tether.data.encoding import encode_sft
from tether.errors import TetherError
from tether.models.adapter_checks import (
    ADAPTER_WEIGHTS,
    check_adapter_files,
    check_base,
    remembered_base,
)
from tether.models.base_location import local_or_hub, write_json
from tether.models.forward import last_real, position_ids_from_mask, shared_last_hidden, sharing
from tether.models.lora import (
    ADAPTER_CONFIG,
    TRAINED,
    AdapterView,
    LoraSpec,
    adapter_base,
    is_adapter,
    load_adapter,
    set_trainable,
)
from tether.models.packed import packed_final_hidden
from tether.models.pretrained import (
    TrainableLM,
    _from_pretrained,
    _load_for_tokenizer,
    check_same_vocabulary,
    load_adapter_base,
    load_causal_lm,
    load_tokenizer,
    load_trainable_lm,
)
from tether.models.saving import atomic_dir, save_adapter
from tether.run.checkpoint import check_finite_weights

LOWER_LENGTHS = "lower --max-prompt-len or --max-new-tokens"  # a too-long row's fix, in a run
REWARD_JSON = "tether_reward.json"
REWARD_FORMAT = "tether-reward-v2"
REWARD_HEAD = "reward_head.safetensors"  # before v2: the head (weight and bias) beside the trunk
# Where peft keeps a sequence-classification head it trains in full (`modules_to_save`)
ADAPTER_SCORE = "base_model.model.score.weight"
REWARD = "reward"  # the frozen adapter of a LoRA reward model on the policy's shared base


class RewardModel(nn.Module):
    """A causal LM's trunk plus a linear head; the score is read at the last non-pad token.

    `forward` returns raw scores; `score` applies the stored normalisation `(raw - mean) / std`
    (identity until `set_normalization` is called), so a normalised model keeps its meaning when
    reloaded.

    The head has no bias, like transformers' `score`: under Bradley-Terry a bias gets exactly zero
    gradient (it cancels in r_c - r_r), so it only ever held its initial 0, and the saved head is
    then the sequence-classification model's own. Heads loaded from before v2 keep their bias.
    """

    def __init__(self, backbone: nn.Module, tokenizer=None, lora: TrainableLM | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        self.head = nn.Linear(hidden, 1, bias=False)
        self.tokenizer = tokenizer
        self.norm_mean, self.norm_std = 0.0, 1.0
        # With LoRA the trunk lives inside a PeftModel over the causal LM (so the adapter's layer
        # names match a policy's on the same base, which can then share it in PPO).
        self.lora = lora
        self.head.to(backbone.dtype)

    # ------------------------------------------------------------------ construction and I/O
    @classmethod
    def from_causal_lm(cls, name_or_path: str, tokenizer, dtype: str = "float32",
                       trust_remote_code: bool = False, lora: LoraSpec | None = None) -> RewardModel:
        """A fresh reward model on the trunk of a causal LM (e.g. the SFT model); the head starts
        near zero so the first scores are near zero. With `lora`, the trunk trains a LoRA adapter
        (see `load_trainable_lm`)."""
        if lora is not None:
            lm = load_trainable_lm(name_or_path, tokenizer, lora, dtype, trust_remote_code)
            model = cls(lm.model.base_model, tokenizer, lora=lm)
        elif is_adapter(name_or_path):
            merged = load_causal_lm(name_or_path, tokenizer, dtype, trust_remote_code)
            model = cls(merged.base_model, tokenizer)
        else:
            model = cls(_load_for_tokenizer(AutoModel, "a model trunk", local_or_hub(name_or_path),
                                            tokenizer, dtype, trust_remote_code), tokenizer)
        nn.init.normal_(model.head.weight, std=1.0 / (model.head.in_features + 1) ** 0.5)
        return model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "float32",
                        trust_remote_code: bool = False) -> RewardModel:
        """Load a reward model written by `save_pretrained` (trunk, head, normalisation,
        tokenizer), in the v2 format or the one before it."""
        path = Path(path)
        if not (path / REWARD_JSON).is_file():
            raise TetherError(f"{path} is not a tether reward model (no {REWARD_JSON}); train one "
                              "with `tether rm`")
        tokenizer = load_tokenizer(str(path), trust_remote_code=trust_remote_code)
        if is_adapter(path):  # a LoRA reward model: its base plus the adapter, frozen
            base, base_name = load_adapter_base(str(path), tokenizer, dtype, trust_remote_code,
                                                "the reward adapter's base model")
            peft = load_adapter(base, local_or_hub(str(path)), TRAINED)
            set_trainable(peft, [])
            lm = TrainableLM(peft.get_base_model(), peft, None, base=local_or_hub(base_name))
            model = cls(lm.model.base_model, tokenizer, lora=lm)
        elif (path / REWARD_HEAD).is_file():  # before v2: a trunk beside the head file
            model = cls(_from_pretrained(AutoModel, "the reward model", str(path), dtype,
                                         trust_remote_code), tokenizer)
        else:  # v2: a sequence-classification checkpoint, its `score` the head
            classifier = _from_pretrained(AutoModelForSequenceClassification, "the reward model",
                                          str(path), dtype, trust_remote_code)
            model = cls(classifier.base_model, tokenizer)
            model.head = classifier.score
        model.load_head(path)
        return model

    def load_head(self, path: str | Path) -> None:
        """Read the normalisation constants written by `save_pretrained` and, where it is not in a
        sequence-classification checkpoint, the head: `reward_head.safetensors` before v2 (a
        weight and a bias), the LoRA adapter's `score` in v2."""
        path = Path(path)
        meta = json.loads((path / REWARD_JSON).read_text(encoding="utf-8"))
        if (path / REWARD_HEAD).is_file():
            state = load_file(str(path / REWARD_HEAD))
        elif is_adapter(path):
            state = {"weight": load_file(str(path / ADAPTER_WEIGHTS))[ADAPTER_SCORE]}
        else:
            state = None  # the classifier's own `score`, loaded with it
        if state is not None:
            weight = self.head.weight
            if "bias" in state and self.head.bias is None:
                self.head = nn.Linear(self.head.in_features, 1).to(weight.device, weight.dtype)
            self.head.load_state_dict({k: v.to(weight.dtype) for k, v in state.items()})
        self.set_normalization(meta.get("mean", 0.0), meta.get("std", 1.0))

    def save_pretrained(self, out_dir: str | Path, tokenizer=None) -> Path:
        """Write the model in the v2 format (see the module docstring), the tokenizer and
        `tether_reward.json` into `out_dir`, atomically."""
        check_finite_weights(self, "the reward model")
        out = Path(out_dir)
        with atomic_dir(out) as tmp:
            head = {k: v.detach().float().contiguous().cpu() for k, v in self.head.state_dict().items()}
            tok = tokenizer if tokenizer is not None else self.tokenizer
            pad_id = None if tok is None else tok.pad_token_id
            if self.lora is not None:  # the adapter alone (PEFT format), on the causal LM's base
                save_adapter(self.lora.peft, tmp, home=out, embedding_layers=False)
                _add_score_to_adapter(tmp, head["weight"])
            elif (classifier := sequence_classifier(self.backbone, self.head, pad_id)) is not None:
                classifier.save_pretrained(tmp)
            else:  # transformers has no sequence-classification model for it: the v1 layout
                self.backbone.save_pretrained(tmp)
                save_file(head, str(tmp / REWARD_HEAD))
            if tok is not None:
                tok.save_pretrained(tmp)
            # A head from before v2 may carry a bias b: raw - b is what the bias-free head gives,
            # so the offset moves into the stored mean and the normalised score is unchanged.
            v1 = (tmp / REWARD_HEAD).is_file()
            bias = 0.0 if v1 or "bias" not in head else head["bias"].item()
            meta = {"format": "tether-reward-v1" if v1 else REWARD_FORMAT,
                    "mean": self.norm_mean - bias, "std": self.norm_std,
                    "score": "(raw - mean) / std at the last non-pad token" if v1 else
                             "(raw - mean) / std; raw = the sequence-classification model's "
                             "logits[:, 0], read at the last non-pad token"}
            (tmp / REWARD_JSON).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return out

    def save_merged(self, out_dir: str | Path, tokenizer=None) -> Path:
        """A LoRA reward model with its adapter merged into the trunk, saved as a plain tether
        reward model (the adapter is merged in place: call this last)."""
        if self.lora is None:
            raise ValueError("save_merged needs a LoRA reward model")
        merged = self.lora.peft.merge_and_unload(adapter_names=[TRAINED])
        plain = RewardModel(merged.base_model, self.tokenizer)
        plain.head, plain.norm_mean, plain.norm_std = self.head, self.norm_mean, self.norm_std
        return plain.save_pretrained(out_dir, tokenizer)

    # ------------------------------------------------------------------ scoring
    def set_normalization(self, mean: float, std: float) -> None:
        if not std > 0:
            raise ValueError(f"normalisation std must be > 0, got {std}")
        self.norm_mean, self.norm_std = float(mean), float(std)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states `[B, T, d]`; position ids count real tokens only, so left- and
        right-padded batches give the same states for the same text."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_from_mask(attention_mask)).last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                context_length: int | None = None, packed: bool = False) -> torch.Tensor:
        """Raw scores `[B]`, read at each row's last non-pad token (left or right padding).

        `context_length` P: the rows are a rollout (prompt in the first P columns, the response
        after), so rows that repeat a prompt run it once (tether.models.forward); same scores.
        `packed`: the rows' real tokens run as packed rows without padding
        (tether.models.packed); the hidden state put back in its padded slot, so the same scores.
        """
        if context_length is not None and not packed:
            groups = sharing(self.backbone, input_ids, attention_mask, context_length)
            last_hidden = None if groups is None else shared_last_hidden(
                self.backbone, input_ids, attention_mask, context_length, groups)
            if last_hidden is not None:
                return self._score(last_hidden)
        hidden = (packed_final_hidden(self.backbone, input_ids, attention_mask) if packed
                  else self.hidden_states(input_ids, attention_mask))  # [B, T, d]
        return self._score(last_real(hidden, attention_mask))

    def _score(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """`[B]` the head on `[B, d]` states, in float32 at least: a half-precision model's
        scores are compared and summed in float32; a float64 model (the tests' truth) keeps
        float64."""
        scores = self.head(last_hidden).squeeze(-1)
        return scores.to(torch.promote_types(scores.dtype, torch.float32))

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              context_length: int | None = None) -> torch.Tensor:
        """Normalised scores `[B]`: `(raw - mean) / std` with the stored constants."""
        return (self(input_ids, attention_mask, context_length) - self.norm_mean) / self.norm_std

    @torch.no_grad()
    def score_texts(self, prompts: list, responses: list[str], batch_size: int = 16,
                    max_length: int | None = None, too_long: str = LOWER_LENGTHS) -> torch.Tensor:
        """Normalised scores `[N]` of (prompt, response) texts, encoded exactly as `tether rm`
        encoded its training pairs: the prompt under the one encoding rule (a chat prompt, a
        list of messages, through the chat template), the response with EOS appended, which is
        where the score is read. Without that EOS a score is read at an arbitrary token.
        `max_length`: the longest row (default: what the trunk can read); a longer one is an
        error ending in `too_long` (the fix the caller can give), since cutting it would cut the
        EOS the score is read at."""
        if self.tokenizer is None:
            raise ValueError("score_texts needs the reward model's tokenizer")
        limit = max_length or position_limit(self.backbone.config, self.tokenizer) or 4096
        rows = [{"prompt": p, "response": r} for p, r in zip(prompts, responses, strict=True)]
        # encoded uncut, then measured here: encode_sft's own line for a prompt past its limit
        # names SFT's --max-length and --on-long-prompt, which no caller of this has
        examples, _ = encode_sft(self.tokenizer, rows, 2**62, source="reward model scoring")
        lengths = [len(ex.prompt) + len(ex.responses[0]) for ex in examples]
        for i, length in enumerate(lengths):
            if length > limit:
                raise TetherError(f"prompt + response {i} is {length} tokens, more than the "
                                  f"{limit} the reward model reads; {too_long}")
        device = self.head.weight.device
        scores = []
        for start in range(0, len(examples), batch_size):
            batch = collate_sft(examples[start:start + batch_size], self.tokenizer.pad_token_id)
            scores.append(self.score(batch["input_ids"].to(device),
                                     batch["attention_mask"].to(device)))
        return torch.cat(scores)


def position_limit(config, tokenizer) -> int | None:
    """The longest input a model reads: its position limit and its tokenizer's
    `model_max_length` (which is 1e30 when unset); None when neither is known."""
    text = config.get_text_config()
    limits = [getattr(text, key, None) for key in ("max_position_embeddings", "n_positions")]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [int(v) for v in limits if isinstance(v, int) and 0 < v < 10**12]
    return min(limits) if limits else None


def sequence_classifier(trunk: nn.Module, head: nn.Linear, pad_token_id: int | None = None
                        ) -> nn.Module | None:
    """The transformers sequence-classification model (one label) made of `trunk` and `head`,
    sharing their tensors (built on the meta device, then given the trunk and the head as its
    `score`: nothing is copied), for `save_pretrained`; None when transformers has none for the
    architecture, or keeps its head under another name. `pad_token_id`: the tokenizer's, which
    transformers needs in the config to find each padded row's last token."""
    config = copy.deepcopy(trunk.config)
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    try:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, dtype=trunk.dtype)
    except (ValueError, KeyError):  # "Unrecognized configuration class ..."
        return None
    if not isinstance(getattr(model, "score", None), nn.Linear):
        return None
    if head.bias is not None:  # a head from before v2: its weight alone (see save_pretrained)
        weight = head.weight
        head = nn.Linear(head.in_features, 1, bias=False, device="meta")
        head.weight = weight
    setattr(model, model.base_model_prefix, trunk)
    model.score = head
    return model


def _add_score_to_adapter(adapter_dir: Path, head_weight: torch.Tensor) -> None:
    """Make a saved LoRA adapter (trained on a causal LM's trunk) a peft sequence-classification
    adapter: the head as `score` in `modules_to_save`, which peft loads into
    `AutoModelForSequenceClassification`. The LoRA layers' names are the same on both models (the
    trunk is `base_model_prefix` in each), and a causal LM loading the adapter skips the head."""
    weights = adapter_dir / ADAPTER_WEIGHTS
    state = load_file(str(weights))
    state[ADAPTER_SCORE] = head_weight
    save_file(state, str(weights))
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["modules_to_save"] = sorted(set(config.get("modules_to_save") or []) | {"score"})
    config["task_type"] = "SEQ_CLS"
    write_json(config_path, config, indent=2)


# ----------------------------------------------------------------------------- as PPO's reward

def shared_reward_model(lm: TrainableLM, path: str, policy_tokenizer,
                        trust_remote_code: bool = False, name: str = REWARD) -> RewardModel | None:
    """The LoRA reward model at `path` as the frozen adapter `name` on `lm`'s base, with its
    head and normalisation; None when it cannot share the base (load it separately then), or
    is not tether's (a peft adapter of another sequence-classification model). `lm`: the
    policy's, or an ensemble's first member's (tether.rl.reward.ensemble)."""
    # a LoRA adapter trained on the base `lm` already holds, with tether's head beside it
    if (lm.peft is None or not is_adapter(path) or local_or_hub(adapter_base(path)) != lm.base
            or not (Path(path).expanduser() / REWARD_JSON).is_file()):
        return None
    check_adapter_files(path)
    record = remembered_base(lm.model)
    if record is not None:  # the same path may hold another model than it did for the reward model
        check_base(path, record, lm.base)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    check_same_vocabulary(policy_tokenizer, {"reward model": (tokenizer, None)})
    load_adapter(lm.peft, str(Path(path).expanduser().resolve()), name)
    set_trainable(lm.peft, [TRAINED])  # loading must not change what trains
    model = RewardModel(AdapterView(lm.peft, name, part="trunk"), tokenizer)
    model.load_head(path)
    return model.to(lm.model.device)
