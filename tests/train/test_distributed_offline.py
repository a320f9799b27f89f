"""sft, rm and dpo on 2 gloo ranks under torchrun equal their 1-process runs (DDP and FSDP2, GPT-2
and Llama-style, full weights and LoRA), and a run resumes across world sizes.

One torchrun launch runs every 2-rank config in turn (`dist_driver.py`: one start-up for all);
the 1-process runs of the same configs run in this process. The comparisons are weights within
1e-5 and the same metrics. Why not bit-exact: 2 ranks add the two halves' gradients in another
order than 1 process (float rounding, ~1e-7 relative), and Adam's g / (sqrt(v) + eps) turns a
rounding difference in a tiny gradient (an embedding row of a token seen only through the tied
head's softmax, |g| ~ 1e-9) into a step difference of up to ~lr / 10: 3e-5 at lr 1e-3 on one of
19264 weights, hence lr 2e-4 here (the weights still move by ~1e-3). Adam is nearly blind to a
gradient's scale, so the weights alone would not catch a wrong weighting of the ranks; the
metrics do: each step's loss (the global token or pair count) and its gradient norm before
clipping (the world-size factor, the global sum) are compared to 1e-5 relative. The reward model
trains with a centring term, because without it the head's bias and GPT-2's final LayerNorm bias
have an exactly zero gradient (the Bradley-Terry loss is invariant to shifting every score) and
Adam turns the rounding noise left in it into full lr-sized steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_driver import run_spec
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from safetensors.torch import load_file
from scale_helpers import no_dropout_copy
from torchrun_helpers import ROOT, torchrun

MODES = {"ddp": False, "fsdp": True}


def launch(items: list[dict], path: Path) -> None:
    path.write_text(json.dumps(items))
    out = torchrun([str(ROOT / "tests" / "dist_driver.py"), str(path)])
    assert out.returncode == 0, out.stderr[-4000:]


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((run_dir / "final").glob("*.safetensors")):
        tensors |= {f"{path.stem}/{k}": v for k, v in load_file(str(path)).items()}
    return tensors


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, atol: float) -> None:
    ta, tb = final_tensors(a), final_tensors(b)
    assert ta and ta.keys() == tb.keys()
    for key in ta:
        torch.testing.assert_close(ta[key], tb[key], rtol=0, atol=atol, msg=lambda m, k=key: f"{a.name} {k}: {m}")
    ma, mb = metrics(a), metrics(b)
    assert [sorted(x) for x in ma] == [sorted(x) for x in mb]
    for x, y in zip(ma, mb, strict=True):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-5), (a.name, x, y)


# ----------------------------------------------------------------------------- the configs

def equivalence_items(models: dict[str, str], data: dict[str, Path], out: Path) -> list[dict]:
    """(name, stage, config) of every compared run, without run_name/fsdp."""
    common = dict(output_dir=str(out), device="cpu", max_steps=3, lr=2e-4, batch_size=6,
                  log_every=1, save_every=2, report_to="none", seed=1)
    rm = dict(data=str(data["pref"]), center_rewards_coef=0.1, eval_fraction=0.25, eval_every=2)
    dpo = dict(data=str(data["pref"]), beta=0.5)
    runs = []
    for model in ("gpt2", "llama"):
        # Llama-style: every memory knob composed (grad accumulation, checkpointing; the chunked
        # head is on everywhere by default)
        knobs = dict(grad_accum_steps=2, gradient_checkpointing=True) if model == "llama" else {}
        base = common | knobs | {"model": models[model]}
        runs += [(f"sft-{model}", "sft", base | {"data": str(data["sft"])}),
                 (f"rm-{model}", "rm", base | rm | ({"normalize_data": str(data["sft"])}
                                                   if model == "gpt2" else {})),
                 # GPT-2: IPO with a frozen copy as reference; Llama: DPO with the reference
                 # scored up front
                 (f"dpo-{model}", "dpo", base | dpo | {"precompute_ref_logprobs": model == "llama",
                                                       "loss": "ipo" if model == "gpt2" else "sigmoid"})]
    runs += [("dpo-llama-lora", "dpo", common | dpo | {"model": models["llama"], "lora_r": 4}),
             ("rm-gpt2-lora", "rm", common | rm | {"model": models["gpt2"], "lora_r": 4}),
             # 14 rows in batches of 4: the last batch has 2 rows, one per rank, so with 2
             # micro-batches each rank has an empty one (it runs a stand-in row scaled by 0)
             ("sft-llama-short", "sft", common | {"model": models["llama"], "max_steps": 0,
                                                  "data": str(data["sft14"]), "batch_size": 4,
                                                  "grad_accum_steps": 2})]
    # A token budget: each step's rows or pairs dealt to the ranks by tokens, each rank's cut
    # first-fit decreasing, as many micro-batches on both (packed, for sft and rm; dpo on its
    # shared-prompt rows, padded)
    runs += [("sft-llama-tokens", "sft", common | {"model": models["llama"],
                                                   "data": str(data["sft"]),
                                                   "micro_batch_tokens": 40, "pack": True}),
             ("rm-gpt2-tokens", "rm", common | rm | {"model": models["gpt2"],
                                                     "micro_batch_tokens": 60, "pack": True}),
             ("dpo-gpt2-tokens", "dpo", common | dpo | {"model": models["gpt2"],
                                                        "micro_batch_tokens": 60})]
    return runs


def resume_config(models: dict[str, str], data: dict[str, Path], out: Path) -> dict:
    # lr 1e-4: the cross-world-size comparison is held to 1e-6 (see test_resume_across_world_sizes)
    return dict(output_dir=str(out), device="cpu", max_steps=6, lr=1e-4, batch_size=6,
                log_every=1, save_every=2, report_to="none", seed=2, model=models["gpt2"],
                data=str(data["sft"]), warmup_steps=2, lr_schedule="cosine")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_llama_dir, tmp_path_factory):
    """Every 2-rank run of this file in one torchrun launch, then the 1-process runs here."""
    tmp = tmp_path_factory.mktemp("dist")
    models = {"gpt2": str(no_dropout_copy(Path(tiny_model_dir), tmp / "gpt2")),
              "llama": str(tiny_llama_dir)}
    data = {"sft": write_jsonl(tmp / "sft.jsonl", sft_rows(24)),
            "sft14": write_jsonl(tmp / "sft14.jsonl", sft_rows(14, seed=1)),
            "pref": write_jsonl(tmp / "pref.jsonl", preference_rows(24))}
    out = tmp / "runs"
    items = []
    for name, stage, config in equivalence_items(models, data, out):
        for mode, fsdp in MODES.items():
            items.append({"stage": stage, "config": config | {"run_name": f"{name}-{mode}",
                                                              "fsdp": fsdp}})
    res = resume_config(models, data, out)
    items += [{"stage": "sft", "config": res | {"run_name": "res-whole2", "fsdp": True}},
              {"stage": "sft", "config": res | {"run_name": "res-cut2", "fsdp": True},
               "stop_after": 2},
              {"stage": "sft", "config": res | {"run_name": "res-x", "fsdp": True},
               "stop_after": 2}]
    launch(items, tmp / "spec.json")
    run_spec([{"stage": stage, "config": config | {"run_name": f"{name}-one"}}
              for name, stage, config in equivalence_items(models, data, out)])
    return {"out": out, "models": models, "data": data, "tmp": tmp}


@pytest.mark.slow
@pytest.mark.across_processes  # a different computation: 1e-5 (see assert_same_run's callers)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["sft-gpt2", "rm-gpt2", "dpo-gpt2", "sft-llama", "rm-llama",
                                  "dpo-llama", "dpo-llama-lora", "rm-gpt2-lora",
                                  "sft-llama-short", "sft-llama-tokens", "rm-gpt2-tokens",
                                  "dpo-gpt2-tokens"])
def test_two_ranks_equal_one(runs, name, mode):
    assert_same_run(runs["out"] / f"{name}-{mode}", runs["out"] / f"{name}-one", atol=1e-5)


@pytest.mark.slow
def test_the_compared_runs_did_train(runs):
    """The 1e-5 bar means something: 3 steps moved the weights far more than that."""
    start = load_file(str(Path(runs["models"]["gpt2"]) / "model.safetensors"))
    trained = load_file(str(runs["out"] / "sft-gpt2-one" / "final" / "model.safetensors"))
    moved = [(trained[k][tuple(slice(0, n) for n in start[k].shape)] - start[k]).abs().max().item()
             for k in trained if k in start]  # the tokenizer's added pad row is not compared
    assert max(moved) > 3e-4


@pytest.mark.slow
def test_only_rank_zero_wrote_and_metrics_are_global(runs):
    out = runs["out"]
    # one line per step: rank 1 wrote nothing (its lines would double them)
    assert [m["step"] for m in metrics(out / "sft-gpt2-ddp")] == [1, 2, 3]
    # the held-out accuracy and the normalisation come from all 6 held-out pairs / 24 samples
    last = metrics(out / "rm-gpt2-fsdp")[-1]
    assert {"eval/accuracy", "eval/loss", "norm/mean", "norm/std"} <= last.keys()
    assert last["eval/accuracy"] * 6 == pytest.approx(round(last["eval/accuracy"] * 6), abs=1e-9)
    assert sorted(p.name for p in (out / "sft-gpt2-fsdp" / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.slow
@pytest.mark.across_processes
def test_resume_across_world_sizes(runs):
    """2 ranks (FSDP2) -> killed in step 3 -> 1 process -> killed in step 5 -> 2 ranks to the end.

    2 -> 2 is bit-exact against the uninterrupted 2-rank run: a checkpoint restores everything
    (full tensors, name-keyed optimizer state, schedule, data position). Across world sizes the
    steps taken on 1 process add the gradient halves in another order, so the result equals the
    uninterrupted 1-process run to float rounding (1e-6 at lr 1e-4), not bit for bit.

    The two contracts of tests/processes.py: 2 -> 2 ranks is the same computation (torchrun's
    ranks at one thread each, on both sides), 2 -> 1 -> 2 a different one (the reduction order),
    within 1e-6: Adam's steps of at most ~lr = 1e-4 each, over 5 steps, times the few
    FLOAT32_EPS by which a reordered sum differs, is far below it.
    """
    out, tmp = runs["out"], runs["tmp"]
    res = resume_config(runs["models"], runs["data"], out)
    one = {"resume": True, "resume_allow_changes": True, "fsdp": False}
    run_spec([{"stage": "sft", "config": res | one | {"run_name": "res-x"}, "stop_after": 2},
              {"stage": "sft", "config": res | {"run_name": "res-whole1"}}])
    assert sorted(p.name for p in (out / "res-x" / "checkpoints").iterdir()) == ["step_2", "step_4"]
    # the optimizer state is keyed by parameter name, the same whoever wrote it: FSDP2 on 2 ranks
    # (step 2) or 1 process (step 4); whole tensors of the parameters' shapes
    by_two, by_one = (torch.load(out / "res-x" / "checkpoints" / step / "optimizer.pt",
                                 weights_only=True) for step in ("step_2", "step_4"))
    assert [g["params"] for g in by_two["param_groups"]] == \
        [g["params"] for g in by_one["param_groups"]]
    assert by_two["state"].keys() == by_one["state"].keys()
    assert next(iter(by_two["state"])).startswith("model.transformer.")
    for name, state in by_two["state"].items():
        assert state["exp_avg"].shape == by_one["state"][name]["exp_avg"].shape
    again = {"resume": True, "resume_allow_changes": True, "fsdp": True}
    launch([{"stage": "sft", "config": res | again | {"run_name": name}}
            for name in ("res-cut2", "res-x")], tmp / "resume.json")
    a, b = final_tensors(out / "res-cut2"), final_tensors(out / "res-whole2")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert metrics(out / "res-cut2") == metrics(out / "res-whole2")
    assert_same_run(out / "res-x", out / "res-whole1", atol=1e-6)
