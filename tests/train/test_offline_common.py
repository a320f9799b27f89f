import fcntl
import json
import math
import os

import pytest
import torch

from tether.data.encoding import Encoded
from tether.errors import TetherError
from tether.run.optim import NonFiniteStep, lr_factor, make_lr_schedule, make_optimizer
from tether.run.rundir import RunDir
from tether.train.offline import example_tokens, start_training
from tether.train.offline_config import SFTConfig


@pytest.mark.parametrize("step, schedule, expected", [
    (0, "linear", 0.5),     # warm-up: (0 + 1) / 2
    (1, "linear", 1.0),     # warm-up done: (1 + 1) / 2
    (2, "linear", 1.0),     # decay starts: progress (2 - 2) / (10 - 2) = 0
    (6, "linear", 0.5),     # progress 4 / 8
    (10, "linear", 0.0),    # end
    (6, "cosine", 0.5),     # 0.5 * (1 + cos(pi / 2))
    (4, "cosine", 0.5 * (1 + math.cos(math.pi / 4))),
    (9, "constant", 1.0),
])
def test_lr_factor_by_hand(step, schedule, expected):
    assert lr_factor(step, total_steps=10, warmup_steps=2, schedule=schedule) == pytest.approx(expected)


def test_optimizer_decays_matrices_only_and_schedule_drives_lr():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = make_optimizer(model, lr=0.1, weight_decay=0.01)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}  # biases and LayerNorm weights are not shrunk
    sched = make_lr_schedule(opt, total_steps=4, warmup_steps=0, schedule="linear")
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.075, 0.05, 0.025])


# ----------------------------------------------------------------------------- train/offline.py

def _flock_is_free(directory) -> bool:
    """Whether a new descriptor can take the run directory's flock (a new open conflicts even
    with a lock of this same process)."""
    fd = os.open(directory / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _start(tmp_path, resume=False, **fields):
    """`start_training` of a one-layer model: 10 rows in batches of 2, one epoch = 5 steps."""
    cfg = SFTConfig(model="m", data="d.jsonl", run_name="r", output_dir=str(tmp_path),
                    batch_size=2, report_to="none", resume=resume, **fields)
    run_dir = RunDir(cfg.output_dir, cfg.run_name, cfg.resume)
    torch.manual_seed(0)
    steps = start_training(run_dir, cfg, torch.nn.Linear(2, 1), 10, final={"data/rows": 10.0})
    return run_dir, steps


def _logged(run_dir):
    return [json.loads(x) for x in run_dir.metrics_path.read_text().splitlines()]


def test_steps_log_every_n_and_the_last_with_final_and_checkpoint_when_due(tmp_path, capsys):
    run_dir, steps = _start(tmp_path, log_every=2, save_every=2)
    assert (steps.start, steps.total) == (0, 5)
    ran = []
    with steps:
        for step in steps:
            ran.append(step)
            steps.done(step, {"train/loss": step / 8})
    assert ran == [1, 2, 3, 4, 5]
    # every 2nd step, and the last one with the data statistics (`final`) beside its metrics
    assert _logged(run_dir) == [{"step": 2, "train/loss": 0.25}, {"step": 4, "train/loss": 0.5},
                                {"step": 5, "train/loss": 0.625, "data/rows": 10.0}]
    # a checkpoint every 2nd step but none at the last: the final model follows it
    assert sorted(p.name for p in run_dir.checkpoint_dir.iterdir()) == ["step_2", "step_4"]
    assert steps.metrics == {"train/loss": 0.625}  # the last step's, for the run's result
    assert "sft r: step 5/5 loss=0.5000" in capsys.readouterr().err  # the progress line
    assert not _flock_is_free(run_dir.path)  # a finished loop keeps the directory: the save is next


def test_no_checkpoint_at_the_last_step_even_when_it_is_due(tmp_path):
    run_dir, steps = _start(tmp_path, save_every=5)  # 5 steps: the 5th is due, and the last
    with steps:
        for step in steps:
            steps.done(step, {"train/loss": 1.0})
    assert not run_dir.checkpoint_dir.exists() or not any(run_dir.checkpoint_dir.iterdir())


def test_steps_resume_after_the_checkpoint_and_drop_the_later_lines(tmp_path):
    run_dir, steps = _start(tmp_path, log_every=1, save_every=2)
    with pytest.raises(KeyboardInterrupt), steps:
        for step in steps:
            steps.done(step, {"train/loss": float(step)})
            if step == 3:
                raise KeyboardInterrupt  # killed in step 4: the last checkpoint is step 2
    assert _flock_is_free(run_dir.path)  # a stopped loop frees the directory, as an exit would
    run_dir, steps = _start(tmp_path, resume=True, log_every=1, save_every=2)
    assert (steps.start, steps.total) == (2, 5)
    assert [line["step"] for line in _logged(run_dir)] == [1, 2]  # step 3 runs again
    assert list(steps) == [3, 4, 5]


def test_a_non_finite_step_is_one_error_naming_it_and_frees_the_directory(tmp_path):
    run_dir, steps = _start(tmp_path)
    with pytest.raises(TetherError, match=r"^step 2: the loss is nan") as caught, steps:
        for step in steps:
            if step == 2:
                raise NonFiniteStep("the loss is nan: the step was not taken")
            steps.done(step, {"train/loss": 1.0})
    assert not isinstance(caught.value, NonFiniteStep)
    assert _flock_is_free(run_dir.path)


def test_example_tokens_by_hand():
    sft_row = Encoded(prompt=[1, 2, 3], responses=[[4, 5, 6, 7]])
    pair = Encoded(prompt=[1, 2, 3], responses=[[4, 5], [6, 7, 8, 9, 10]])
    assert example_tokens([sft_row, pair], [0]) == [3 + 4]  # P + R
    assert example_tokens([sft_row, pair], [1, 0], 2) == [2 * 3 + 2 + 5, 2 * 3 + 4]  # 2 P + C + R
    assert example_tokens([sft_row, pair], [1], 1) == [3 + 2 + 5]  # one shared-prompt row
