"""Re-run the option mutation check: for every option of every stage, make tether silently ignore
it (tests/audit/ignore_option.py) and run the tests that claim to catch that; the option is
caught when at least one of them fails.

    cd <repo> && /path/to/python tests/audit/mutate_options.py                # every option
    ... tests/audit/mutate_options.py --only online:missing_eos_penalty,sft:seed
    ... tests/audit/mutate_options.py --map /tmp/candidates.json --jobs 2     # try other tests
    ... tests/audit/mutate_options.py --table                                  # docs/options.md's table

The map (option -> tests) is OPTION_TESTS in tests/audit/option_tests.py; docs/options.md is its
table. Prints one line per option (caught / NOT CAUGHT, and the first failing test) and the
counts; exit 1 when an option in the map is not caught. A baseline run first checks that the
mapped tests pass with nothing ignored (skip it with --no-baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "audit"), str(ROOT / "tests"), str(ROOT / "src")]


class FirstFailure:
    """pytest plugin: remembers the first failing test's node id."""

    def __init__(self):
        self.nodeid = ""

    def pytest_runtest_logreport(self, report):
        if report.failed and not self.nodeid:
            self.nodeid = report.nodeid


def run_tests(tests: list[str], ignore: str | None) -> tuple[int, str]:
    """Run `tests` (node ids) in this process with `ignore` (stage:field) ignored, stopping at
    the first failure; return pytest's exit code and the first failing node id (or "")."""
    import pytest
    from ignore_option import ENV, install

    undo = install(ignore) if ignore else (lambda: None)
    first = FirstFailure()
    saved = os.environ.pop(ENV, None)
    if ignore:  # for the processes a test starts (tests/dist_driver.py installs it in each rank)
        os.environ[ENV] = ignore
    try:
        rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "--no-header",
                          "-p", "no:warnings", *tests], plugins=[first])
    finally:
        undo()
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved
    return int(rc), first.nodeid


def worker(units: list[str], table: dict[str, list[str]], out: Path) -> None:
    """Check `units` one after the other in this one process (torch and the test modules are
    imported once), appending one JSON line per unit to `out`."""
    import contextlib
    import io

    os.chdir(ROOT)
    for unit in units:
        tests = table.get(unit, [])
        if tests:
            with contextlib.redirect_stdout(io.StringIO()):
                rc, failed = run_tests(tests, unit)
            res = {"unit": unit, "caught": rc != 0, "test": failed, "rc": rc}
        else:
            res = {"unit": unit, "caught": False, "test": "", "rc": None}
        with out.open("a") as f:
            f.write(json.dumps(res) + "\n")


def print_table() -> None:
    from option_tests import NOT_APPLICABLE, OPTION_TESTS, STAGES, all_units

    units = all_units()
    for stage in STAGES:
        print(f"\n### {stage}\n\n| option | tests that fail when it is ignored |\n|---|---|")
        for unit in (u for u in units if u.startswith(stage + ":")):
            flag = "--" + unit.split(":")[1].replace("_", "-")
            tests = OPTION_TESTS.get(unit, [])
            cell = ("n/a: " + NOT_APPLICABLE[unit] if unit in NOT_APPLICABLE else
                    "<br>".join(f"`{t.replace('tests/', '')}`" for t in tests) or "NONE")
            print(f"| `{flag}` | {cell} |")


def _env() -> dict[str, str]:
    paths = [str(ROOT / "tests" / "audit"), str(ROOT / "tests"), str(ROOT / "src")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--map", help="JSON file {stage:field: [test node ids]} instead of OPTION_TESTS")
    ap.add_argument("--only", default="", help="comma-separated stage:field units to check")
    ap.add_argument("--jobs", type=int, default=1, help="pytest processes at once")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", help="write {unit: {caught, test, rc}} here")
    ap.add_argument("--table", action="store_true",
                    help="print the option -> tests map as the markdown table of docs/options.md; run nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print_table()
        return 0
    if args.worker:
        spec = json.loads(args.worker)
        worker(spec["units"], spec["table"], Path(spec["out"]))
        return 0
    from option_tests import NOT_APPLICABLE, OPTION_TESTS, all_units

    table = json.loads(Path(args.map).read_text()) if args.map else OPTION_TESTS
    units = [u for u in all_units() if not args.only or u in args.only.split(",")]
    for unit in [u for u in units if u in NOT_APPLICABLE]:
        print(f"n/a        {unit:40s} {NOT_APPLICABLE[unit]}")
    units = [u for u in units if u not in NOT_APPLICABLE]
    os.chdir(ROOT)
    if not args.no_baseline:
        tests = sorted({t for u in units for t in table.get(u, [])})
        rc, failed = run_tests(tests, None)
        if rc != 0:
            print(f"baseline: the mapped tests do not pass with nothing ignored ({failed}); fix that first")
            return 2
        print(f"baseline: {len(tests)} mapped tests pass", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        # `jobs` worker processes, each taking every jobs-th unit
        procs, outs = [], []
        for j in range(args.jobs):
            outs.append(Path(tmp) / f"w{j}.jsonl")
            spec = json.dumps({"units": units[j::args.jobs], "table": table, "out": str(outs[-1])})
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", spec], cwd=ROOT,
                                          env=_env(), stdout=subprocess.DEVNULL))
        try:
            _collect(procs, outs, units, results)
        finally:
            for proc in procs:  # a stopped check leaves no worker behind
                if proc.poll() is None:
                    proc.kill()
    results = {u: results[u] for u in units if u in results}
    caught = sum(r["caught"] for r in results.values())
    print(f"{caught} of {len(units)} options caught when ignored"
          + (f" ({len(units) - len(results)} not checked: a worker died)" if len(results) < len(units) else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if caught == len(units) else 1


def _collect(procs, outs, units, results) -> None:
    """Print each worker's results as they come, until all are in or every worker has ended."""
    while len(results) < len(units):
        finished = all(p.poll() is not None for p in procs)
        done = [json.loads(x) for o in outs if o.exists() for x in o.read_text().splitlines()]
        for res in done:
            if res["unit"] in results:
                continue
            results[res["unit"]] = res
            status = "caught     " if res["caught"] else "NOT CAUGHT "
            note = res["test"] or ("(no test mapped)" if res["rc"] is None else "")
            print(f"{status}{res['unit']:40s} {note}", flush=True)
        if finished:
            break
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
