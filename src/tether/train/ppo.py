"""`tether ppo`: PPO that maximises R(x, y) - beta * KL(pi || pi_ref), KL per token.

The loop in `run` is the algorithm, top to bottom (Ziegler et al. 2019; Stiennon et al. 2020;
Ouyang et al. 2022):

    for each batch of prompts x:
        y ~ pi_old(. | x)                          engine.sample (tether.rl.engines); with
                                                    --max-staleness sampled earlier by an older
                                                    copy (rl.engines.ahead), decoupled PPO
        s = R(x, y)                                 reward model or Python function
        log pi_old, log pi_ref, V_old on (x, y)     score the same tokens (tether.rl.scoring)
        r_t = -beta * kl_t (+ s at the last token)  advantages.kl_shaped_rewards
        A, G = GAE(r, V_old)                        or rloo, grpo, reinforce++ without a critic
        PPO epochs on the clipped losses            tether.rl.update.ppo_update
        engine.sync()                               the engine takes the new weights
        beta <- controller(mean_seq KL, batch)      kl.AdaptiveKL / FixedKL / AnnealedKL

The middle four lines are one call, `tether.rl.update.update_batch`, the one update path (it
alone decides whether the update's forward also scores pi_old). The engine is whichever
--engine names (`tether.rl.engines.RolloutEngine`: the native sampler on the trainer's model, or
vLLM fed the weights in memory); the loop never asks which, and the trainer scores every token
itself. Setup (loading, checks, the settings each piece takes) lives in `ppo_setup.py`; under
torchrun every rank runs this loop on its rows of each global batch (`tether.rl.roles`) and rank
0 writes. `tether rloo` and `tether grpo` are this loop with other defaults
(`ppo_config.RLOOConfig`, `GRPOConfig`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from tether.advantages import ScoreNormalizer, overlong_penalty
from tether.errors import TetherError
from tether.models.adapter_checks import check_resumed_base, with_base_record
from tether.models.forward import autocast
from tether.models.lora import LoraSpec
from tether.models.pretrained import load_trainable_lm
from tether.models.saving import save_trained_lm
from tether.rl.anchor import TENSOR_PREFIX as ANCHORED
from tether.rl.dynamic_sampling import FAILURE_ROUNDS, Drawn, collect
from tether.rl.reward import NonFiniteScore
from tether.rl.roles import any_rank, check_same_beta, gather_failed, gather_rollout
from tether.rl.rollout import Rollout
from tether.rl.update import BatchUpdate, update_batch
from tether.run import interrupt
from tether.run.checkpoint import load_latest_checkpoint, save_checkpoint
from tether.run.distributed import all_gather_objects, all_gather_rows, barrier, global_mean
from tether.run.optim import NonFiniteStep, step_schedule
from tether.run.rundir import RunDir, RunResult, progress
from tether.run.slicing import rank_slice
from tether.run.user_code.load import function_name
from tether.train.offline import stage_cli
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_log import (
    batch_metrics,
    final_evaluation,
    log_batch,
    log_evaluation,
    progress_fields,
)
from tether.train.ppo_setup import Setup, batch_rows, build
from tether.train.ppo_watch import Watch, nothing_learned, watch_for


def run(cfg: PPOConfig, reward_fn=None, gold_fn=None, env=None) -> RunResult:
    """Train with PPO; returns the final policy's directory and the last batch's metrics.

    `reward_fn` / `gold_fn`: Python callables `(prompts, responses) -> list[float]` or in TRL's
    form (`reward_fn` may be a list of them, weighted by --reward-weights), used instead of
    --reward-fn / --gold-fn (give a reward one way only). `env`: an environment factory (a
    class or a function returning an environment; docs/agents.md), used instead of --env.
    """
    if env is not None and not cfg.env:  # recorded by name: config.yaml says what ran
        cfg = replace(cfg, env=function_name(env))
    rundir = RunDir(cfg.output_dir, cfg.run_name, resume=cfg.resume)  # checked, not yet created
    rundir.check_resume(cfg)  # another run's settings: refused before a model loads
    setup = build(cfg, reward_fn=reward_fn, gold_fn=gold_fn, env=env)  # bad input fails here
    d, metrics, bar, batch = setup.dist, {}, None, None
    try:
        watch = watch_for(cfg, quiet=not d.is_main)
        models, normalizer, start = begin(rundir, setup, cfg, watch)
        bar = progress(cfg.n_batches, f"{cfg.STAGE} {cfg.run_name}", initial=start)  # rank 0 shows
        for batch in range(start, cfg.n_batches):
            step = batch + 1
            started = time.perf_counter()
            seed = batch_seed(cfg, batch)
            if setup.reward_functions is not None:  # TRL's trainer_state.global_step: steps done
                setup.reward_functions.state.global_step = batch
            # 1. Rollout and reward (each rank samples its rows; every rank then holds the global
            #    batch); with --dynamic-sampling, groups of equal scores are replaced.
            drawn, drawn_stats = collect_batch(setup, cfg, batch, seed)
            sample_ahead(setup, cfg, batch)  # --max-staleness: later batches, during the update
            prompts, rollout, raw_scores = drawn.prompts, drawn.rollout, drawn.raw_scores
            mine = rank_slice(len(prompts), d)
            scores = batch_scores(drawn, normalizer, cfg)

            # 2-4. Score the tokens (pi_old, ref, V_old), shape the rewards (-beta * kl_t; with
            #      the KL in the loss, beta moves there), advantages, PPO epochs; engine sync.
            beta = setup.kl_ctl.beta
            done, lr = update(setup, rollout, scores, beta, seed, step,
                              drawn.turn_rewards if cfg.reward_per_turn else None)

            # 5. Controller: the batch mean of per-sequence summed KL, and the batch size.
            seq_kl = sequence_kl(done)
            setup.kl_ctl.update(seq_kl, len(rollout))
            check_same_beta(setup.kl_ctl.beta, d)

            metrics = batch_metrics(rollout, raw_scores, scores, done, beta, seq_kl, lr,
                                    time.perf_counter() - started, setup.critic is not None)
            metrics |= drawn_stats  # --dynamic-sampling's
            watch.check_learned(step, nothing_learned(step, len(rollout), done.loss_rows,
                                                      done.zero_advantages, cfg,
                                                      setup.critic is not None),
                                trained=done.loss_rows > 0)
            if cfg.eval_prompts and cfg.eval_every and step % cfg.eval_every == 0:
                metrics.update(log_evaluation(rundir, setup, cfg, step))
            log_batch(rundir, cfg, step, metrics, prompts[mine], rollout.select(mine),
                      setup.tokenizer, raw_scores[mine])
            bar.update(1)
            bar.set_postfix(**progress_fields(metrics))
            # Decided from global numbers, so every rank stops or saves alike; rank 0 warns.
            watch.check(metrics, step)
            stopping = any_rank(interrupt.requested(), d)
            due = cfg.save_every and (step % cfg.save_every == 0 or step == cfg.n_batches)
            if due or stopping:
                checkpoint(rundir, setup, cfg, models, step, normalizer, watch)
            if stopping:  # Ctrl-C or SIGTERM: stop here, resumable
                raise interrupt.stop(step, str(rundir.checkpoint_dir))
        watch.check_trained(cfg)  # before final/: the starting policy is not a trained one
        bar.close()
        return finish(rundir, setup, cfg, metrics)  # in the try: a failed final evaluation too
    except (NonFiniteStep, NonFiniteScore) as exc:  # step 0's evaluation has no batch to name
        where = "" if batch is None else f"batch {batch + 1}: "
        raise TetherError(f"{where}{exc}") from None
    finally:
        if bar is not None:
            bar.close()
        if sys.exc_info()[0] is not None:
            rundir.release()  # stopped: free the directory, as an exiting process would
            # a failed or stopped run leaves no engine behind: one left to vLLM's exit hook
            # prints a traceback after the error line, once the process group is gone
            close_sources(setup)


def begin(rundir: RunDir, setup: Setup, cfg: PPOConfig, watch: Watch
          ) -> tuple[dict[str, torch.nn.Module], ScoreNormalizer, int]:
    """Before the first batch: the config recorded (rank 0 writes it; every rank checks a resumed
    one), a resumed run's state (`watch`'s count of trained batches too) restored and pushed to
    the engine, step 0 evaluated. Returns the checkpointed models, the score normaliser and the
    batch to start from."""
    rundir.save_config(cfg)
    models = {"policy": setup.policy} | ({"critic": setup.critic} if setup.critic else {})
    normalizer = ScoreNormalizer(cfg.score_norm)
    start = restore(rundir, setup, cfg, models, normalizer, watch) if cfg.resume else 0
    if start > 0:
        setup.engine.sync()  # the resumed weights
    if cfg.eval_prompts and cfg.eval_every and start == 0:
        # Step 0, the SFT policy: the point every proxy/gold and reward/KL curve starts from.
        rundir.log(0, log_evaluation(rundir, setup, cfg, 0) | {"objective/beta": setup.kl_ctl.beta})
    return models, normalizer, start


def finish(rundir: RunDir, setup: Setup, cfg: PPOConfig, metrics: dict[str, float]) -> RunResult:
    """After the last batch: the final evaluation, the engine stopped, the policy saved."""
    metrics |= final_evaluation(rundir, setup, cfg)
    close_sources(setup)
    save_policy(rundir, setup, cfg)
    metrics["objective/beta_final"] = setup.kl_ctl.beta
    return RunResult(output_path=rundir.final_dir, metrics=metrics)


def close_sources(setup: Setup) -> None:
    """Stop the engine, then the environments' event loops: episodes still running ahead of the
    trainer (a run that failed meanwhile) end at their next turn once the engine is gone, and
    a loop is closed only when nothing runs on it."""
    setup.engine.close()
    setup.source.close()
    if setup.eval is not None:
        setup.eval.source.close()


def update(setup: Setup, rollout: Rollout, scores: torch.Tensor, beta: float, seed: int,
           step: int, placed: torch.Tensor | None = None) -> tuple[BatchUpdate, float]:
    """Steps 2-4 and the schedule's step, then the anchor moved if --ref-update says so after
    batch `step`; (what they did, the learning rate they used). The engine sleeps through them
    (a GPU engine frees its KV cache) and takes the new weights after, for the next rollout."""
    setup.engine.sleep()
    anchor = setup.anchor  # None: the frozen SFT model
    to_start = anchor.kl_to_start(setup.roles, rollout, setup.spec) if anchor else {}  # pi_old's
    done = update_batch(setup.roles, setup.reference, setup.optimizer, rollout, scores, beta,
                        setup.spec, torch.Generator().manual_seed(seed), placed,
                        setup.steps.version)
    done.stats |= to_start
    if anchor is not None:
        anchor.after_batch(step, setup.optimizer)
    lr = setup.scheduler.get_last_lr()[0]  # the rate this batch's update used
    step_schedule(setup.scheduler)  # by batch, whether or not this one took a step
    synced = time.perf_counter()
    setup.engine.sync()  # the next rollout samples the policy just updated
    done.stats["perf/engine_sync_s"] = time.perf_counter() - synced
    return done, lr


def sequence_kl(done: BatchUpdate) -> float:
    """The batch mean of the per-sequence summed KL the rewards were shaped with, what the
    controller reads; rows sampled ahead (--max-staleness) weigh each token as its surrogate
    does (decoupled PPO's w), so the mean is pi_old's, not the stale copy's."""
    kl = done.kl if done.kl_weights is None else done.kl * done.kl_weights
    return kl.sum(dim=1).mean().item()


def batch_seed(cfg: PPOConfig, batch: int) -> int:
    """Batch `batch`'s noise seed: per batch, so a resumed run draws the same noise."""
    return cfg.seed * 1_000_003 + batch


def sample_ahead(setup: Setup, cfg: PPOConfig, batch: int) -> None:
    """Ask the engine now for the batches after `batch` up to --max-staleness's reach
    (`PPOConfig.batches_ahead`, none when synchronous): an engine sampling ahead samples them
    while `batch` trains, by the weights it starts from (each once: a batch asked for before is
    not asked again); the others ignore it. Their first round only: a --dynamic-sampling refill
    is sampled when needed, by the weights of its time."""
    for later in range(batch + 1, min(batch + 1 + cfg.batches_ahead, cfg.n_batches)):
        rows = batch_rows(setup, cfg, later)
        setup.source.prefetch(rows, rank_slice(len(rows), setup.dist), batch_seed(cfg, later))


def collect_batch(setup: Setup, cfg: PPOConfig, batch: int, seed: int
                  ) -> tuple[Drawn, dict[str, float]]:
    """The global rollout batch `batch` on every rank (prompts, rollout, raw scores) and its
    stats: round 0 alone, or with --dynamic-sampling the groups whose scores vary, refilled from
    further rounds (`tether.rl.dynamic_sampling`); either way the groups with a row the reward
    pool could not score are refilled so. `seed`: round 0's noise; round j's is offset past
    every batch's, so each round draws its own."""
    d = setup.dist

    def draw(round_: int) -> Drawn:
        rows = batch_rows(setup, cfg, batch, round_)
        mine = rank_slice(len(rows), d)
        n = mine.stop - mine.start  # this rank's prompt rows: its episodes, whatever their rows
        # Each rank draws its rows from the source (the prompts answered once, or environments'
        # episodes). With --mixed-precision bf16 every model forward runs under autocast;
        # log-probs, values and scores come out in fp32.
        with autocast(cfg.mixed_precision, setup.dist.device):
            part = setup.source.collect(rows, mine, seed + round_ * 1_000_000_007)
        rollout = gather_rollout(part.rollout, d, setup.tokenizer.pad_token_id)
        raw_scores = all_gather_rows(part.scores, d)
        turns = (None if part.turn_rewards is None else all_gather_rows(
            F.pad(part.turn_rewards, (0, rollout.responses.shape[1]
                                      - part.turn_rewards.shape[1])), d))
        return Drawn(all_gather_objects(part.prompts, d), rollout, raw_scores,
                     penalised_scores(raw_scores, rollout, cfg), turns,
                     {k: global_mean(v * n, n, d) for k, v in part.stats.items()},
                     gather_failed(part.failed, mine.start, d))

    def say(note: str, kind: str = "note") -> None:  # rank 0's: every rank has the global rows
        if d.is_main:
            print(f"{kind}: batch {batch + 1}: {note}", file=sys.stderr, flush=True)
    drawn, stats = collect(draw, cfg.samples_per_prompt, cfg.dynamic_sampling or FAILURE_ROUNDS,
                           setup.tokenizer.pad_token_id, say,
                           lambda line: say(line, "warning"), dynamic=cfg.dynamic_sampling > 0)
    return drawn, stats | drawn.stats


def batch_scores(drawn: Drawn, normalizer: ScoreNormalizer, cfg: PPOConfig) -> torch.Tensor:
    """The [B] scores the rewards are shaped with: the penalised scores (`penalised_scores`, as
    the batch's `Drawn` holds them), normalised (--score-norm), clipped to +-(--reward-clip),
    each on an episode's last row (an episode a template split into segments has several rows;
    the others score 0). With --reward-per-turn the turns' rewards sit on their own tokens
    (`Drawn.turn_rewards`) and these scores hold the length penalties alone."""
    last = drawn.rollout.last_rows()
    penalised = drawn.scores - (drawn.raw_scores if cfg.reward_per_turn else 0.0)
    scores = torch.zeros_like(penalised)
    scores[last] = normalizer(penalised[last])
    return scores.clamp(-cfg.reward_clip, cfg.reward_clip) if cfg.reward_clip > 0 else scores


def penalised_scores(raw_scores: torch.Tensor, rollout: Rollout, cfg: PPOConfig) -> torch.Tensor:
    """[B] raw scores less --missing-eos-penalty for responses (episodes) that never ended, plus
    DAPO's --overlong-penalty for long ones, counted over the policy's own tokens (an episode's,
    over all its rows), on each episode's last row."""
    last = rollout.last_rows()
    scores = raw_scores - cfg.missing_eos_penalty * (~rollout.ended & last).float()
    if cfg.overlong_penalty:
        sampled = rollout.action_mask.sum(dim=1)  # the policy's own tokens, not observations
        lengths = rollout.episode_sums(sampled)[rollout.episode_ids()]  # on each episode's rows
        limit = cfg.resolved_max_episode_tokens if cfg.episodic else cfg.max_new_tokens
        scores = scores + overlong_penalty(lengths, limit, cfg.overlong_penalty) * last
    return scores


def restore(rundir: RunDir, setup: Setup, cfg: PPOConfig, models: dict,
            normalizer: ScoreNormalizer, watch: Watch) -> int:
    """With --resume: the latest checkpoint into every rank's models, optimizer, schedule,
    controller, normaliser, policy version, the engine's state and `watch`'s count of trained
    batches, and with --max-staleness the batches in flight asked for again; returns the batch to
    start from (0 without one)."""
    state = load_latest_checkpoint(rundir.checkpoint_dir, models, setup.optimizer,
                                   setup.scheduler)
    if state is not None:
        check_resumed_base(state, models["policy"], rundir.checkpoint_dir)
        setup.kl_ctl.load_state_dict(state["kl_ctl"])
        normalizer.load_state_dict(state["score_norm"])
        watch.trained = state.get("trained_batches")  # None: an older checkpoint did not count
        setup.steps.version = state.get("policy_version", 0)
        tensors = state.pop("tensors", {})  # the moving reference's, then the engine's
        if setup.anchor is not None:  # a moving reference
            setup.anchor.load_state_tensors({k: v for k, v in tensors.items()
                                             if k.startswith(ANCHORED)})
        if others := {k: v for k, v in tensors.items() if not k.startswith(ANCHORED)}:
            state["tensors"] = others
        # The engine's own state (with --max-staleness, the weights of the batches in flight),
        # then those batches asked for again as the uninterrupted run asked for them, each by
        # the weights of its time, before the sync that sends the restored ones.
        setup.engine.load_state_dict(state)
        sample_ahead(setup, cfg, state["batch"] - 1)
    # Lines logged after the checkpoint will be logged again.
    rundir.announce_resume(state["batch"] if state is not None else None)
    rundir.truncate_metrics(after_step=state["batch"] if state is not None else -1)
    return state["batch"] if state is not None else 0


def save_policy(rundir: RunDir, setup: Setup, cfg: PPOConfig) -> None:
    """Rank 0 writes the final policy. Under FSDP2 no rank holds it whole: the shards are
    gathered into a fresh copy of the starting model on rank 0, saved by the same code."""
    lm = setup.lm
    if setup.dist.fsdp:
        state = setup.roles.full_policy_state()  # every rank gathers; rank 0 receives
        if setup.dist.is_main:
            lm = load_trainable_lm(cfg.policy, setup.tokenizer, LoraSpec.from_config(cfg),
                                   cfg.dtype, cfg.trust_remote_code)
            fresh = lm.model.state_dict()
            lm.model.load_state_dict({k: v for k, v in state.items() if k in fresh})
    if setup.dist.is_main:
        with rundir.writing_final():  # a full disk: one line saying how to complete the run
            save_trained_lm(lm, setup.tokenizer, rundir.final_dir,
                            rundir.merged_dir if cfg.merge_lora else None, cfg.temperature)
        rundir.close()
    barrier(setup.dist)


def checkpoint(rundir: RunDir, setup: Setup, cfg: PPOConfig, models: dict, step: int,
               normalizer: ScoreNormalizer, watch: Watch) -> None:
    """Every rank gathers, rank 0 writes (whole tensors: a run resumes at any world size). The
    engine's state goes with it (with --max-staleness, the weights the batches in flight are
    sampled by: `RolloutEngine.state_dict`)."""
    state = {"batch": step, "kl_ctl": setup.kl_ctl.state_dict(),
             "score_norm": normalizer.state_dict(), "trained_batches": watch.trained,
             "policy_version": setup.steps.version} | setup.engine.state_dict()
    tensors = state.pop("tensors", {}) | (setup.anchor.state_tensors() if setup.anchor else {})
    save_checkpoint(rundir.checkpoint_dir, step, models, setup.optimizer, setup.scheduler,
                    with_base_record(state, models["policy"]), config=rundir.checkpoint_config,
                    tensors=tensors)


def cli(argv: list[str]) -> int:
    """`tether ppo [--config FILE.yaml] [--field value ...]`."""
    return stage_cli(PPOConfig, run, argv)
