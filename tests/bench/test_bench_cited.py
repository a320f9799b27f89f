"""Every bench script that docs/ or README.md cite has a smoke test, so that the command a figure
is quoted from cannot break unnoticed. Each smoke test file of tests/bench/ declares the scripts
it covers in a `SMOKES` table ({script: test function}), read here from its source; a script
cited without one fails here, and so does a table naming a test or a script that is not there.
The smoke tests that need an extra (vLLM, TRL) skip without it, so CI must run them where it is
installed, with their TETHER_REQUIRE_* switch on: checked against .ci/run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_docs_names import HISTORY  # names mentioned on purpose as history (bench/grpo.py)

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TESTS = sorted((ROOT / "tests" / "bench").glob("test_*.py"))
# a script path standing alone (not the tail of tests/bench/test_bench_grpo.py)
CITED = re.compile(r"(?<![\w./-])(bench/[\w./-]*\.(?:py|sh))(?![\w/-])")
REQUIRE = re.compile(r"""os\.environ\.get\(["'](TETHER_REQUIRE_\w+)["']\)""")


def cited() -> dict[str, list[str]]:
    """Each script the docs cite, with the docs that cite it."""
    out: dict[str, list[str]] = {}
    for doc in DOCS:
        for script in sorted(set(CITED.findall(doc.read_text(encoding="utf-8")))):
            if script not in HISTORY:
                out.setdefault(script, []).append(doc.name)
    return out


def smokes(path: Path) -> dict[str, str]:
    """The `SMOKES` table of one test file ({} when it has none), as written."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "SMOKES"):
            return ast.literal_eval(node.value)
    return {}


def declared() -> dict[str, list[str]]:
    """Each script some smoke test covers, with those tests (`file::test`)."""
    out: dict[str, list[str]] = {}
    for path in TESTS:
        for script, test in smokes(path).items():
            out.setdefault(script, []).append(f"{path.name}::{test}")
    return out


def test_every_cited_script_has_a_smoke_test():
    covered = declared()
    missing = {script: docs for script, docs in cited().items() if script not in covered}
    assert not missing, ("bench scripts cited with no smoke test (add one to tests/bench/ and "
                         f"name it in that file's SMOKES table): {missing}")


def test_every_smokes_table_names_real_tests_and_scripts():
    tables = {path.name: smokes(path) for path in TESTS}
    assert sum(map(len, tables.values())) >= len(cited())  # the tables are read at all
    for path in TESTS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name.startswith("test_")}
        for script, test in tables[path.name].items():
            assert (ROOT / script).is_file(), f"{path.name}: SMOKES names {script}: no such file"
            assert test in tests, f"{path.name}: SMOKES names {test}, not a test of that file"


def test_smoke_tests_that_need_an_extra_run_in_ci_with_it():
    """A file that skips without vLLM or TRL (and fails instead under TETHER_REQUIRE_VLLM=1 or
    TETHER_REQUIRE_TRL=1) must be run by .ci/run with that switch set."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    needing = {path: REQUIRE.findall(path.read_text(encoding="utf-8")) for path in TESTS}
    assert any(needing.values())  # the vLLM and TRL files are seen
    for path, switches in needing.items():
        for switch in switches:
            runs = [line for line in ci.splitlines() if f"tests/bench/{path.name}" in line]
            assert runs, f".ci/run never runs tests/bench/{path.name}"
            block = ci[:ci.index(runs[0])].rsplit("\n\n", 1)[-1] + runs[0]
            assert f"{switch}=1" in block, f".ci/run runs {path.name} without {switch}=1"


def test_citations_are_found_where_they_stand():
    text = ("Run `python bench/packing.py`, see tests/bench/test_bench_grpo.py, "
            "bench/scale/gpu.sh --tiny and bench/ (the folder).")
    assert CITED.findall(text) == ["bench/packing.py", "bench/scale/gpu.sh"]


def test_links_to_a_benchmark_section_find_it():
    """`benchmarks.md#section` links (docs/dpo.md, docs/scaling.md, ...) name a heading that is
    there: a section's anchor is made of its script's path, so moving a script (bench/ into
    kernels/, peers/, scale/) must move the links too. GitHub's anchor: the heading in lower
    case, without punctuation but `-` and `_`, spaces as `-`."""
    headings = re.findall(r"^#+ (.*)$", (ROOT / "docs" / "benchmarks.md").read_text(
        encoding="utf-8"), re.MULTILINE)
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    assert "packing-pairs-benchpair_packingpy" in anchors  # "## Packing pairs (`bench/pair_packing.py`)"
    broken = [(doc.name, anchor) for doc in DOCS
              for anchor in re.findall(r"benchmarks\.md#([\w-]+)", doc.read_text(encoding="utf-8"))
              if anchor not in anchors]
    assert not broken, f"links to no section of docs/benchmarks.md: {broken}"
