"""`tether bon`: the best-of-n curve of a model from one pool of samples.

    --n responses (or episodes) per held-out prompt, sampled once as `tether eval` samples
    (draw 0 is eval's own, each further draw the noise SAMPLE_SEED_STRIDE on), scored by the
    proxy and the gold (tether.tools.evaluate.held_out)
    for n = 1 .. N: the expected proxy and gold of the best of n by the proxy, their standard
    errors over prompts (tether.tools.frontier.best_of_n), the bound log n - (n - 1) / n and
    the exact KL with the pool as support (best_of_n_kl)
    -> bon.json (a list, one object per n) and a table on stdout

Best-of-n is the baseline an RL run's gold-vs-KL frontier is read against (Gao et al. 2022;
Coste et al. 2023): it costs no training, and `tether report` draws it beside the runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tether.models.base_location import check_base_option, write_json
from tether.rl.evaluation import EVAL_SEED_OFFSET, evaluate_policy
from tether.run.launch import resolve_device
from tether.tools.config import BonConfig
from tether.tools.evaluate import held_out
from tether.tools.frontier import best_of_n, best_of_n_kl, mean_and_stderr
from tether.tools.generate import SAMPLE_SEED_STRIDE
from tether.tools.outputs import check_output, function_file


def curve(proxy: list[list[float]], gold: list[list[float]] | None, n: int) -> dict:
    """bon.json's object for `n` from the pools `proxy[prompt][sample]` (and `gold`, alike)."""
    mean, se = mean_and_stderr([best_of_n(pool, pool, n) for pool in proxy])
    gold_mean, gold_se = (mean_and_stderr([best_of_n(p, g, n) for p, g in zip(proxy, gold)])
                          if gold else (None, None))
    return {"n": n, "proxy": mean, "proxy_se": se, "gold": gold_mean, "gold_se": gold_se,
            "kl_bound": math.log(n) - (n - 1) / n,
            "kl_exact": sum(best_of_n_kl(pool, n) for pool in proxy) / len(proxy)}


def run(cfg: BonConfig, reward_fn: Callable | None = None, gold_fn: Callable | None = None
        ) -> list[dict]:
    """Sample the pool, write bon.json and return its list. `reward_fn` / `gold_fn`: Python
    callables instead of --reward-fn / --gold-fn."""
    device = resolve_device(cfg.device)
    check_base_option(cfg.model, cfg.base)
    out = check_output(cfg.output, [("--prompts", cfg.prompts), ("--model", cfg.model),
                                    ("--reward-fn", function_file(cfg.reward_fn)),
                                    ("--gold-fn", function_file(cfg.gold_fn)),
                                    ("--base", cfg.base), ("--reward-model", cfg.reward_model)],
                       "bon.json")
    with held_out(cfg, device, reward_fn, gold_fn) as (evaluation, measure, gold, _):
        seeds = [cfg.seed + EVAL_SEED_OFFSET + d * SAMPLE_SEED_STRIDE for d in range(cfg.n)]
        draws = [evaluate_policy(evaluation(seed), measure, gold)[1] for seed in seeds]
    proxy = [[draw[i]["score"] for draw in draws] for i in range(len(draws[0]))]
    golds = [[draw[i]["gold_score"] for draw in draws] for i in range(len(draws[0]))]
    points = [curve(proxy, golds if gold else None, n) for n in range(1, cfg.n + 1)]
    write_json(out, points, indent=1)
    return points


def cli(argv: list[str]) -> int:
    """`tether bon --model M --prompts P --reward-model RM [--gold-fn G] --n N --output F`."""
    from tether.run.parse import parse_config

    points = run(parse_config(BonConfig, argv, prog="tether bon"))
    print(f"{'n':>4}  {'proxy':>16}  {'gold':>16}  {'kl_exact':>8}  {'kl_bound':>8}")
    for p in points:
        gold = "-" if p["gold"] is None else f"{p['gold']:+.4f} ± {p['gold_se']:.4f}"
        print(f"{p['n']:>4}  {p['proxy']:+.4f} ± {p['proxy_se']:.4f}  {gold:>16}  "
              f"{p['kl_exact']:8.4f}  {p['kl_bound']:8.4f}")
    return 0
