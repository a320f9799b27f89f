"""--fsdp takes effect: under torchrun with 2 gloo ranks each rank holds about half of the
parameters (FSDP2 shards), where DDP holds all of them (a replica per rank).

FSDP2 and DDP train to the same weights (tests/train/test_distributed_offline.py holds both to the
1-process run), so the weights cannot tell whether --fsdp was ignored. What differs is where the
parameters live: `distributed.wrap` prints, on rank 0, the mode and the share of the wrapped
model's parameter elements the rank stores, measured on the model itself (a DTensor's local
shard). Independent truth: under FSDP2 on 2 ranks that share is 1/2 (a little more: a dimension
of odd length gives rank 0 the extra row), under DDP it is 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from torchrun_helpers import ROOT, torchrun

LAYOUT = re.compile(r"^(FSDP2|DDP) over 2 ranks: rank 0 holds ([0-9.]+) of ([0-9,]+) parameters$",
                    re.M)


def layouts(stdout: str) -> list[tuple[str, float]]:
    return [(mode, float(share)) for mode, share, _ in LAYOUT.findall(stdout)]


def assert_sharded(found: list[tuple[str, float]]) -> None:
    assert found and all(mode == "FSDP2" and 0.5 <= share < 0.55 for mode, share in found), found


@pytest.mark.slow
def test_fsdp_shards_the_parameters_of_every_offline_stage(tiny_model_dir, tiny_llama_dir,
                                                          tmp_path):
    import json

    sft = write_jsonl(tmp_path / "sft.jsonl", sft_rows(4))
    pref = write_jsonl(tmp_path / "pref.jsonl", preference_rows(4))
    common = dict(output_dir=str(tmp_path / "runs"), device="cpu", max_steps=1, batch_size=2,
                  save_every=0, report_to="none")
    gpt2, llama = str(tiny_model_dir), str(tiny_llama_dir)
    items = [  # one DDP run first: the same measurement gives 1 there
        {"stage": "sft", "config": common | {"run_name": "ddp", "model": gpt2, "data": str(sft)}},
        {"stage": "sft", "config": common | {"run_name": "sft", "model": llama, "data": str(sft),
                                             "fsdp": True}},
        {"stage": "rm", "config": common | {"run_name": "rm", "model": gpt2, "data": str(pref),
                                            "fsdp": True}},
        {"stage": "dpo", "config": common | {"run_name": "dpo", "model": llama, "data": str(pref),
                                             "fsdp": True}},
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(items))
    out = torchrun([str(ROOT / "tests" / "dist_driver.py"), str(spec)])
    assert out.returncode == 0, out.stderr[-4000:]
    found = layouts(out.stdout)
    assert found[0] == ("DDP", 1.0)
    # sft, rm, dpo's policy and its frozen reference (sharded like it): 4 sharded models
    assert len(found) == 5
    assert_sharded(found[1:])
    for name in ("sft", "rm", "dpo"):
        assert (tmp_path / "runs" / name / "final").is_dir()


@pytest.mark.slow
def test_fsdp_shards_the_online_loop(tiny_llama_dir, tmp_path):
    import json

    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"prompt": p} for p in ("the movie was", "it", "a film", "music")])
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length_reward(prompts, responses):\n"
                       "    return [len(r) / 10.0 for r in responses]\n")
    config = {"run_name": "ppo", "output_dir": str(tmp_path / "runs"), "policy": str(tiny_llama_dir),
              "prompts": str(prompts), "reward_fn": f"{rewards}:length_reward", "batch_size": 4,
              "total_episodes": 4, "max_new_tokens": 4, "device": "cpu", "save_every": 0,
              "sample_every": 0, "report_to": "none", "fsdp": True}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"stage": "ppo", "config": config}]))
    out = torchrun([str(ROOT / "tests" / "dist_driver.py"), str(spec)])  # the audit reaches it
    assert out.returncode == 0, out.stderr[-4000:]
    assert_sharded(layouts(out.stdout))
    assert Path(tmp_path / "runs" / "ppo" / "final").is_dir()
