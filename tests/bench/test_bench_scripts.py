"""The bench scripts at bench/'s top that docs/ cite: each runs with tiny settings and prints the
lines its figure is quoted from (docs/benchmarks.md, docs/loading.md, docs/demo.md, docs/engine.md).
bench/engine.py runs here without vLLM (its vLLM side: test_bench_vllm.py, in CI's vLLM venv)."""

from __future__ import annotations

import importlib.util

import pytest
from smoke import finite, line_starting, row, run_main

SMOKES = {"bench/adapter_record.py": "test_adapter_record_rows",
          "bench/multiturn_encoding.py": "test_multiturn_encoding_rows",
          "bench/reward_pool.py": "test_reward_pool_rows",
          "bench/packing.py": "test_packing_table",
          "bench/pair_packing.py": "test_pair_packing_table",
          "bench/threads.py": "test_threads_rows",
          "bench/async_generation.py": "test_async_generation_settings",
          "bench/demo_time.py": "test_demo_time_times_the_demo",
          "bench/engine.py": "test_engine_without_vllm_compares_native_alone",
          "bench/serve_rm_load.py": "test_serve_rm_load_rows",
          "bench/distill.py": "test_distill_rows",
          "bench/moving_refs.py": "test_moving_refs_table"}


def test_adapter_record_rows(capsys):
    # the 7B's weights are reserved (to_empty), not written: 12.6 GiB of address space, a few
    # pages of memory; its row is the one docs/benchmarks.md quotes
    run_main("bench/adapter_record.py", "--repeats", "1")
    out = capsys.readouterr().out
    # parameters (M), tensors, record (ms), JSON (kB)
    tiny = finite(line_starting(out, "tiny Llama (the test fixture's shape): ").split(": ")[1], 4)
    big = finite(line_starting(out, "Llama-2-7B shapes (bf16): ").split(": ")[1], 4)
    assert (tiny[1], big[1]) == (21, 291)
    finite(line_starting(out, "SHA-256: "))


def test_serve_rm_load_rows(capsys):
    # tether serve-rm in a process of its own (one thread), the clients here; no float is
    # compared across the two, only latencies printed and the burst answered
    run_main("bench/serve_rm_load.py", "--small-clients", "2", "--requests", "2",
             "--large-rows", "16", "--small-rows", "2", "--batch-size", "8", "--burst", "16",
             "--width", "32", "--layers", "1")
    out = capsys.readouterr().out
    for name in ("small", "large"):
        assert all(ms > 0 for ms in row(out, name, 6))  # alone, together, one at a time
    assert line_starting(out, "burst: ") == ("burst: 16 of 16 connections answered (GET /info, "
                                             "all at once)")


def test_multiturn_encoding_rows(capsys):
    run_main("bench/multiturn_encoding.py", "--rows", "20", "--turns", "2", "--repeats", "1")
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("20 chats of 2 turns, ")
    for label in ("loss_on=last", "loss_on=all", "all / last"):
        finite(line_starting(out, label), 1)


def test_reward_pool_rows(capsys):
    """docs/benchmarks.md's four rewards, each checked equal through the pool first."""
    run_main("bench/reward_pool.py", "--rows", "4", "--workers", "2", "--delay-ms", "2",
             "--repeats", "1")
    out = capsys.readouterr().out
    for kind in ("api", "async_api", "verifier", "instant"):
        line = line_starting(out, f"{kind:9s} sequential")
        assert "pool of 2" in line and finite(line)


@pytest.mark.slow
def test_packing_table(capsys):
    run_main("bench/packing.py", "--rows", "2", "--layers", "1", "--width", "32", "--repeats",
             "1", "--rounds", "1")
    out = capsys.readouterr().out
    assert out.startswith("batch: 2 rows, ")
    # s/step, cpu s, tokens/s, tok/cpu s, peak MiB, loss
    rows = {name: row(out, name, 6) for name in ("padded", "packed")}
    assert rows["padded"][-1] == rows["packed"][-1]  # the same loss to the printed digits
    finite(line_starting(out, "packed / padded: tokens/s x"))


@pytest.mark.slow
def test_pair_packing_table(capsys):
    run_main("bench/pair_packing.py", "--pairs", "2", "--layers", "1", "--width", "32",
             "--repeats", "1", "--rounds", "1")
    out = capsys.readouterr().out
    # slots, s/step, cpu s, tokens/s, tok/cpu s, peak MiB, loss
    rows = {name: row(out, name, 7) for name in ("rm padded", "rm packed", "dpo shared",
                                                  "dpo padded", "dpo packed")}
    assert rows["rm padded"][-1] == rows["rm packed"][-1]
    # DPO's reference is the starting policy: every layout's loss is ln 2
    assert {rows[name][-1] for name in rows if name.startswith("dpo")} == {0.693147}
    for prefix in ("rm packed / rm padded:", "dpo packed / dpo padded:",
                   "dpo packed / dpo shared:"):
        finite(line_starting(out, prefix))


@pytest.mark.slow
def test_threads_rows(capsys):
    # grpo, the table's first column: each setting is a `tether` process of its own (4 s), so
    # sft's column (the same code with another command line) is left to the figure's own run
    run_main("bench/threads.py", "--sizes", "tiny", "--stages", "grpo", "--repeats", "1")
    line = line_starting(capsys.readouterr().out, "tiny    grpo  1 thread")
    assert line.endswith("x wall") and finite(line)


SETTINGS = ("sync, 2 threads", "sync, 1 thread", "async")


@pytest.mark.slow
def test_async_generation_settings(capsys):
    """The three settings docs/benchmarks.md compares, each a whole `tether grpo` run in a
    process of its own (4 of them, 20 s), on environment episodes: the task with the most of
    the script's own code (its environment); the prompts task differs in two flags."""
    run_main("bench/async_generation.py", "--size", "tiny", "--repeats", "1", "--batches", "2",
             "--batch-size", "4", "--new-tokens", "4", "--task", "episodes",
             "--env-latency-ms", "1")
    out = capsys.readouterr().out
    assert line_starting(out, "setting ").split() == [
        "setting", "s", "per", "episode", "run", "s", "batches", "s", "s", "per", "episode,",
        "batches", "alone"]
    for name in SETTINGS:
        per_episode, run_s, batches_s, per_episode_alone = row(out, name, 4)
        assert 0 < batches_s < run_s
    for name in SETTINGS[:2]:
        finite(line_starting(out, f"{name} / async: whole runs"))


@pytest.mark.slow
def test_demo_time_times_the_demo(capsys, tmp_path):
    """One `tether demo` run (--only), its stage times, on the smallest demo (flags passed
    through to it). A run costs at least what the demo's SFT and reward model cost, about 30 CPU
    seconds, so the second run and the comparison of the two runs' numbers are left to the
    figure's own command."""
    demo = ["--ppo-batches", "1", "--sweep-batches", "1", "--sweep-betas", "0.0"]
    # --jobs 1: the stages one after another in the demo's process, no worker to start
    run_main("bench/demo_time.py", "--quick", "--only", "parallel", "--jobs", "1", "--out",
             str(tmp_path), *demo)
    out = capsys.readouterr().out
    label = " ".join(["tether demo --quick", *demo])
    wall, cpu, load = finite(line_starting(out, f"{label} --jobs 1: wall").split(": ", 1)[1], 3)
    assert 0 < wall and 0 < cpu
    for stage in ("data, SFT and RM", "sft-eval", "dpo", "ipo", "ppo-no-kl-seed0",
                  "sweep/ppo-beta0-seed0"):
        finite(line_starting(out, f"  {stage}: ").split(": ")[1], 1)  # seconds
    assert out.rstrip().endswith(f"runs kept in {tmp_path}")


def test_engine_without_vllm_compares_native_alone(capsys):
    """bench/engine.py where `import vllm` fails: the native rows and GRPO runs, and a line
    saying what was skipped (docs/benchmarks.md: 'Without it the vLLM sides are skipped')."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: test_bench_vllm.py runs both sides")
    run_main("bench/engine.py", "--skip-large", "--repeats", "1", "--episodes", "8",
             "--batch-size", "8", "--response-length", "4")
    out = capsys.readouterr().out
    # tokens/s, tokens per row, vs native
    _, per_row, ratio = row(out, "GPT-2 4x256 fp32 (GRPO)       8 x 4  native", 3)
    assert 0 < per_row <= 4 and ratio == 1.0
    native = row(out, "tether native")
    assert native[2] == 1.0 and native[-1] <= 4  # vs native; mean length <= 4 new tokens
    assert out.rstrip().endswith("skipped: tether vllm (rollouts and GRPO runs): `import vllm` "
                                 "failed in this interpreter")



def test_distill_rows(capsys):
    run_main("bench/distill.py", "--vocab", "600", "--batches", "2", "--batch-size", "2",
             "--max-new-tokens", "3", "--threads", "1", "--width", "32")
    out = capsys.readouterr().out
    assert row(out, "k1 in the reward", 2)[1] == 1.0  # the ratio's base
    for name in ("exact (reverse KL)", "forward KL", "jsd (beta 0.5)"):
        seconds, ratio = row(out, name, 2)
        assert seconds > 0 and ratio > 0


@pytest.mark.slow
def test_moving_refs_table(capsys, tmp_path):
    """The demo's SFT model and reward model (about 20 CPU seconds), then two batches of each
    anchor with one seed: every setting's row, and the figure written."""
    run_main("bench/moving_refs.py", "--batches", "2", "--seeds", "1", "--every", "1,2",
             "--out", str(tmp_path))
    out = capsys.readouterr().out
    for name in ("no penalty", "fixed", "reset:1", "reset:2", "mix:0.5,1", "mix:0.5,2"):
        finite(line_starting(out, name)[len(name):], 8)  # KL at 1 and 2, proxy, gold: +- each
    assert (tmp_path / "moving_refs.png").stat().st_size > 0
