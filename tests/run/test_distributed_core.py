"""tether.run.distributed and the rank slices of tether.run.slicing: the one-process behaviour
of every helper, and, under torchrun with two gloo processes, one optimizer step through
`Parallel` under DDP and FSDP2 equal to the one-process step on the same global batch (the
property every stage's data parallelism rests on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrun_helpers import free_port

from tether.run import distributed as D
from tether.run.slicing import rank_slice, shard


def test_rank_slices_tile_the_batch_in_order():
    for n in (0, 1, 5, 8, 13):
        for world in (1, 2, 3, 4):
            parts = [list(range(n))[rank_slice(n, D.Dist(rank=r, world_size=world))]
                     for r in range(world)]
            assert sum(parts, []) == list(range(n))  # contiguous, in rank order, nothing lost
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_rank_slices_keep_groups_whole_when_k_divides_the_share():
    k, world = 4, 2
    rows = [i // k for i in range(16)]  # prompt index of each row, k samples per prompt
    for r in range(world):
        mine = shard(rows, D.Dist(rank=r, world_size=world))
        assert all(mine.count(p) == k for p in set(mine))


def test_one_process_helpers_return_their_input():
    d = D.Dist()
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    assert torch.equal(D.all_reduce_sum(t, d), t.detach()) and not D.all_reduce_sum(t, d).requires_grad
    assert D.global_sum(3, d) == 3.0
    assert D.global_mean(6.0, 4.0, d) == 1.5
    assert D.global_mean(0.0, 0.0, d) == 0.0  # no rows: 0, not a division by zero
    assert D.all_gather_rows(t, d) is t
    assert D.broadcast_object({"a": 1}, d) == {"a": 1}
    assert D.all_agree(True, d) and not D.all_agree(False, d)
    assert d.is_main and not d.active and d.grad_scale == 1.0


def test_parallel_runs_any_function_of_the_model_and_unwraps():
    model = nn.Linear(3, 2)
    wrapped = D.wrap(model, D.Dist())
    assert isinstance(wrapped, D.Parallel) and D.unwrap(wrapped) is model
    x = torch.randn(4, 3)
    assert torch.equal(wrapped(lambda m, v: m(v) * 2, x), model(x) * 2)
    with D.no_sync(wrapped, skip=True):  # a no-op for one process
        pass


def test_fsdp_outside_torchrun_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(Exception, match="--fsdp needs several processes: launch with torchrun"):
        D.setup(torch.device("cpu"), fsdp=True)


def test_transformer_layers_finds_the_repeated_blocks(tiny_model_dir, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    for path in (tiny_model_dir, tiny_llama_dir):
        model = AutoModelForCausalLM.from_pretrained(path)
        layers = D.transformer_layers(model)
        assert len(layers) == model.config.num_hidden_layers


STEP = textwrap.dedent("""
    import os, sys, torch
    from transformers import AutoModelForCausalLM
    from tether.run import distributed as D
    from tether.run.slicing import rank_slice
    mode, path, out = sys.argv[1:4]

    def step(d):
        model = AutoModelForCausalLM.from_pretrained(path)
        wrapped = D.wrap(model, d)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
        ids = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(1))
        mine = ids[rank_slice(len(ids), d)]
        def loss_fn(m, x):  # the sum over the global batch's rows / the global row count
            return m(input_ids=x).logits.float().pow(2).mean(dim=(1, 2)).sum()
        loss = wrapped(loss_fn, mine) / D.global_sum(len(mine), d) * d.grad_scale
        loss.backward()
        opt.step()
        return D.full_state_dict(wrapped, d)

    d = D.setup(torch.device("cpu"), fsdp=mode == "fsdp")
    state = step(d)  # the wrapped model is gone when it returns, as at the end of a stage's run
    if d.is_main:
        torch.save(state, out)
    D.teardown()
    if os.path.isdir("/proc/self/task"):  # the threads left (Linux), for the test to check
        names = [open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")]
        with open(f"{out}.threads.{d.rank}", "w") as f:
            f.write("\\n".join(names))
    D.exit_process(0)  # as the tether command ends a torchrun rank
""")

GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop"}  # a gloo group's workers and network loop


@pytest.mark.across_processes
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_take_the_one_process_step(mode, tiny_llama_dir, tmp_path: Path):
    script = tmp_path / "step.py"
    script.write_text(STEP)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(script), "ddp", str(tiny_llama_dir), str(one)],
                   check=True, env=env, capture_output=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), mode,
                           str(tiny_llama_dir), str(two)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = torch.load(one), torch.load(two)
    start = AutoModel_state(tiny_llama_dir)
    assert set(a) == set(b)
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    assert moved > 1e-4  # the step did something, so equality below means something
    # A different computation (tests/processes.py): the ranks sum the gradient as two halves,
    # which rounds otherwise by a few FLOAT32_EPS of each gradient entry; one SGD step of lr 1
    # carries that into the weights (magnitude ~0.02-1 here) as a few roundings: 1e-6 is ~8.
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    if mode == "ddp" and sys.platform == "linux":
        # teardown freed the group, and the group's destructor joined gloo's threads (with
        # torch.distributed.nn.functional first imported after the group existed, its defaults
        # kept the group, and its threads ran into interpreter exit: see distributed.setup)
        for rank in (0, 1):
            names = Path(f"{two}.threads.{rank}").read_text().split()
            assert names and not set(names) & GLOO_THREADS, (rank, names)


def AutoModel_state(path) -> dict[str, torch.Tensor]:  # noqa: N802 - reads like the class it uses
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()
