"""The loop's warnings across batches (tether.train.ppo_watch.Watch): a collapse (entropy near 0 far
from the reference) and a KL blow-up with the entropy rising or falling, each said once; --max-kl
stops the run. Hand-made metric lines; tests/test_hardening.py runs a real blow-up."""

from __future__ import annotations

import pytest

from tether.errors import TetherError
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_watch import Watch, watch_for


def lines(kls, entropies, beta=0.05):
    return [{"objective/kl": k, "objective/beta": beta, "policy/entropy": e,
             "policy/collapsed": float(e < 0.1 and k > 10.0)} for k, e in zip(kls, entropies)]


def warnings_of(watch, metric_lines, capsys):
    for step, metrics in enumerate(metric_lines, 1):
        watch.check(metrics, step)
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning")]


def test_a_kl_blow_up_with_rising_entropy_is_warned_once(capsys):
    # The run: GRPO with LoRA at lr 3e-3, 8.3 nats per batch, entropy 1.24 -> 1.89. At
    # batch 4 the KL (8.3) is past 4 nats and past twice what it was 3 batches before (0).
    got = warnings_of(Watch(), lines([0.0, 1.0, 2.5, 8.3, 9.0, 12.0], [1.24, 1.4, 1.6, 1.89, 1.9, 2.0]),
                      capsys)
    assert got == ["warning: batch 4: the KL to the reference is growing fast (0.0 -> 8.3 nats in "
                   "3 batches at beta 0.05) with the entropy rising (1.24 -> 1.89 nats/token); "
                   "lower --lr, raise --beta, or cap it with --max-kl (docs/ppo.md, \"Choosing "
                   "--max-kl\")"]


def test_falling_entropy_gives_both_warnings_once_each(capsys):
    got = warnings_of(Watch(), lines([0.0, 3.0, 20.0, 40.0], [1.0, 0.5, 0.05, 0.0]), capsys)
    assert [x.split(": ", 2)[1] for x in got] == ["batch 3", "batch 3"]
    assert "collapsing" in got[0] and "growing fast (0.0 -> 20.0 nats in 2 batches" in got[1]
    assert "entropy falling (1.00 -> 0.05" in got[1]


@pytest.mark.parametrize("kls, beta", [
    ([3.0, 3.3, 3.6, 3.9, 4.2, 4.5, 4.8], 0.05),  # past 4 nats, but slower than 2x in 3
    ([0.0, 1.0, 3.0, 3.9], 0.05),  # fast, but below 4 nats
    ([0.0, 2.0, 8.0, 20.0], 0.0),  # no leash: it drifts by design
])
def test_no_warning_for_slow_or_small_drift_or_without_the_leash(kls, beta, capsys):
    assert warnings_of(Watch(), lines(kls, [1.0] * len(kls), beta), capsys) == []


def test_adaptive_runs_warn_past_twice_their_target(capsys):
    # The adaptive controller aims at --kl-target (6): climbing there fast is the plan.
    cfg = PPOConfig(run_name="r", policy="p", prompts="x.jsonl", kl_ctl="adaptive", kl_target=6.0)
    assert watch_for(cfg, quiet=False).drift_kl == 12.0
    assert watch_for(PPOConfig(run_name="r", policy="p", prompts="x.jsonl"), False).drift_kl == 4.0
    assert warnings_of(watch_for(cfg, False), lines([0.0, 5.0, 6.5, 7.0], [1.0] * 4), capsys) == []
    assert len(warnings_of(watch_for(cfg, False), lines([0.0, 5.0, 14.0], [1.0] * 3), capsys)) == 1


def test_quiet_ranks_say_nothing_and_max_kl_stops_every_rank(capsys):
    watch = Watch(max_kl=10.0, quiet=True)
    with pytest.raises(TetherError, match=r"batch 3: the KL to the reference is 12.00 nats, past "
                                          r"--max-kl 10, at beta 0.05"):
        warnings_of(watch, lines([0.0, 6.0, 12.0], [1.0, 1.0, 1.0]), capsys)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("stds, says", [([0.1, 0.2, 0.3, 0.5], True), ([0.5, 0.4, 0.3, 0.2], False)])
def test_the_blow_up_warning_says_when_an_ensemble_disagrees_more_as_the_proxy_rises(stds, says,
                                                                                      capsys):
    # The proxy climbs 0 -> 3 in both; only where the members' spread grows with it (0.1 -> 0.5)
    # does the warning add that the policy is exploiting where they are unsure.
    metric_lines = [m | {"objective/score": float(k), "reward/ensemble_std": s}
                    for k, (m, s) in enumerate(zip(lines([0.0, 1.0, 2.5, 8.3], [1.0] * 4), stds))]
    (got,) = warnings_of(Watch(), metric_lines, capsys)
    assert got.startswith("warning: batch 4: the KL to the reference is growing fast")
    clause = ("; the reward models disagree more as the proxy rises (members' std 0.1 -> 0.5 "
              "while the score went 0 -> 3): the policy is exploiting where they are unsure; try "
              "--reward-aggregate min or uwo:LAMBDA (docs/rm.md, \"Ensembles\")")
    assert got.endswith(clause) == says and ("disagree" in got) == says
