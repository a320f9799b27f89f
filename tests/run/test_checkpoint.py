import json
import random

import numpy as np
import torch
from safetensors.torch import load_file, save

from tether.run.atomic import atomic_write_bytes, read_record
from tether.run.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint


def _setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))
    model[1].weight = torch.nn.Parameter(model[0].weight.T.contiguous())  # untied but same shape family
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def _step(model, opt, sched):
    loss = model(torch.randn(2, 3)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def test_atomic_writers_leave_no_temp(tmp_path):
    atomic_write_bytes(tmp_path / "a.json", json.dumps({"x": 1}).encode())
    atomic_write_bytes(tmp_path / "a.json", json.dumps({"x": 2}).encode())
    atomic_write_bytes(tmp_path / "w.safetensors", save({"w": torch.ones(2)}))
    assert read_record(tmp_path / "a.json", json.loads) == {"x": 2}
    assert read_record(tmp_path / "missing.json", json.loads) is None
    assert load_file(str(tmp_path / "w.safetensors"))["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "w.safetensors"]


def test_restore_gives_identical_continuation(tmp_path):
    model, opt, sched = _setup(0)
    _step(model, opt, sched)
    random.seed(5)
    np.random.seed(5)
    save_checkpoint(tmp_path, 1, {"policy": model}, opt, sched, {"data_step": 1})
    # continuation A: straight on
    _step(model, opt, sched)
    a = (random.random(), np.random.rand(), [p.clone() for p in model.parameters()], sched.get_last_lr())
    # continuation B: fresh objects, restored from the checkpoint
    model2, opt2, sched2 = _setup(1)
    state = load_latest_checkpoint(tmp_path, {"policy": model2}, opt2, sched2)
    assert state == {"data_step": 1, "step": 1}
    _step(model2, opt2, sched2)
    b = (random.random(), np.random.rand(), list(model2.parameters()), sched2.get_last_lr())
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    for p, q in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_keeps_last_k_and_ignores_temp_dirs(tmp_path):
    model, opt, sched = _setup(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"m": model}, opt, sched, {}, keep=2)
    (tmp_path / ".tmp-step_9-crashed").mkdir()  # a write that died before its rename
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert load_latest_checkpoint(tmp_path, {"m": model}, opt, sched)["step"] == 3
    assert load_latest_checkpoint(tmp_path / "none", {"m": model}, opt, sched) is None
