"""Every test file that starts another process says which contract its numbers keep (issue 49,
tests/processes.py): it carries the `across_processes` mark on the tests that compare numbers
across processes (the same computation, its settings pinned on both sides; or a different one,
within a stated float32 tolerance), or it is listed here with why it compares none, or where
its code pins the settings itself. A new test that starts a process and compares floats with
this one's, without either, fails here before it can fail on another CPU."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What starts another process in a test: a subprocess, torchrun, a sweep's or the demo's workers.
STARTS_A_PROCESS = re.compile(r"subprocess\.(run|Popen|check_output|call)\(|torchrun\(|"
                              r"torchrun_command\(|\"--jobs\", \"[2-9]\"")

# Files that start processes but compare no floating-point number across them, or whose code
# pins the computation on both sides: each with the reason.
NO_FLOATS_ACROSS = {
    "bench/test_bench_torchrun_exit.py": "exit codes and error lines",
    "bench/test_bench_scale.py": "the benchmarks' own tables; DDP against FSDP2 is compared "
                                 "inside the benchmark's ranks (a different computation, within "
                                 "its stated 1e-4), never with a run in this process",
    "demo/test_demo.py": "the demo pins one torch thread per stage, in its process and in each "
                         "worker (demo/pipeline.py, the job runner), so --jobs 1 and 2 are the "
                         "same computation whatever the suite's thread count",
    "demo/test_demo_resume.py": "as test_demo.py: one thread per stage, pinned by the demo",
    "examples/test_calculator_example.py": "the example's figures are checked to be finite only",
    "examples/test_distill_example.py": "the example's figures are checked within its own run "
                                        "(finite; the teacher's KL to itself 0), none across",
    "models/test_hub_offline.py": "hub lookups offline: exit codes and lines",
    "models/test_portable_adapters.py": "a copied adapter loads and generates: exit codes and "
                                        "line counts",
    "options/test_options_effect_fsdp.py": "which parameters FSDP2 shards: layouts",
    "options/test_options_effect_tools.py": "the sweep's workers run a stand-in job that counts "
                                            "them",
    "rl/engines/test_vllm_engine.py": "vLLM's own start-up in a fresh process: exit codes",
    "rl/env/test_env_load.py": "imports in a fresh interpreter",
    "rl/test_reward_fn_guard.py": "the child's scores against the functions applied to its own "
                                  "samples, in the child's numbers alone",
    "rl/test_user_code_timeout.py": "deadlines: exit codes and lines",
    "run/test_distributed_errors.py": "error lines under torchrun",
    "run/test_launcher_death.py": "processes left behind",
    "run/test_jobs.py": "which worker ran which job, their logs and lines",
    "run/test_run_lock.py": "the run directory's lock",
    "run/test_user_code.py": "the event loop's guard ending a blocked process: its exit and line",
    "test_cli.py": "exit codes and lines",
    "test_compat.py": "imports in a fresh interpreter",
    "test_early_checks.py": "refusals before torch loads: exit codes and lines",
    "test_extras.py": "the lines for missing extras",
    "test_help_texts.py": "help texts",
    "test_layers.py": "imports in a fresh interpreter",
    "test_readme_stages.py": "the README's commands run: exit codes and the files they write",
    "tools/test_sweep.py": "the sweep's own results, written by its workers; none compared with "
                           "a run in this process",
}


def test_every_test_that_starts_a_process_states_its_contract():
    undeclared = []
    for path in sorted(TESTS.rglob("test_*.py")):
        name = path.relative_to(TESTS).as_posix()
        text = path.read_text(encoding="utf-8")
        if path == Path(__file__) or not STARTS_A_PROCESS.search(text):
            continue
        if "across_processes" not in text and name not in NO_FLOATS_ACROSS:
            undeclared.append(name)
    assert not undeclared, ("these start a process: mark the tests that compare numbers across "
                            "it @pytest.mark.across_processes (tests/processes.py) or list the "
                            f"file in NO_FLOATS_ACROSS with why: {undeclared}")


def test_the_list_holds_no_file_that_no_longer_starts_a_process():
    stale = [name for name in NO_FLOATS_ACROSS
             if not (TESTS / name).is_file()
             or not STARTS_A_PROCESS.search((TESTS / name).read_text(encoding="utf-8"))]
    assert not stale, stale
