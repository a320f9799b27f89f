"""Reward models as the loop's `Reward`: tether's own (`tether rm`) or a transformers
sequence-classification model (`tether.models.hub_reward`), loaded frozen.

Tether's own, on the policy's vocabulary, scores the policy's token ids directly
(`reward_from_model`); every other reward model reads text (`reward_from_texts`): the decoded
response and the prompt as its row gave it (plain text, or the chat messages, which the reward
model renders with its own template), tokenised by its own tokenizer. `load_scoring_model` is
also what `tether serve-rm` serves (tether.rl.reward.remote).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from tether.data.chat import is_messages
from tether.data.prompts import format_prompt, prompt_messages
from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.hub_reward import TETHER, load_hub_reward_model, reward_model_kind
from tether.models.prepare import freeze, fuse_gelu
from tether.models.pretrained import check_same_vocabulary
from tether.models.reward_model import RewardModel
from tether.rl.reward import NonFiniteScore, Prompt, Reward, RewardScores
from tether.rl.reward.functions import out_of_range


def reward_from_model(reward_model: nn.Module, chunk: int, name: str = "") -> Reward:
    """A reward model as a `Reward`: it scores the policy's own token ids (no re-tokenising),
    `chunk` rows at a time, read at each response's last real token (EOS). `name` names it when
    a score is not finite (`checked_model_scores`)."""
    @torch.no_grad()
    def reward(prompts, responses, rollout, rows=None) -> RewardScores:  # rollout: a Rollout
        # The reward model reads the policy's own token ids at the last real token (EOS).
        scores = torch.cat([reward_model.score(rollout.input_ids[i:i + chunk],
                                               rollout.attention_mask[i:i + chunk],
                                               rollout.context_length)
                            for i in range(0, len(rollout), chunk)])
        return RewardScores(checked_model_scores(scores, name, prompts), {})
    return reward


def checked_model_scores(scores: torch.Tensor, name: str, prompts: list) -> torch.Tensor:
    """`scores` [B] of the reward model `name`, or `NonFiniteScore` naming the first row whose
    score is NaN, inf or past MAX_SCORE. A reward model's forward is finite on finite weights
    and inputs, so the cause is in it (NaN or inf weights, or weights so large its float32
    forward overflows), never the policy's learning rate, which is where the loss's NaN would
    point a batch later."""
    for row, value in enumerate(scores.tolist()):
        if why := out_of_range(value):  # a line, or None
            prompt = str(prompts[row])[:40] if row < len(prompts) else "?"
            raise NonFiniteScore(f"the reward model {name} gave response {row} (prompt "
                                 f"{prompt!r}) {why}: its weights hold NaN or inf, or are so "
                                 "large that its forward overflows; check or retrain the reward "
                                 "model, and what it reads; checkpoints written so far are intact")
    return scores


def prompt_originals(tokenizer, *sources: str) -> dict[str, Prompt]:
    """Each prompt text the policy continues (a chat rendered with the policy's template, as
    `tether.data.prompts.load_prompts` gives it) -> the prompt as its row gave it, for a reward
    model that renders a chat with its own template. `sources`: prompt files (empty ones skipped)."""
    originals: dict[str, Prompt] = {}
    for source in sources:
        for i, row in enumerate(load_rows(source) if source else []):
            where = f"{source}: row {i}"
            messages = prompt_messages(row, where)  # content parts joined, as the policy saw them
            original = messages if messages is not None else str(row["prompt"])
            originals[format_prompt(tokenizer, row, where)] = original
    return originals


def reward_from_texts(score_texts: Callable[[list, list[str]], torch.Tensor],
                      chat_template: bool, originals: dict[str, Prompt], name: str) -> Reward:
    """A reward model that reads text as a `Reward`: each prompt text is looked up in
    `originals` (one missing there is read as plain text), the responses are the decoded ones,
    and `score_texts(prompts, responses)` scores them `[N]`: the model's own `score_texts`, which
    tokenises both with its own tokenizer, or a served model's (tether.rl.reward.remote). `name`
    names it when a score is not finite (`checked_model_scores`).

    Such a model renders chat prompts with its own template: without one (`chat_template`
    False), chat prompts are refused here, at start-up (in process, and for a served model
    alike)."""
    if not chat_template and any(is_messages(p) for p in originals.values()):
        raise TetherError(f"the prompts are chat messages but the reward model {name} has no "
                          "chat template to render them with; give plain-text prompts, or a "
                          "reward model whose tokenizer has a chat_template")

    @torch.no_grad()
    def reward(prompts, responses, rollout=None, rows=None) -> RewardScores:
        scores = score_texts([originals.get(p, p) for p in prompts], list(responses))
        return RewardScores(checked_model_scores(scores, name, prompts), {})
    return reward


@dataclass
class ModelReward:
    """A reward model ready for the loop: the `Reward` it gives, the model (frozen), and the
    model a critic may start from (it reads the policy's token ids), or None."""

    reward: Reward
    model: nn.Module
    critic_init: nn.Module | None


def load_scoring_model(path: str, device, dtype: str = "float32",
                       trust_remote_code: bool = False) -> nn.Module:
    """The reward model at `path`, frozen on `device`: tether's own (`RewardModel`) or a
    sequence-classification model (`HubRewardModel`). Both score texts with `score_texts`; this
    is what `load_reward_model` loads and what `tether serve-rm` serves."""
    model = (RewardModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
             if reward_model_kind(path, trust_remote_code) == TETHER
             else load_hub_reward_model(path, dtype, trust_remote_code))
    return freeze(fuse_gelu(model), device)


def has_chat_template(model: nn.Module) -> bool:
    """Whether a reward model that reads text can render chat prompts (its tokenizer's template)."""
    return bool(getattr(model.tokenizer, "chat_template", None))


def load_reward_model(path: str, policy_tokenizer, originals: dict[str, Prompt], chunk: int,
                      device, dtype: str = "float32", trust_remote_code: bool = False
                      ) -> ModelReward:
    """The reward model at `path` (tether's own, or a sequence-classification model) as the
    loop's reward, scoring `chunk` rows per forward.

    Tether's own on the policy's vocabulary scores the policy's ids (the fast path); any other
    reads text (`reward_from_texts`). A critic can start from a model that reads the policy's
    ids: tether's own on the fast path, or a sequence-classification model whose vocabulary is
    the policy's (the policy may add a pad token to it).
    """
    policy_vocab = policy_tokenizer.get_vocab()
    model = load_scoring_model(path, device, dtype, trust_remote_code)
    if isinstance(model, RewardModel):
        # the fast path: the policy's ids index its embeddings
        if model.tokenizer.get_vocab() == policy_vocab:
            check_same_vocabulary(policy_tokenizer, {"reward model": (None, model.backbone)})
            return ModelReward(reward_from_model(model, chunk, path), model, model)
        critic_init = None
    else:
        vocab = model.tokenizer.get_vocab()
        # the same ids for the same tokens, and no policy token it lacks but the pad tether added
        same_ids = (vocab.items() <= policy_vocab.items()
                    and set(policy_vocab) - set(vocab) <= {policy_tokenizer.pad_token})
        critic_init = model if same_ids and model.head is not None else None
    reward = reward_from_texts(partial(model.score_texts, batch_size=chunk),
                               has_chat_template(model), originals, path)
    return ModelReward(reward, model, critic_init)
