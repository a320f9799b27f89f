"""The critic: V(s_t), the expected return from each response position.

Two shapes, chosen by `--critic`:

- `separate` (default): its own transformer trunk and a linear head, initialised from the reward
  model (Ouyang et al. 2022, sec. 3.5 "we initialize the value function from the RM"; Ziegler et
  al. 2019 do the same), or from the policy's trunk with a zero head when the reward is a Python
  function. Costs one more forward and backward per step but keeps value gradients out of the
  policy.
- `shared`: a linear head on the policy's own final hidden state, one forward for both logits and
  values (the original PPO-for-LMs setup of Stiennon et al. 2020 used separate networks; a shared
  trunk is the cheap variant).

With LoRA the separate critic is the trainable adapter "critic" on the policy's shared base plus a
value head: a copy of a shared LoRA reward model's adapter and head when there is one (the value
function starts from the RM), else a fresh adapter with a zero head. `make_critic` is the one place
that chooses among these; the critic-free estimators get no critic at all.

Notation: B batch, P context width, R response width, d hidden size.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from tether.models.lora import (
    TRAINED,
    AdapterView,
    LoraSpec,
    add_adapter,
    load_adapter,
    set_trainable,
)
from tether.models.prepare import disable_dropout
from tether.models.pretrained import TrainableLM, grow_embeddings
from tether.models.reward_model import REWARD
from tether.models.trunk_head import placed_at, response_hidden

CRITIC = "critic"  # the trainable adapter of a LoRA critic on the policy's shared base


def _zero_head(hidden_size: int) -> nn.Linear:
    """Linear d -> 1 with weight and bias 0. Zero start: V = 0 everywhere, so the first
    advantages are the raw returns."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueHead(nn.Module):
    """Linear d -> 1 read at every response position: hidden [B, R, d] -> values [B, R]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = _zero_head(hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # the head is made in fp32; a trunk loaded with --dtype bfloat16 hands it bf16 states
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1).float()


class ValueModel(nn.Module):
    """A separate critic: transformer trunk + linear head, values at the response positions."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = head

    @classmethod
    def from_reward_model(cls, reward_model: nn.Module, vocab_rows: int = 0) -> ValueModel:
        """A copy of the reward model's trunk and head (shares no tensor with it): tether's own, or
        a sequence-classification model's trunk and `score`. The head gets a bias (0 where the
        reward head has none, so the first values are the raw scores): V has an offset to learn.
        `vocab_rows`: the policy's embedding rows; a trunk with fewer (a reward model without
        the pad token tether gave the policy) is grown to them with mean rows
        (`tether.models.pretrained.grow_embeddings`, as a model is grown for its tokenizer)."""
        backbone = copy.deepcopy(reward_model.backbone)
        grow_embeddings(backbone, vocab_rows)
        source = reward_model.head
        head = nn.Linear(source.in_features, 1).to(source.weight.device, source.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(source.weight)
            head.bias.copy_(source.bias if source.bias is not None else torch.zeros(1))
        return cls(backbone, head)

    @classmethod
    def from_causal_lm(cls, model: nn.Module) -> ValueModel:
        """A copy of a causal LM's trunk (`base_model`) with a zero-initialised head."""
        return cls(copy.deepcopy(model.base_model), _zero_head(model.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                context_length: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """V at the positions that predict each response token (P - 1 + t): [B, R]; with `mask`
        [B, R] only at those positions (the tokens the policy sampled), 0 elsewhere."""
        hidden = response_hidden(self.backbone, input_ids, attention_mask, context_length)
        if mask is not None:
            hidden = hidden[mask.bool()]
        # a fresh head is fp32; a trunk loaded with --dtype bfloat16 gives bf16 states
        values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()
        return values if mask is None else placed_at(values, mask)


def lora_critic(lm: TrainableLM, lora: LoraSpec, reward_model: nn.Module | None,
                reward_dir: str = "") -> ValueModel:
    """The critic as the trainable adapter "critic" on `lm`'s base plus a value head: a copy of
    the shared LoRA reward model at `reward_dir` (adapter and head) when there is one."""
    backbone = reward_model.backbone if reward_model is not None else None
    if isinstance(backbone, AdapterView) and backbone.adapter == REWARD:
        load_adapter(lm.peft, str(Path(reward_dir).expanduser().resolve()), CRITIC)
        head = copy.deepcopy(reward_model.head)
    else:
        add_adapter(lm.peft, lora, CRITIC)
        head = _zero_head(lm.model.config.get_text_config().hidden_size)
    set_trainable(lm.peft, [TRAINED, CRITIC])
    head.requires_grad_(True)
    critic = ValueModel(AdapterView(lm.peft, CRITIC, part="trunk"), head)
    return critic.to(device=lm.model.device, dtype=lm.model.dtype)


def make_critic(kind: str | None, lm: TrainableLM, lora: LoraSpec | None,
                reward_model: nn.Module | None, reward_dir: str = "") -> nn.Module | None:
    """The value model of the run, in eval mode with dropout off: None when the advantage
    estimator needs none (`kind` None: rloo, grpo, reinforce++), a `ValueHead` on the policy for
    "shared", else a separate trunk and head ("separate"): a LoRA critic on the policy's base
    (`lora_critic`), a copy of the reward model (Ouyang et al. 2022, sec. 3.5), or the policy's
    trunk with a zero head when there is no reward model it can start from: the reward is a
    Python function, or the reward model reads another vocabulary than the policy's (its trunk
    cannot read the policy's ids). `reward_model`: one that reads the policy's ids, or None."""
    policy = lm.model
    if kind is None:
        return None
    if kind == "shared":
        hidden = policy.config.get_text_config().hidden_size
        critic = ValueHead(hidden).to(device=policy.device, dtype=next(policy.parameters()).dtype)
    elif lm.peft is not None:
        critic = lora_critic(lm, lora, reward_model, reward_dir)
    elif reward_model is not None:
        rows = policy.get_input_embeddings().weight.shape[0]
        critic = ValueModel.from_reward_model(reward_model, rows).requires_grad_(True)
    else:
        critic = ValueModel.from_causal_lm(policy)
    disable_dropout(critic)
    return critic.eval()
