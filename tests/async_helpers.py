"""What the tests of asynchronous generation (--max-staleness) share: a run that records what
each batch trained on and from which weights, and the recomputation they are checked against."""

from __future__ import annotations

import torch

from tether.models.lora import LoraSpec
from tether.models.pretrained import load_tokenizer, load_trainable_lm
from tether.rl.engines import ahead
from tether.rl.scoring import score_rollout
from tether.train import ppo


def recorded_run(cfg, monkeypatch, reward_fn):
    """Run `cfg` and return, per batch, (the rollout it trained, a copy of the trainable
    weights the update started from, the version it started from, its `BatchUpdate`), and the
    generator's thread count as it reported it (None: no generator started)."""
    seen, started = [], []
    real, real_start = ppo.update_batch, ahead.start

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(ahead, "start", start)

    def spy(roles, reference, optimizer, rollout, scores, beta, spec, generator, placed=None,
            version=0):
        state = {k: v.detach().clone() for k, v in roles.policy.named_parameters()}
        done = real(roles, reference, optimizer, rollout, scores, beta, spec, generator, placed,
                    version)
        seen.append((rollout, state, version, done))
        return done
    monkeypatch.setattr(ppo, "update_batch", spy)
    ppo.run(cfg, reward_fn=reward_fn)
    return seen, started[0].threads if started else None


def policy_as_loaded(cfg) -> torch.nn.Module:
    """The starting policy of `cfg`, loaded as the trainer loads it (the pad row, LoRA)."""
    return load_trainable_lm(cfg.policy, load_tokenizer(cfg.policy), LoraSpec.from_config(cfg),
                             "float32", False).model.eval()


def logprobs_under(model: torch.nn.Module, state: dict | None, rollout) -> torch.Tensor:
    """[B, R] log-probs of the rollout's tokens under `model` with `state` loaded (None: as it
    is), at the rollout's temperature."""
    if state is not None:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return score_rollout(model, model, None, rollout, rollout.temperature,
                             len(rollout)).logprobs


def check_behaviour_policy(seen, cfg, model, tolerance: float) -> None:
    """Batch b's recorded behaviour log-probs are the weights' of batch b - L (L =
    `cfg.batches_ahead`, batch 0's before it: the start), within `tolerance`; no token is more
    than S steps stale; from batch 2 on, the weights that train it are another policy."""
    lag = cfg.batches_ahead
    for b, (rollout, _state, version, done) in enumerate(seen):
        behaviour = seen[max(b - lag, 0)][1]
        mask = rollout.action_mask
        recomputed = logprobs_under(model, behaviour, rollout)
        assert (recomputed - rollout.engine_logprobs).abs()[mask].max() < tolerance, b
        assert int((version - rollout.versions[mask]).max()) <= cfg.max_staleness, b
        if b >= 2:
            assert (done.old.logprobs - rollout.engine_logprobs).abs()[mask].max() > 1e-3, b
