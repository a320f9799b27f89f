"""`tether demo` side by side: its stages one at a time (--jobs 1) and N at a time (the default),
on this machine, with the numbers compared bit for bit.

    python bench/demo_time.py [--quick] [--jobs N] [--out DIR] [--only parallel] [DEMO FLAGS]

Prints the CPU model, the cores this process may use and the load average before each run,
then each stage's time as the demo reports it, each run's wall and CPU time (of the demo and
every process it started), and the ratio. The two runs must give the same numbers: every
metric line of every run directory except the perf/ timings, and the report's verdicts and
table; the script fails if they do not. Run it on an otherwise idle machine: a busy core slows
the parallel run more than the serial one (docs/demo.md, "Time"). Any other flag goes to both
`tether demo` runs (`--ppo-batches 4 --sweep-batches 2`: a smaller demo, as the smoke test runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_demo(out: Path, quick: bool, jobs: int, demo_flags: list[str]) -> dict:
    """One `tether demo` in a fresh process; its wall and CPU seconds and its stage lines."""
    command = [sys.executable, "-m", "tether", "demo", "--output-dir", str(out), "--jobs",
               str(jobs), *(["--quick"] if quick else []), *demo_flags]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    stages = {m[1]: float(m[2]) for m in re.finditer(r"\] (\S+) finished in (\d+) s", done.stdout)}
    first = re.search(r"SFT and the reward model done \((\d+) s\)", done.stdout)
    return {"jobs": jobs, "load_before": load, "wall": wall,
            "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "data+sft+rm": float(first[1]) if first else float("nan"), "stages": stages,
            "stdout": done.stdout}


def numbers(root: Path) -> dict[str, list]:
    """Every run's metric lines without the perf/ timings, and the report's printed table and
    verdicts: what must not change with the number of processes."""
    out = {}
    for path in sorted(root.rglob("metrics.jsonl")):
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in path.read_text().splitlines()]
        out[str(path.relative_to(root))] = rows
    return out


def verdict_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[") and "] " in line
            and "finished in" not in line and "SFT and the reward model" not in line
            and "data, tokenizer" not in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="time `tether demo --quick`")
    parser.add_argument("--jobs", type=int, default=0, help="the parallel run's --jobs (0: cores)")
    parser.add_argument("--out", default="", help="keep the runs here (default: a temp folder)")
    parser.add_argument("--only", choices=["parallel"], help="skip the --jobs 1 run")
    args, demo_flags = parser.parse_known_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="demo-time-"))
    jobs = args.jobs or cores()
    print(f"CPU: {cpu_model()}; cores available: {cores()}; python {platform.python_version()}")
    label = " ".join(["tether demo", *(["--quick"] if args.quick else []), *demo_flags])
    runs = []
    for n in ([jobs] if args.only else [1, jobs]):
        result = run_demo(out / f"jobs{n}", args.quick, n, demo_flags)
        runs.append(result)
        print(f"\n{label} --jobs {n}: wall {result['wall']:.0f} s, CPU {result['cpu']:.0f} s "
              f"(load average before: {result['load_before']:.2f})")
        print(f"  data, SFT and RM: {result['data+sft+rm']:.0f} s")
        for name, seconds in result["stages"].items():
            print(f"  {name}: {seconds:.0f} s")
    if len(runs) == 2:
        serial, parallel = runs
        same = (numbers(out / "jobs1" / "demo") == numbers(out / f"jobs{jobs}" / "demo")
                and verdict_lines(serial["stdout"]) == verdict_lines(parallel["stdout"]))
        print(f"\n{label}: --jobs 1 {serial['wall']:.0f} s, --jobs {jobs} "
              f"{parallel['wall']:.0f} s: {serial['wall'] / parallel['wall']:.2f}x faster; "
              f"the numbers {'are identical' if same else 'DIFFER'}")
        if not same:
            sys.exit(1)
    print(f"runs kept in {out}")


if __name__ == "__main__":
    main()
