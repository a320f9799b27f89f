"""docs/architecture.md stays true: every file it names exists, and every code name it quotes is
defined in the package (a def, a class, a field or a module-level name), so a rename that leaves
the page behind fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tether"
PAGE = ROOT / "docs" / "architecture.md"


def quoted() -> set[str]:
    text = re.sub(r"```.*?```", "", PAGE.read_text(encoding="utf-8"), flags=re.S)
    return set(re.findall(r"`([^`]+)`", text))


def test_every_file_the_page_names_exists():
    files = [q.split(" ")[0] for q in quoted() if re.fullmatch(r"[\w/]+\.(py|md)( \(.*\))?", q)
             or q.endswith("/")]
    assert len(files) > 10
    missing = [f for f in files if not ((SRC / f).exists() or (ROOT / f).exists())]
    assert not missing, missing


def test_every_code_name_the_page_quotes_is_defined():
    names = {q.split(".")[-1] for q in quoted()
             if re.fullmatch(r"[A-Za-z_][\w.]*", q) and not q.endswith(".py")}
    source = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))
    defined = set(re.findall(r"\b(?:def|class)\s+(\w+)", source))
    defined |= set(re.findall(r"^\s*(\w+)\s*(?::|=)", source, flags=re.M))  # fields, names
    assert len(names) > 20
    missing = sorted(n for n in names if n not in defined)
    assert not missing, missing


# The recipes' signatures, each with what must have it: a recipe that tells a newcomer the wrong
# arguments (as the engine recipe once did) fails here.
def _kl_tokens():
    from tether.choices import KL_ESTIMATORS
    return [e.token for e in KL_ESTIMATORS.values() if e.token is not None]


def _advantages():
    from tether.choices import ADVANTAGES
    return [e.fn for e in ADVANTAGES.values()]


def _objectives():
    from tether.choices import POLICY_LOSSES
    return [e.fn for e in POLICY_LOSSES.values()]


def _engines(what):
    from tether.choices import ENGINES
    return lambda: [getattr(e, what) for e in ENGINES.values() if getattr(e, what) is not None]


def _environment(method):
    from tether.rl.env import Environment
    return lambda: [getattr(Environment, method)]


SIGNATURES = {
    "(log_ratio) -> [...]": _kl_tokens,
    "(spec, rewards, values, mask) -> (advantages, returns)": _advantages,
    "(x) -> (per_token_loss, where_clipped)": _objectives,
    "start(settings, model, peft, longest_prompt, d, run_model)": _engines("start"),
    "generator(settings, model, peft, longest_prompt, d)": _engines("generator"),
    "check(settings, config, longest_prompt, device)": _engines("check"),
    "reset(row, seed)": _environment("reset"),
    "step(action)": _environment("step"),
}
ENTRIES = ("KLEstimator", "Advantage", "Objective", "Engine")  # dataclasses of tether.choices


def spans() -> set[str]:
    return {" ".join(q.split()) for q in quoted()}


def parameters(signature: str) -> list[str]:
    inside = signature[signature.index("(") + 1:signature.index(")")]
    return [part.split("=")[0].split(":")[0].strip() for part in inside.split(",") if part.strip()]


def takes(fn, names: list[str]) -> bool:
    """`fn` takes `names` as its leading parameters, in order, and needs no other."""
    fn = getattr(fn, "resolve", lambda: fn)()
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return ([p.name for p in params[:len(names)]] == names
            and all(p.default is not p.empty for p in params[len(names):]))


def test_the_recipes_signatures_are_the_code_s():
    quoted_spans = spans()
    for signature, functions in SIGNATURES.items():
        assert signature in quoted_spans, f"the page no longer gives `{signature}`"
        fns = functions()
        assert fns, signature
        wrong = [repr(fn) for fn in fns if not takes(fn, parameters(signature))]
        assert not wrong, f"`{signature}` is not the signature of {wrong}"


def test_the_recipes_table_entries_list_the_entries_fields():
    import tether.choices as choices
    quoted_spans = spans()
    for name in ENTRIES:
        given = [s for s in quoted_spans if s.startswith(f"{name}(")]
        assert len(given) == 1, (name, given)
        fields = [f.name for f in dataclasses.fields(getattr(choices, name))]
        assert parameters(given[0]) == fields, (name, given[0], fields)


def test_the_loss_inputs_the_page_names_are_fields():
    from tether.losses import LossInputs
    named = {s[2:] for s in spans() if re.fullmatch(r"x\.\w+", s)}
    assert len(named) >= 8
    assert named <= {f.name for f in dataclasses.fields(LossInputs)}, named


def test_the_recipe_table_names_the_tables():
    import tether.choices as choices
    from tether.rl.env import load
    from tether.run import extras
    for table in ("KL_ESTIMATORS", "ADVANTAGES", "POLICY_LOSSES", "ENGINES"):
        assert f"{table}" in spans() and isinstance(getattr(choices, table), dict)
    assert isinstance(load.ADAPTERS, dict) and isinstance(extras.EXTRAS, dict)
