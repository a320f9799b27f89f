"""bench/kernels/: each script docs/ cite runs with tiny settings and prints what the figures are
quoted from (docs/benchmarks.md, docs/dpo.md, docs/scaling.md)."""

from __future__ import annotations

import re

import pytest
from smoke import finite, line_starting, run_main

SMOKES = {"bench/kernels/logprobs.py": "test_logprobs_tables",
          "bench/kernels/lm_head.py": "test_lm_head_tables",
          "bench/kernels/prefix_window.py": "test_prefix_window_shows_what_the_window_changes",
          "bench/kernels/sampling.py": "test_sampling_lines"}


def table_rows(text: str, title: str, header: str, variants: list[str]) -> list[list[float]]:
    """The rows of the markdown table under `### title`: the header as given, then one row per
    variant, in order, each with finite numbers."""
    part = text.split(f"### {title}", 1)[1]
    lines = [line for line in part.splitlines() if line.startswith("|")]
    assert lines[0] == header and set(lines[1]) <= set("|-:"), part
    rows = [line.strip("|").split("|") for line in lines[2:2 + len(variants)]]
    assert [cells[0].strip() for cells in rows] == variants, part
    return [finite("|".join(cells[1:]), 2) for cells in rows]


@pytest.mark.slow
def test_logprobs_tables(capsys):
    run_main("bench/kernels/logprobs.py", "--B", "2", "--T", "8", "--V", "64", "--repeats", "1")
    out = capsys.readouterr().out
    header = "| variant | median time (ms) | extra peak memory (MiB) |"
    for title in ("forward, no grad", "forward + backward wrt policy logits"):
        table_rows(out, title, header, ["naive", "tether"])
    assert len(re.findall(r"memory ratio naive/tether: [\d.]+x less", out)) == 2
    assert len(re.findall(r"speed ratio naive/tether: [\d.]+x", out)) == 2


@pytest.mark.slow
def test_lm_head_tables(capsys):
    # the script first checks that both variants give the same values and gradients
    run_main("bench/kernels/lm_head.py", "--B", "1", "--R", "8", "--d", "16", "--V", "64",
             "--repeats", "1")
    out = capsys.readouterr().out
    header = "| variant | best time (s) | extra peak memory (MiB) |"
    for title in ("frozen head (gradient to h only)", "trainable head (gradients to h and W)"):
        table_rows(out, title, header, ["plain", "chunked"])
    assert len(re.findall(r"time: chunked / plain = [\d.]+x", out)) == 2


def test_prefix_window_shows_what_the_window_changes(capsys):
    """docs/dpo.md: without the window the shared pass is off by tenths of a nat on pairs longer
    than it; with it the passes agree (below 1e-4 nats, 2e-7 in the gradient)."""
    run_main("bench/kernels/prefix_window.py")
    out = capsys.readouterr().out
    models = ("mistral (W=8, all layers)", "qwen2 (W=8, layer 1 of 2)")
    second = out.index(models[1])
    for model, part in zip(models, (out[:second], out[second:])):
        finite(line_starting(part, f"{model}: concatenated logps/chosen"))
        # logps/chosen, max |d chosen|, max |d rejected| (nats), grad rel. error
        before = finite(line_starting(part, "  shared, no window (before):"), 4)
        now = finite(line_starting(part, "  shared, window (now)      :"), 4)
        assert before[1] > 0.05 and now[1] < 1e-3 and now[2] < 1e-3
        assert now[3] < 1e-5 < before[3]


def test_sampling_lines(capsys):
    run_main("bench/kernels/sampling.py", "--repeats", "1", "--op-steps", "2")
    out = capsys.readouterr().out
    for vocab in (50257, 128256):
        finite(line_starting(out, f"sampling op, B=64 V={vocab}: inverse-CDF"))
    finite(line_starting(out, "sample_responses, tiny GPT-2, B=32 x 32 tokens: inverse-CDF"))
