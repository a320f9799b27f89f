"""PPO's roles on one shared base under LoRA: the reward model and the critic as adapters.

`load_trainable_lm` gives the policy ("default" adapter) and the reference (adapters off, or the
frozen starting adapter). This file adds the other two roles to the same PeftModel:

- reward: a LoRA reward model trained on the same base (`tether rm --lora-r ...`) is loaded as
  the frozen adapter "reward" plus its scalar head; a reward model on another base, or a fully
  fine-tuned one, stays a separate model (it cannot share weights it does not have).
- critic: the trainable adapter "critic" plus a value head. From a shared LoRA reward model it
  starts as a copy of the reward adapter and head (Ouyang et al. 2022, sec. 3.5: the value function
  starts from the RM); otherwise it is a fresh adapter on the policy's base with a zero head.

Copies of the base in memory: one, whatever the roles, when the reward model shares the base;
two when it does not (the policy's shared base and the reward model).
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from tether.critic import ValueModel
from tether.lora import (
    TRAINED,
    AdapterView,
    LoraSpec,
    adapter_base,
    add_adapter,
    is_adapter,
    load_adapter,
    set_trainable,
)
from tether.models import RewardModel, TrainableLM, _local, load_tokenizer
from tether.reward_fn import check_same_vocabulary

REWARD, CRITIC = "reward", "critic"


def shares_base(lm: TrainableLM, adapter_dir: str) -> bool:
    """True when `adapter_dir` is a LoRA adapter trained on the base `lm` already holds."""
    if lm.peft is None or not is_adapter(adapter_dir):
        return False
    return _local(adapter_base(adapter_dir)) == lm.base


def shared_reward_model(lm: TrainableLM, path: str, policy_tokenizer,
                        trust_remote_code: bool = False) -> RewardModel | None:
    """The LoRA reward model at `path` as the frozen adapter "reward" on `lm`'s base, with its
    head and normalisation; None when it cannot share the base (load it separately then)."""
    if not shares_base(lm, path):
        return None
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    check_same_vocabulary(policy_tokenizer, {"reward model": (tokenizer, None)})
    load_adapter(lm.peft, str(Path(path).expanduser().resolve()), REWARD)
    set_trainable(lm.peft, [TRAINED])  # loading must not change what trains
    model = RewardModel(AdapterView(lm.peft, REWARD, part="trunk"), tokenizer)
    model.load_head(path)
    return model.to(lm.model.device)


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
        head = nn.Linear(lm.model.config.get_text_config().hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    set_trainable(lm.peft, [TRAINED, CRITIC])
    head.requires_grad_(True)
    critic = ValueModel(AdapterView(lm.peft, CRITIC, part="trunk"), head)
    return critic.to(device=lm.model.device, dtype=lm.model.dtype)
