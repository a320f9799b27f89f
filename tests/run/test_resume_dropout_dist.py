"""Under torchrun with dropout on, kill and resume at the same world size is bit-exact (issue 23).

Dropout draws one random number per element of its tensor, so two ranks whose rows have other
lengths end a step with other RNG states. A checkpoint that kept rank 0's state alone gave it to
both ranks on resume, and rank 1's masks from then on were not the uninterrupted run's (3.1e-3
on the loss of the first resumed step of a GPT-2 SFT with its default dropout 0.1). Each rank's
own state is now saved and restored; at another world size every rank takes rank 0's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from safetensors.torch import load_file
from torchrun_helpers import ROOT, torchrun

from tether.run.checkpoint import own_rng_state


def _launch(items: list[dict], spec: Path) -> None:
    spec.write_text(json.dumps(items))
    out = torchrun([str(ROOT / "tests" / "dist_driver.py"), str(spec)])
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.across_processes  # the same computation: torchrun's ranks, one thread each, twice
def test_two_ranks_with_dropout_resume_bit_exact(tiny_model_dir, tmp_path):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert config["resid_pdrop"] == config["attn_pdrop"] == 0.1  # dropout is on
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))
    out = tmp_path / "runs"
    base = dict(model=str(tiny_model_dir), data=str(data), output_dir=str(out), max_steps=4,
                batch_size=4, device="cpu", save_every=2, log_every=1, report_to="none",
                lr=1e-3, seed=5)
    _launch([{"stage": "sft", "config": base | {"run_name": "whole"}},
             {"stage": "sft", "config": base | {"run_name": "cut"}, "stop_after": 2}],
            tmp_path / "first.json")
    checkpoint = out / "cut" / "checkpoints" / "step_2"
    assert not (out / "cut" / "final").exists() and checkpoint.is_dir()
    # the ranks' states did part (else restoring rank 0's everywhere would pass this too)
    rng = load_file(str(checkpoint / "rng.safetensors"))
    assert not torch.equal(rng["torch_cpu"], rng["rank1/torch_cpu"])
    assert json.loads((checkpoint / "state.json").read_text())["world_size"] == 2
    _launch([{"stage": "sft", "config": base | {"run_name": "cut", "resume": True}}],
            tmp_path / "resume.json")
    a = load_file(str(out / "cut" / "final" / "model.safetensors"))
    b = load_file(str(out / "whole" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    metrics = [[json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("cut", "whole")]
    assert metrics[0] == metrics[1] and [m["step"] for m in metrics[0]] == [1, 2, 3, 4]


def test_each_rank_takes_its_own_rng_state_only_at_the_world_size_that_saved_it():
    payload = {"rng": {"who": 0}, "rng_ranks": [{"who": 1}, {"who": 2}]}
    tensors = {"torch_cpu": torch.tensor([0]), "rank1/torch_cpu": torch.tensor([1]),
               "rank2/torch_cpu": torch.tensor([2])}
    for rank in range(3):
        meta, own = own_rng_state(payload, tensors, rank, 3)
        assert meta == {"who": rank} and own == {"torch_cpu": torch.tensor([rank])}
    for rank, world in ((0, 1), (1, 2), (3, 4)):  # another world size: rank 0's for all
        meta, own = own_rng_state(payload, tensors, rank, world)
        assert meta == {"who": 0} and own == {"torch_cpu": torch.tensor([0])}
    old = {"rng": {"who": 0}}  # a checkpoint from before: rank 0's alone
    assert own_rng_state(old, {"torch_cpu": torch.tensor([0])}, 1, 2)[0] == {"who": 0}
