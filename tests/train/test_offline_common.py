import math

import pytest
import torch

from tether.run.optim import lr_factor, make_lr_schedule, make_optimizer


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
