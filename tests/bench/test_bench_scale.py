"""bench/scale/: each script docs/ cite runs with tiny settings and prints the lines its figure is
quoted from (docs/scaling.md, docs/benchmarks.md, docs/ppo.md). memory.py's TRL configuration
needs TRL 1.12 (the bench extra): test_bench_trl.py."""

from __future__ import annotations

import json
import re
import sys

import pytest
from smoke import MEMORY_TINY, finite, line_starting, markdown_row, row, run, run_main
from torchrun_helpers import free_port, torchrun

SMOKES = {"bench/scale/memory.py": "test_memory_table",
          "bench/scale/memory_knobs.py": "test_memory_knobs_table",
          "bench/scale/memory_plan.py": "test_memory_plan_table_and_fit",
          "bench/scale/fsdp_generation_gathers.py": "test_fsdp_gathers_count",
          "bench/scale/gpu.sh": "test_gpu_sh_tiny_on_the_cpu",
          "bench/scale/gpu.py": "test_gpu_sh_tiny_on_the_cpu"}


@pytest.mark.slow
def test_memory_table(capsys, tmp_path):
    """docs/scaling.md's first table: tether's full fine-tuning and LoRA on a shared base, each
    in a process of its own; LoRA really active (one base resident, a few parameters train)."""
    raw = tmp_path / "m.json"
    run_main("bench/scale/memory.py", "--configs", "full,lora", *MEMORY_TINY, "--json", str(raw))
    out = capsys.readouterr().out
    assert "| configuration | peak RSS (MiB) | above imports (MiB) |" in out
    full = markdown_row(out, "(1) tether full fine-tuning")
    lora = markdown_row(out, "(2) tether LoRA, shared base")
    for cells in (full, lora):  # peak, above imports, 2 ratios (n/a: no TRL run), copies, ...
        assert cells[3:5] == ["n/a", "n/a"] and finite(" ".join(cells[1:3] + cells[5:6]))
    assert float(full[5]) == pytest.approx(4.0) and float(lora[5]) < 1.5  # base copies
    assert float(lora[6].rstrip("M")) < 0.5 * float(full[6].rstrip("M"))  # trainable
    results = json.loads(raw.read_text())["results"]  # what memory_plan.py --fit reads
    assert set(results) == {"full", "lora"} and results["full"]["above_imports_mib"] > 0


@pytest.mark.slow
def test_memory_knobs_table(capsys):
    # large enough that a step's activations show in the peak (the ratios divide by plain's)
    run_main("bench/scale/memory_knobs.py", "--B", "8", "--T", "64", "--layers", "1", "--width",
             "64", "--steps", "1")
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["config", "peak", "MiB", "x", "plain", "step", "s",
                                           "x", "plain"]
    for name in ("plain", "accum4", "ckpt", "ckpt+accum4"):
        row(out, name, 4)  # peak MiB, x plain, step s, x plain


def memory_run(path, layers: int, tokens_per_row: int, a: float, b: float, c: float) -> None:
    """A bench/scale/memory.py --json file of a `full` run whose peak above imports is exactly
    a * P + b * L * N + c * N bytes (memory_plan.fit's model)."""
    width, vocab, minibatch = 64, 300, 4
    params = 12 * layers * width * width + (vocab + 1024) * width
    n = minibatch * tokens_per_row
    spec = {"base_params": params, "layers": layers, "width": width, "vocab": vocab,
            "minibatch": minibatch, "prompt_len": tokens_per_row // 2,
            "response_len": tokens_per_row // 2}
    peak = a * params + b * layers * n + c * n
    path.write_text(json.dumps({"spec": spec, "results": {"full": {
        "above_imports_mib": peak / 2**20}}}))


def test_memory_plan_table_and_fit(capsys, tmp_path):
    """The plan (docs/scaling.md's command) is arithmetic: its Llama-3-8B full fine-tuning cell
    is 8.03e9 parameters x 28 bytes (4 bf16 bases, 2 bf16 gradients, 2 fp32 AdamW pairs). The fit
    recovers the bytes per parameter, per token and layer, and per token of four runs made with
    known ones."""
    run_main("bench/scale/memory_plan.py", "--act-per-token-layer-d", "59.8")
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("| model | full FT fixed (4 bases) | + fp32 master |")
    for model in ("Qwen2-0.5B", "Llama-3-8B", "Llama-3-70B"):
        cells = finite(line_starting(out, f"| {model} |").split("|", 2)[2].replace(",", ""), 9)
        if model == "Llama-3-8B":
            assert cells[0] == pytest.approx(8.03e9 * 28 / 2**30, abs=0.05)

    files = []
    for i, (layers, tokens) in enumerate([(2, 64), (2, 128), (4, 64), (4, 128)]):
        files.append(tmp_path / f"m{i}.json")
        memory_run(files[-1], layers, tokens, a=20.0, b=3 * 1024, c=5 * 1024)
    run_main("bench/scale/memory_plan.py", "--fit", *map(str, files))
    fitted = line_starting(capsys.readouterr().out, "a = ")
    found = re.match(r"a = ([\d.]+) bytes per base parameter; b = ([\d.]+) KiB per token per "
                     r"layer .*; c = ([\d.]+) KiB per token", fitted)
    assert found and [float(x) for x in found.groups()] == pytest.approx([20.0, 3.0, 5.0],
                                                                          abs=0.06)


@pytest.mark.slow
def test_fsdp_gathers_count():
    """docs/ppo.md: every layer gathered at every token when resharded after each forward
    (1 + layers x tokens), once per rollout with Roles.generate (1 + layers)."""
    done = torchrun(["bench/scale/fsdp_generation_gathers.py", "--max-new-tokens", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == ("all-gathers for 3 new tokens, 2 layers: peek 7, "
                                            "generate 3")


@pytest.mark.slow
def test_gpu_sh_tiny_on_the_cpu():
    """`PYTHON=.venv/bin/python bash bench/scale/gpu.sh --tiny --device cpu` (docs/benchmarks.md):
    bench/scale/gpu.py's PPO and DPO lines on a 2-layer model, then DDP against FSDP2 on 2 CPU
    ranks. On a tether without LoRA the PPO line must say so instead of passing for a LoRA
    figure; DDP and FSDP2 train the same weights."""
    out = run("bash", "bench/scale/gpu.sh", "--tiny", "--device", "cpu",
              env={"PYTHON": sys.executable, "FSDP_PORT": str(free_port())}, timeout=600)
    ppo, dpo = line_starting(out, "PPO: "), line_starting(out, "DPO: ")
    assert "episodes/s" in ppo and "pairs/s" in dpo
    assert "median of 3 steps after the first" in dpo  # --tiny runs 4 DPO steps
    assert ("LoRA active" in ppo) != ("LoRA NOT ACTIVE" in ppo)
    for stage in ("sft", "dpo"):
        fsdp = line_starting(out, f"FSDP2: {stage} full fine-tuning, 2 ranks")
        difference = re.search(r"max \|w_DDP - w_FSDP2\| after 2 steps (\S+)$", fsdp)
        assert difference and float(difference[1]) < 1e-4, fsdp
