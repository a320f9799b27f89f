"""The reward a config asks for, checked and built in one place: the online stages and `tether
eval` call the same two steps, so a reward means the same wherever it is measured.

    user_code   before any model loads, cheapest first: the settings' own checks
                (tether.run.reward_checks, which the CLI ran before torch loaded; again
                with what Python passed), the environment factory, the reward
                and gold functions and the tools imported, the reward model's kind
    remote      --reward-url: every endpoint answers (GET /info) before any weights load
    build       the rewards once the tokenizer and the device are known: the served model, a
                reward model (sharing the policy's LoRA base where it can, else loaded apart),
                an ensemble of them (aggregated by --reward-aggregate), or the functions
                (through the pool with --reward-workers); and the gold
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tether.errors import TetherError
from tether.models.hub_reward import check_reward_model
from tether.rl.env.load import load_environment
from tether.rl.reward import Reward
from tether.rl.reward.functions import (
    RewardFunctions,
    load_reward_functions,
    reward_from_functions,
    weighted,
)
from tether.rl.reward.models import load_reward_model, prompt_originals, reward_from_model
from tether.rl.reward.pool import RewardPool
from tether.rl.reward.remote import connect, reward_from_urls
from tether.rl.sources import load_tools
from tether.run.config import ensemble_members
from tether.run.reward_checks import check_rewards, parse_urls
from tether.run.user_code.load import function_name, load_function


@dataclass
class UserCode:
    """What the user's code gives a run, imported and checked."""

    functions: list[Callable]  # the reward functions (--reward-fn, or Python's), [] without
    gold: Callable | None  # the gold function
    env: Callable | None  # the environment factory
    tools: list[Callable]  # --tools' functions


@dataclass
class Rewards:
    """The rewards of a run, built."""

    reward: Reward | None  # what scores the prompts' responses (None: episodes score themselves,
    # or an evaluation without a proxy)
    model: nn.Module | None  # the reward model behind `reward`, when it is one
    critic_init: nn.Module | None  # the model a critic may start from (reads the policy's ids)
    functions: RewardFunctions | None  # the reward functions (--tools score answers with them)
    gold: Reward | None


def no_task_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """0 for every response: the reward of a run distilled from --teacher with no task reward,
    where the KL to the teacher is the whole objective (docs/ppo.md, "On-policy distillation")."""
    return [0.0] * len(responses)


def user_code(cfg, reward_fn=None, gold_fn=None, env=None, *, training: bool) -> UserCode:
    """The reward and gold functions (`reward_fn` a callable or a list of them, instead of
    --reward-fn), the environment factory (`env`, instead of --env) and the tools, imported and
    checked (module docstring). `training`: exactly one reward is needed (an evaluation takes at
    most one proxy). `cfg`: a config with the reward and environment sections."""
    if env is not None and cfg.env not in ("", function_name(env)):
        raise TetherError("give the environment once: --env or the Python env argument")
    check_rewards(cfg, training=training, reward_fn=reward_fn is not None,
                  gold_fn=gold_fn is not None, env=env is not None)  # again, with Python's
    env = env or (load_environment(cfg.env, cfg.max_turns) if cfg.env else None)
    functions = reward_fn if reward_fn is not None else (
        load_reward_functions(cfg.reward_fn) if cfg.reward_fn else [])
    functions = list(functions) if isinstance(functions, (list, tuple)) else [functions]
    if training and not (functions or cfg.reward_model or cfg.reward_url or env or cfg.tools):
        functions = [no_task_reward]  # --teacher alone (check_rewards refuses the rest)
    weighted(functions, getattr(cfg, "reward_weights", ()))  # checked now, before any model loads
    gold = gold_fn or (load_function(cfg.gold_fn, "reward function") if cfg.gold_fn else None)
    if cfg.reward_model:  # its kind, from its config.json: the first of these to read a file
        check_reward_model(cfg.reward_model, cfg.trust_remote_code)
    return UserCode(functions, gold, env, load_tools(cfg.tools))


def remote(cfg, tokenizer, prompt_files: tuple[str, ...]) -> Reward | None:
    """--reward-url's reward (None without it, or for episodes): every endpoint's GET /info (a
    dead one, or two serving different models, is one line), and the in-process checks of a
    reward model that reads text (`tether.rl.reward.remote`), each prompt of `prompt_files` as
    its row gave it."""
    if not cfg.reward_url or cfg.episodic:
        return None
    endpoints = connect(parse_urls(cfg.reward_url), cfg.reward_url_timeout)
    return reward_from_urls(endpoints, prompt_originals(tokenizer, *prompt_files),
                            cfg.reward_url_timeout)


def build(cfg, user: UserCode, tokenizer, device, *, served: Reward | None,
          prompt_files: tuple[str, ...], chunk: int, max_steps: int = 0,
          shared: nn.Module | None = None) -> Rewards:
    """The rewards (module docstring). `served`: `remote`'s. `chunk`: rows per reward-model
    forward. `max_steps`: the run's batches (TRL's `trainer_state.max_steps`). `shared`: the
    reward model as one more adapter on the policy's LoRA base, frozen, when it can be one (no
    second base in memory). Any other reward model is loaded apart, and one that does not read
    the policy's ids (another vocabulary, or a sequence-classification model) scores the decoded
    text: each prompt as its row gave it (so a chat is rendered with the reward model's own
    template), the response as sampled."""
    # the pool --reward-workers asks for, or None: 0 or 1 workers is one call per batch
    pool = (RewardPool(cfg.reward_workers, cfg.reward_retries, cfg.reward_fn_timeout)
            if cfg.reward_workers > 1 else None)
    functions = (reward_from_functions(user.functions, getattr(cfg, "reward_weights", ()),
                                       max_steps=max_steps, timeout=cfg.reward_fn_timeout,
                                       pool=pool) if user.functions else None)
    gold = (reward_from_functions([user.gold], (), "gold reward function", max_steps,
                                  cfg.reward_fn_timeout, pool) if user.gold else None)
    if cfg.episodic:  # the environment rewards its episodes (--tools: with the functions)
        return Rewards(None, None, None, functions, gold)
    if served is not None or not cfg.reward_model:
        return Rewards(served or functions, None, None, functions, gold)
    if shared is not None:
        return Rewards(reward_from_model(shared, chunk, cfg.reward_model), shared, shared,
                       functions, gold)
    originals = prompt_originals(tokenizer, *prompt_files)
    if members := ensemble_members(cfg.reward_model):
        # tether rm --ensemble K's (tether.rl.reward.ensemble)
        from tether.rl.reward.ensemble import load_ensemble

        loaded = load_ensemble(members, cfg.reward_aggregate, tokenizer, originals, chunk, device,
                               cfg.dtype, cfg.trust_remote_code)
    else:
        loaded = load_reward_model(cfg.reward_model, tokenizer, originals, chunk, device,
                                   cfg.dtype, cfg.trust_remote_code)
    return Rewards(loaded.reward, loaded.model, loaded.critic_init, functions, gold)
