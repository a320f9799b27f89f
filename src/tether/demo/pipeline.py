"""`tether demo`: the whole pipeline offline on a CPU, showing the KL leash at work.

    data + tokenizer + tiny GPT-2      (demo/task.py: grammar, gold reward, noisy pairs)
    SFT                               learn the review language
    RM                                proxy reward from noisy pairs (never sees ill-formed text)
    PPO x 3 per seed                  no KL penalty | fixed beta | adaptive beta (Ziegler 2019)
    DPO, IPO                          offline, on the same pairs
    report.html                       proxy vs gold, KL, beta, diversity, samples, verdicts

Each stage is called through its Python API with a typed config, exactly as a user would.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

from tether.demo.config import DemoConfig
from tether.demo.curves import Curve
from tether.demo.data import prepare_data
from tether.demo.resume import check_root, interrupted, read_eval, record_settings
from tether.errors import AlreadyFinished
from tether.run import interrupt
from tether.run.extras import installed
from tether.run.jobs import Job, Progress, Workers, available_cores, run_jobs

# This module imports no torch, transformers or matplotlib at its top: `tether demo` prints its
# first line and starts its workers (which import them) before it imports them itself.


def checkpoint_every(steps: int) -> int:
    """A stage's checkpoint cadence: about ten per run, so an interrupted demo loses at most a
    tenth of each stage it was running (a checkpoint changes no number: tests/demo)."""
    return max(1, steps // 10)


def _train(stage, config_class, root: Path, cfg: DemoConfig, **fields) -> str:
    """One tether stage run through its own `run`: resumed from its last checkpoint when the
    demo is resumed and the run was started, kept as it is when it finished; its final model."""
    name = fields["run_name"]
    try:
        return str(stage.run(config_class(resume=cfg.resume and (root / name).exists(),
                                          **fields)).output_path)
    except AlreadyFinished:
        print(f"{name}: finished before; kept as it is", flush=True)
        return str(root / name / "final")


def train_sft_and_rm(root: Path, cfg: DemoConfig, paths: dict[str, str]) -> tuple[str, str]:
    from tether.train import reward, sft

    common = {"output_dir": str(root), "seed": cfg.seed, "device": cfg.device,
              "batch_size": 32, "max_length": 48, "log_every": 50}
    policy = _train(sft, sft.SFTConfig, root, cfg, run_name="sft", model=paths["base"],
                    data=paths["sft"], max_steps=400, lr=3e-3, warmup_steps=20,
                    save_every=checkpoint_every(400), **common)
    # (3 epochs of the 85% of 1,000 pairs not held out, in batches of 32: 81 steps)
    reward_model = _train(reward, reward.RMConfig, root, cfg, run_name="rm", model=policy,
                          data=paths["pairs"], epochs=3, lr=1e-3, eval_fraction=0.15,
                          normalize_data=paths["sft"], save_every=checkpoint_every(81), **common)
    return policy, reward_model


PPO_VARIANTS = {  # run name -> controller settings; the leash is the only difference
    "ppo-no-kl": lambda c: {"kl_ctl": "fixed", "beta": 0.0},
    "ppo-fixed": lambda c: {"kl_ctl": "fixed", "beta": c.fixed_beta},
    "ppo-adaptive": lambda c: {"kl_ctl": "adaptive", "beta": c.adaptive_start_beta,
                               "kl_target": c.kl_target, "kl_horizon": c.kl_horizon},
}


# The PPO runs' sampling settings, which every offline evaluation reuses (tether.rl.evaluation): the
# SFT model scored offline then gives exactly the numbers each PPO run logs at step 0.
PPO_BATCH, MAX_NEW_TOKENS = 32, 20
# The gold reward, named (not passed as a Python object) so each run's config.yaml records it and
# a run re-made from that file is scored on gold too.
GOLD_FN = "tether.demo.task:gold_reward"


def ppo_fields(cfg: DemoConfig, paths: dict[str, str], policy: str, reward_model: str,
               batches: int) -> dict:
    """What every PPO run of the demo is given, its sweep's runs too (so that beta 0 there is the
    first batches of ppo-no-kl, `sweep_scope`): the run's name, seed, beta and cadence of
    evaluations aside."""
    return {"device": cfg.device, "policy": policy, "reward_model": reward_model,
            "prompts": paths["prompts"], "eval_prompts": paths["eval_prompts"],
            "gold_fn": GOLD_FN, "batch_size": PPO_BATCH, "total_episodes": PPO_BATCH * batches,
            "max_new_tokens": MAX_NEW_TOKENS, "lr": cfg.ppo_lr, "lr_schedule": "constant",
            "ppo_epochs": 4, "save_every": checkpoint_every(batches), "sample_every": 0}


def run_ppo(root: Path, cfg: DemoConfig, paths: dict[str, str], policy: str, reward_model: str,
            name: str, seed: int) -> Curve:
    from tether.train import ppo

    # (a finished run is not handed to a worker: `finished_result`)
    _train(ppo, ppo.PPOConfig, root, cfg, run_name=f"{name}-seed{seed}", output_dir=str(root),
           seed=seed, eval_every=max(1, cfg.ppo_batches // 20),
           **ppo_fields(cfg, paths, policy, reward_model, cfg.ppo_batches),
           **PPO_VARIANTS[name](cfg))
    return read_curve(root / f"{name}-seed{seed}", name, seed)


def read_curve(run_dir: Path, name: str, seed: int) -> Curve:
    """Evaluation metrics and samples of one PPO run, from its metrics.jsonl and samples.jsonl."""
    from tether.tools.report import read_run, read_samples

    curve = Curve(name, seed, samples=read_samples(run_dir))
    for row in (row for row in read_run(run_dir).metrics if "eval/score" in row):
        curve.steps.append(int(row["step"]))
        for key, value in row.items():
            if key.startswith(("eval/", "objective/beta")):
                curve.values.setdefault(key, []).append(float(value))
    return curve


OFFLINE = {"dpo": ("sigmoid", 0.1, 5e-4), "ipo": ("ipo", 0.1, 5e-4)}  # name -> loss, beta, lr


def run_offline(root: Path, cfg: DemoConfig, paths: dict[str, str], policy: str,
                reward_model: str, name: str) -> Curve:
    """DPO or IPO from the SFT model on the same pairs, then evaluated once."""
    from tether.train import dpo

    loss, beta, lr = OFFLINE[name]
    # (2 epochs of 1,000 pairs in batches of 32: 64 steps)
    model = _train(dpo, dpo.DPOConfig, root, cfg, run_name=name, loss=loss, beta=beta, lr=lr,
                   output_dir=str(root), seed=cfg.seed, device=cfg.device,
                   save_every=checkpoint_every(64), batch_size=32, max_length=48, log_every=10,
                   model=policy, data=paths["pairs"], epochs=2, precompute_ref_logprobs=True)
    return evaluate_model(model, policy, reward_model, paths, name, cfg,
                          out=eval_path(root, name))


def evaluate_model(model_dir: str, ref_dir: str, reward_model: str, paths: dict[str, str],
                   name: str, cfg: DemoConfig, out: Path) -> Curve:
    """One evaluation point for an offline-trained policy: `tether eval` with the PPO runs'
    sampling settings and the first PPO seed, so it is measured exactly as PPO measures its own.
    Its record is written to `out` (`eval_path`) and the result read back from it, as a resumed
    demo reads a finished one (JSON keeps every float exactly)."""
    from tether.tools import evaluate
    from tether.tools.config import EvalConfig

    # (`tether eval` creates a missing parent of its output, as --output-dir is created)
    evaluate.run(EvalConfig(model=model_dir, prompts=paths["eval_prompts"], reference=ref_dir,
                            reward_model=reward_model, gold_fn=GOLD_FN, batch_size=PPO_BATCH,
                            max_new_tokens=MAX_NEW_TOKENS, seed=cfg.seed, device=cfg.device,
                            output=str(out)))  # atomically: whole, or not at all
    return read_eval(out, name, cfg.seed)


def eval_path(root: Path, stage: str) -> Path:
    """<stage>/eval.json: beside DPO's or IPO's final/ (where `tether sweep` keeps DPO's too);
    the SFT model's in sft-eval/, so that no stage writes into another's finished run."""
    return root / stage / "eval.json"


def plan_sweep(root: Path, cfg: DemoConfig, paths: dict[str, str], policy: str,
               reward_model: str):
    """The "which beta?" section's grid (fixed betas, one seed, a small size), written to
    data/sweep.yaml and planned by `tether sweep`'s own planner; its runs are demo stages."""
    import yaml

    from tether.tools import sweep

    grid = {"name": "sweep", "output_dir": str(root), "seeds": [cfg.seed], "ppo": {
        **ppo_fields(cfg, paths, policy, reward_model, cfg.sweep_batches),
        # four evaluations after step 0 (two under --quick, whose sweep is a sketch)
        "eval_every": max(1, cfg.sweep_batches // (2 if cfg.quick else 4)),
        "kl_ctl": "fixed", "beta": list(cfg.sweep_betas)},
        # the baselines beside RL: best-of-n of the SFT model, and the smallest beta's run
        # interpolated from it (docs/frontier.md)
        "bon": {"n": 8 if cfg.quick else 16},
        "interpolate": {"points": [0, 0.5, 1] if cfg.quick else [0, 0.25, 0.5, 0.75, 1]}}
    grid_path, text = root / "data" / "sweep.yaml", yaml.safe_dump(grid)
    if not grid_path.is_file() or grid_path.read_text(encoding="utf-8") != text:
        grid_path.write_text(text, encoding="utf-8")  # (on --resume: kept, as the data are)
    planned = sweep.plan(str(grid_path))
    sweep.prepare(planned)
    sweep.save_plan(planned)  # the demo's root is its own: no other sweep can hold it
    return planned


def sweep_html(root: Path, cfg: DemoConfig, planned, failures: dict[str, str]) -> str:
    """The sweep's own page and results.csv, and its section of the demo's page."""
    from tether.tools import sweep_report

    sweep_report.write(planned, failures)
    body, summary = sweep_report.section(planned, failures, page_dir=root, configs=False)
    print(summary)
    return ("<h2 id='sweep'>Which beta? A sweep</h2><p>PPO with a fixed beta at each of "
            f"{', '.join(f'{b:g}' for b in cfg.sweep_betas)}, one seed, "
            f"{cfg.sweep_batches} batches each. " + html.escape(sweep_scope(cfg)) + " The sweep's own "
            "page is <a href='sweep/report.html'>sweep/report.html</a>, its grid "
            "<a href='data/sweep.yaml'>data/sweep.yaml</a> (run it yourself with "
            "<code>tether sweep</code>).</p>" + body)


def sweep_scope(cfg: DemoConfig) -> str:
    """What the sweep's runs are next to the main runs: shorter, one seed, and (same seed, same
    settings, constant learning rate, an evaluation stream seeded apart from training) an exact
    replay of the first batches of the main run with the same beta."""
    same = [f"beta {b:g} is the first {cfg.sweep_batches} batches of {name} seed {cfg.seed}"
            for b in cfg.sweep_betas
            for name, beta in (("ppo-no-kl", 0.0), ("ppo-fixed", cfg.fixed_beta)) if b == beta]
    return (f"These runs are shorter than the {cfg.ppo_batches} batches above and use seed "
            f"{cfg.seed} only, so they answer a different question: which beta is best after "
            f"{cfg.sweep_batches} batches" + (f" ({'; '.join(same)}, the same numbers at the "
                                               "same steps)" if same else "") +
            ". A beta that trails here may still be climbing; the runs above show where a longer "
            "run goes.")


def demo_settings(root: Path, cfg: DemoConfig, minutes: float, jobs: int,
                  resumed: bool = False) -> dict[str, str]:
    """Every value that shaped the results, read back from the runs' own config.yaml files."""
    from tether import version
    from tether.tools.report import read_run

    sft, rm, dpo, ipo, ppo = (read_run(root / run).config for run in (
        "sft", "rm", "dpo", "ipo", f"ppo-fixed-seed{cfg.seed}"))
    rm_accuracy = read_run(root / "rm").series("eval/accuracy")[1]
    seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
    offline = "lr {lr:g}, beta {beta:g}, {epochs} epochs, batch {batch_size}"
    return {
        "SFT": f"lr {sft['lr']:g}, {sft['max_steps']} steps, batch {sft['batch_size']}, "
               f"warm-up {sft['warmup_steps']} steps",
        "reward model": f"lr {rm['lr']:g}, {rm['epochs']} epochs, batch {rm['batch_size']}, "
                        f"held-out accuracy {rm_accuracy[-1]:.3f} on {rm['eval_fraction']:.0%} "
                        "of the pairs" if rm_accuracy else "no held-out accuracy logged",
        "PPO": f"lr {ppo['lr']:g}, batch {ppo['batch_size']}, {ppo['ppo_epochs']} epochs per "
               f"batch, {cfg.ppo_batches} batches, {ppo['max_new_tokens']} new tokens, "
               f"evaluated every {ppo['eval_every']} batches",
        "PPO betas": f"no KL 0; fixed {cfg.fixed_beta:g}; adaptive from {cfg.adaptive_start_beta:g}"
                     f" to KL target {cfg.kl_target:g} nats, horizon {cfg.kl_horizon} episodes",
        "DPO": offline.format(**dpo), "IPO": offline.format(**ipo),
        "evaluation prompts": f"{len((root / 'data' / 'eval_prompts.jsonl').read_text().splitlines())}"
                              " held-out prompts, one sample each, temperature "
                              f"{ppo['temperature']:g}",
        "seeds": f"data, SFT, RM, DPO, IPO and the sweep: {cfg.seed}; PPO: {seeds}",
        "sweep": (f"betas {[float(b) for b in cfg.sweep_betas]}, {cfg.sweep_batches} batches"
                  if cfg.sweep_betas else "off"),
        "tether version": version(), "quick": str(cfg.quick),
        "wall time": f"{minutes:.1f} min, {jobs} stage(s) at a time"
                     + (" (this run, resumed; not the stages finished before)" if resumed else ""),
    }


# What the stages import, imported by each worker as it starts (while SFT trains): the
# trainers, and what they import only once they load a model (GPT-2's modules, seconds of CPU),
# check for an adapter (peft) or open the run's tracker (tensorboard, where installed: the
# default --report-to auto).
WORKER_IMPORTS = ("tether.demo.pipeline", "tether.train.ppo", "tether.train.dpo",
                  "tether.tools.evaluate", "tether.tools.sweep", "tether.rl.engines.native",
                  "transformers.models.gpt2.modeling_gpt2", "peft",
                  *(("torch.utils.tensorboard",) if installed("tensorboard") else ()))

# Each stage's work in PPO batches of the demo's size (32 prompts, 20 new tokens, 4 epochs),
# measured on 2 CPU cores with one thread per stage: only the order and the time-left estimate
# read them. A DPO or IPO run (2 epochs of 1,000 pairs, then an evaluation) costs about as much
# as OFFLINE_COST batches; the SFT model's evaluation about one.
OFFLINE_COST, EVAL_COST = 12.0, 1.0


def stages(root: Path, cfg: DemoConfig, paths: dict[str, str], policy: str, reward_model: str,
           planned) -> list[Job]:
    """Everything after SFT and the reward model, each a job (tether.run.jobs) that reads only
    their outputs and writes only its own run directory, so that they can run side by side."""
    from tether.tools import sweep

    shared = (root, cfg, paths, policy, reward_model)
    out = [Job(f"{name}-seed{seed}", run_ppo, (*shared, name, seed), cost=cfg.ppo_batches)
           for seed in range(cfg.seed, cfg.seed + cfg.seeds) for name in PPO_VARIANTS]
    out += [Job(name, run_offline, (*shared, name), cost=OFFLINE_COST) for name in OFFLINE]
    out.append(Job("sft-eval", evaluate_model, (policy, policy, reward_model, paths, "sft", cfg,
                                                eval_path(root, "sft-eval")), cost=EVAL_COST))
    if planned is not None:
        out += [Job(f"sweep/{run.name}", sweep.execute_run, (run,), cost=cfg.sweep_batches)
                for run in planned.runs]
    return out


def finished_result(root: Path, cfg: DemoConfig, stage: Job) -> tuple[bool, object]:
    """(True, its result) for a stage that an earlier run of this demo finished, read back from
    its run directory; (False, None) for one still to run or resume."""
    if stage.name.startswith("sweep/"):
        from tether.tools.sweep_plan import state

        return state(stage.args[0]) == "done", None  # (the sweep's page reads its runs itself)
    if stage.name in (*OFFLINE, "sft-eval"):
        path = eval_path(root, stage.name)
        name = stage.name.removesuffix("-eval")  # the SFT model's curve is "sft"
        return (True, read_eval(path, name, cfg.seed)) if path.is_file() else (False, None)
    from tether.run.rundir import run_finished

    if not run_finished(root / stage.name):
        return False, None
    name, seed = stage.name.rsplit("-seed", 1)
    return True, read_curve(root / stage.name, name, int(seed))


def run(cfg: DemoConfig) -> Path:
    """Run the demo end to end (with `resume`: what an earlier run of it left undone); returns
    the report's path."""
    given, cfg = cfg, cfg.scaled()
    root = Path(cfg.output_dir) / cfg.run_name
    resumed = check_root(root, given)
    record_settings(root, given)  # (the same file again on --resume: it was checked equal)
    started = time.perf_counter()
    jobs = cfg.jobs or available_cores()
    print("[0/2] data, tokenizer and an untrained tiny GPT-2; then SFT and the reward model",
          flush=True)
    try:
        # The workers start first: their imports run on the cores this process leaves free
        # while it imports torch and trains SFT, not after SFT on the critical path.
        with Workers(jobs if jobs > 1 else 0, warm=WORKER_IMPORTS) as workers:
            return _run(cfg, root, started, jobs, workers, resumed)
    except (interrupt.Interrupted, KeyboardInterrupt) as exc:  # a stop: say how to go on
        raise interrupted(exc, given) from None


def _run(cfg: DemoConfig, root: Path, started: float, jobs: int, workers: Workers,
         resumed: bool) -> Path:
    import torch
    from transformers.utils import logging as hf_logging

    if cfg.device == "cpu":
        # Tiny models: one thread is as fast on a quiet machine, and faster on a busy one
        # (docs/benchmarks.md, "CPU threads"); every stage's --threads 0 agrees.
        torch.set_num_threads(1)
    # The stages' own progress bars tell the story; transformers' per-load bars only add noise.
    hf_logging.disable_progress_bar()
    paths = prepare_data(root, cfg)
    policy, reward_model = train_sft_and_rm(root, cfg, paths)
    planned = plan_sweep(root, cfg, paths, policy, reward_model) if cfg.sweep_betas else None
    every = stages(root, cfg, paths, policy, reward_model, planned)
    kept = {s.name: finished_result(root, cfg, s) for s in every} if resumed else {}
    results = {name: result for name, (done, result) in kept.items() if done}
    todo = [s for s in every if s.name not in results]
    print(f"[{2 + len(results)}/{2 + len(every)}] SFT and the reward model done "
          f"({time.perf_counter() - started:.0f} s); "
          + (f"{len(results)} stages finished before, " if resumed else "")
          + f"{len(todo)} stages to run, {jobs} at a time"
          + (f", each one's output in {root / 'logs'}" if jobs > 1 else ""), flush=True)
    # A stage finished before counts as done; the time left is measured on this run's own.
    progress = Progress(todo, jobs, started, done_before=2 + len(results), total=2 + len(every))
    ran, failures = run_jobs(todo, jobs, root / "logs", progress, workers=workers,
                             keep_going=lambda stage: stage.name.startswith("sweep/"))
    results |= ran
    workers.close()
    curves = [results[stage.name] for stage in every if stage.fn is run_ppo]  # (seed by seed)
    curves += [results["sft-eval"], *(results[name] for name in OFFLINE)]
    section = "" if planned is None else sweep_html(root, cfg, planned, {
        k.removeprefix("sweep/"): v for k, v in failures.items()})
    from tether.demo.report import write_report

    run_dirs = [root / name for name in ("sft", "rm")] + [
        root / f"{name}-seed{cfg.seed}" for name in PPO_VARIANTS] + [root / "dpo", root / "ipo"]
    settings = demo_settings(root, cfg, (time.perf_counter() - started) / 60, jobs, resumed)
    path, summary = write_report(curves, root, cfg.kl_target, settings, run_dirs, section)
    print(summary)
    print(f"report written to {path}")
    return path
