"""Where each option of the online stages acts (`tether.run.scopes`): an option given where the
run's other settings leave it without effect is refused with one line. Most follow from the
tables of `tether.choices` (an estimator's or a controller's own options, the critic's, the
discount, the engines'); the rest are written here, each with why.
"""

from __future__ import annotations

from tether.choices import ADVANTAGES, ENGINES, KL_CONTROLLERS, KL_ESTIMATORS, RefUpdate
from tether.run.scopes import Scope, from_table


def _with(fact: str) -> list[str]:
    """The advantage estimators with `fact` (tether.choices.Advantage)."""
    return [name for name, a in ADVANTAGES.items() if getattr(a, fact)]


def _advantage_fix(name: str) -> str:
    command = ADVANTAGES[name].command
    return f"use tether {command} (--advantage {name})" if command else f"pass --advantage {name}"


OWN_ENGINES = " or ".join(f"--engine {name}" for name, e in ENGINES.items() if e.own_logprobs)
CRITIC = Scope(f"the critic of --advantage {' or '.join(_with('uses_critic'))}",
               lambda c: c.uses_critic, lambda c: f"--advantage {c.advantage}, which has no critic",
               _advantage_fix(_with("uses_critic")[0]))
EVALUATION = Scope("--eval-prompts", lambda c: bool(c.eval_prompts),
                   lambda c: "no --eval-prompts", "pass --eval-prompts")

# The options that act only under another setting: each estimator's and controller's own (their
# tables' `options`), the critic's, the discount, the engines' (tether.run.scopes refuses one the
# user gave where it would do nothing: tether rloo --scale-rewards batch trained as if it were
# absent).
SCOPES = from_table("advantage", ADVANTAGES, _advantage_fix) | from_table(
    "kl_ctl", KL_CONTROLLERS) | from_table("kl_estimator", KL_ESTIMATORS) | dict.fromkeys(("critic", "vf_coef", "value_clip_range"), CRITIC) | {
    "gamma": Scope(f"--advantage {' or '.join(_with('discounts'))}",
                   lambda c: ADVANTAGES[c.advantage].discounts,
                   lambda c: f"--advantage {c.advantage}, which discounts nothing",
                   f"use --advantage {' or '.join(_with('discounts'))}"),
    "kl_per_token_mean": Scope(
        "--kl-in loss and no --loss-aggregation",
        lambda c: c.kl_in == "loss" and c.loss_aggregation == "auto",
        lambda c: (f"--kl-in {c.kl_in}" if c.kl_in != "loss"
                   else f"--loss-aggregation {c.loss_aggregation}"),
        "pass --kl-in loss without --loss-aggregation (which replaces it)"),
    "eval_every": EVALUATION, "gold_fn": EVALUATION,
    "max_kl_to": Scope("--max-kl with --teacher or a moving --ref-update",
                       lambda c: c.max_kl > 0 and (bool(c.teacher) or RefUpdate.parse(c.ref_update).moves),
                       lambda c: ("--max-kl 0" if not c.max_kl else "the SFT model as the anchor"),
                       "pass --max-kl with --teacher or --ref-update"),
    "ref_reset_optimizer": Scope("--ref-update reset:N", lambda c: c.ref_update.startswith("reset"),
                                 lambda c: f"--ref-update {c.ref_update}",
                                 "pass --ref-update reset:N"),
    "generator_threads": Scope("--max-staleness above 0", lambda c: c.max_staleness > 0,
                               lambda c: "--max-staleness 0, which starts no generator process",
                               "pass --max-staleness (docs/engine.md)"),
    # an engine's own log-probs, or a stale copy's (--max-staleness): the truncated weight acts
    "engine_is_cap": Scope(f"{OWN_ENGINES} or --max-staleness above 0",
                           lambda c: ENGINES[c.engine].own_logprobs or c.max_staleness > 0,
                           lambda c: f"--engine {c.engine} and --max-staleness 0",
                           f"pass {OWN_ENGINES} or --max-staleness"),
    # with --max-staleness a row's KL to the stale copy grows with every step: masking by it
    # would drop rows for the staleness the decoupled loss corrects
    "engine_mask_kl": Scope(
        f"{OWN_ENGINES} and --max-staleness 0",
        lambda c: ENGINES[c.engine].own_logprobs and not c.max_staleness,
        lambda c: (f"--engine {c.engine}" if not c.max_staleness else
                   f"--max-staleness {c.max_staleness}, whose decoupled loss corrects the "
                   "staleness (a row's KL to the stale copy grows with every step)"),
        f"pass {OWN_ENGINES}; with --max-staleness, use --engine-is-cap"),
    "reward_per_turn": Scope(
        f"--env or --tools and --advantage {' or '.join(n for n in ADVANTAGES if n not in _with('compares_group'))}",
        lambda c: c.episodic and not ADVANTAGES[c.advantage].compares_group,
        lambda c: ("no environment" if not c.episodic else f"--advantage {c.advantage}, which "
                   "compares whole episodes (their summed reward)"),
        "pass --env or --tools with --advantage gae or reinforce++"),
}
