"""An ensemble of reward models as one `Reward` (Coste et al. 2024, "Reward Model Ensembles Help
Mitigate Overoptimization"): every member scores each response, and --reward-aggregate makes one
score of the K (`aggregate`). Beside it the members' own scores and their spread come back as
parts, so the loop logs `reward/member<k>` and `reward/ensemble_std` (under eval/ in an
evaluation): a spread that grows while the proxy rises is the policy finding where the members
disagree, which is where a single reward model is most likely wrong.

`tether rm --ensemble K` writes the directory (tether.train.reward): one reward model per member
beside `tether_ensemble.json`. Members that are LoRA adapters on one base share it here: the
first loads the base, the others join it as adapters of their own (one base in memory).
"""

from __future__ import annotations

import torch
from torch import nn

from tether.models.prepare import freeze
from tether.models.reward_model import shared_reward_model
from tether.rl.reward import Prompt, Reward, RewardScores
from tether.rl.reward.models import ModelReward, load_reward_model, reward_from_model
from tether.run.config import parse_aggregate


def aggregate(scores: torch.Tensor, how: str, lam: float = 0.0) -> torch.Tensor:
    """One score per response `[B]` from the members' scores `[K, B]`:

        mean   r = (1/K) sum_k r_k
        min    r = min_k r_k                                  (worst-case optimisation)
        uwo    r = (1/K) sum_k r_k - lam * (1/K) sum_k (r_k - mean)^2
                                                              (uncertainty-weighted optimisation)

    Coste et al. 2024, sec. 3; the variance is over the K members (population, divisor K), so
    uwo with lam 0 is the mean, and one member's mean is its own score, bit for bit."""
    if how == "min":
        return scores.min(dim=0).values
    mean = scores.mean(dim=0)
    return mean - lam * scores.var(dim=0, unbiased=False) if how == "uwo" else mean


def reward_from_ensemble(members: list[Reward], spec: str) -> Reward:
    """The members' rewards as one, aggregated by `spec` (--reward-aggregate); the parts are each
    member's scores and `ensemble_std`, the members' standard deviation per response (divisor K)."""
    how, lam = parse_aggregate(spec)

    @torch.no_grad()
    def reward(prompts, responses, rollout=None, rows=None) -> RewardScores:
        scores = torch.stack([member(prompts, responses, rollout, rows).scores
                              for member in members])  # [K, B]
        parts = {f"member{k}": member for k, member in enumerate(scores)}
        parts["ensemble_std"] = scores.std(dim=0, unbiased=False)
        return RewardScores(aggregate(scores, how, lam), parts)
    return reward


def load_ensemble(members: list[str], spec: str, policy_tokenizer,
                  originals: dict[str, Prompt], chunk: int, device, dtype: str = "float32",
                  trust_remote_code: bool = False) -> ModelReward:
    """The reward models `members` (their kinds and base checked: `check_reward_model`) as one
    reward aggregated by `spec`; its model holds them all (FSDP2 shards them with the roles),
    and a critic may start from the first."""
    first = load_reward_model(members[0], policy_tokenizer, originals, chunk, device, dtype,
                              trust_remote_code)
    # a LoRA member on the policy's ids (tether's own, then its own critic_init): the others join
    # its base as adapters of their own
    lm = getattr(first.critic_init, "lora", None)
    loaded = [first]
    for k, member in enumerate(members[1:], 1):
        shared = None if lm is None else shared_reward_model(lm, member, policy_tokenizer,
                                                             trust_remote_code, f"member{k}")
        loaded.append(load_reward_model(member, policy_tokenizer, originals, chunk, device, dtype,
                                        trust_remote_code) if shared is None else
                      ModelReward(reward_from_model(shared, chunk, member), shared, shared))
    models = freeze(nn.ModuleList(m.model for m in loaded), device)  # (joining unfroze the first)
    return ModelReward(reward_from_ensemble([m.reward for m in loaded], spec), models,
                       first.critic_init)
