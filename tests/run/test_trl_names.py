"""Unknown options and keys (issue 32): a TRL name is answered with tether's option, a near miss
with `did you mean`, anything else with where the list is; one line, exit 2, never the ~90 names.

The TRL names come from docs/from_trl.md's tables, read here as a user reads them: every TRL
setting in a table's first column, passed to the stage (or stages) its section or column speaks
for, must get the hint that names the tether option(s) in the same row, and each of those
options must exist for that stage. So the doc and `tether.run.trl_names.ROWS` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tether.cli import config_class, main
from tether.errors import TetherError
from tether.run import trl_names
from tether.run.parse import config_from_dict, parse_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "from_trl.md"
ONLINE, OFFLINE = ("ppo", "rloo", "grpo"), ("sft", "rm", "dpo")
SECTION_STAGES = {"The online stages: GRPO and RLOO": ("grpo", "rloo"), "SFT": ("sft",),
                  "Reward modelling": ("rm",), "DPO and IPO": ("dpo",)}
# backticked names in the TRL column that are not TRL options, and what they are
NOT_OPTIONS = {"prompt": "a dataset column", "margin": "a dataset column",
               "num_labels": "a model argument", "frac_reward_zero_std": "a metric TRL logs"}
SPAN = re.compile(r"`([^`]*)`")
SETTING = re.compile(r"([a-z][a-z0-9_]*)(?:=(.+))?")


def config(stage: str) -> type:
    return config_class(stage)


def fields(stage: str) -> set[str]:
    return {f.name for f in dataclasses.fields(config(stage))}


def trl_settings(cell: str) -> list[tuple[str, str | None]]:
    """(name, value) for each TRL setting a cell spells: `loss_type="dapo"`, `epsilon`, and a
    name followed by quoted values (`scale_rewards` `"group"` / `"batch"`) once per value."""
    out: list[tuple[str, str | None]] = []
    last_end = 0
    for match in SPAN.finditer(cell):
        span, gap = match.group(1), cell[last_end:match.start()]
        last_end = match.end()
        if span.startswith('"') and out and re.fullmatch(r"[\s,/]*", gap):
            name, value = out[-1]
            if value is None:
                out[-1] = (name, span.strip('"'))
            else:
                out.append((name, span.strip('"')))
        elif (setting := SETTING.fullmatch(span)) and setting.group(1) not in NOT_OPTIONS:
            out.append((setting.group(1), setting.group(2) and setting.group(2).strip('"')))
    return out


def tether_options(cell: str) -> list[str]:
    """The tether options a cell names, in order, once each."""
    return list(dict.fromkeys(trl_names.options_in(cell)))


def doc_cases() -> list[tuple[str, str, str | None, tuple[str, ...], bool]]:
    """(stage, TRL name, value, tether options the row names, whether all must be named) for
    every TRL setting in every table. A row with one setting must name all the row's options;
    as many settings as options pair up in order; otherwise each names one of them."""
    cases, section, header = [], "", None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):
            continue
        if header is None:
            header = cells
            continue
        settings = trl_settings(cells[0])
        for column, head in enumerate(header):
            if not head.lower().startswith("tether"):
                continue
            stages = tuple(w for w in re.findall(r"[a-z]+", head) if w in ONLINE + OFFLINE) \
                or SECTION_STAGES[section]
            options = tether_options(cells[column])
            for i, (name, value) in enumerate(settings):
                if len(settings) == 1:
                    wanted, every = tuple(options), True
                elif len(settings) == len(options):
                    wanted, every = (options[i],), True
                else:
                    wanted, every = tuple(options), False
                cases += [(stage, name, value, wanted, every) for stage in stages]
    return cases


CASES = doc_cases()


def refusal(stage: str, argv: list[str]) -> str:
    with pytest.raises(TetherError) as info:
        parse_config(config(stage), argv, prog=f"tether {stage}")
    return str(info.value)


def names(message: str, option: str) -> bool:
    return re.search(rf"--{option.replace('_', '-')}(?![a-z-])", message) is not None


def test_the_doc_has_the_tables_this_test_reads():
    stages = {case[0] for case in CASES}
    assert stages == set(ONLINE + OFFLINE), stages
    assert len({case[1] for case in CASES}) > 50  # every table was read, not just one


@pytest.mark.parametrize("stage, name, value, wanted, every",
                         [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}") for c in CASES])
def test_each_trl_name_in_the_doc_gets_the_doc_s_tether_option(stage, name, value, wanted, every):
    assert set(wanted) <= fields(stage), f"the doc names options tether {stage} lacks: {wanted}"
    if name in fields(stage):
        return  # the same name in both (beta, temperature, max_length): nothing to translate
    flag = "--" + name.replace("_", "-")
    message = refusal(stage, [flag, value] if value else [flag])
    assert re.match(rf"{flag}( \S+)? is TRL's (name|setting)", message), message
    assert message.endswith("(docs/from_trl.md)") and "\n" not in message, message
    if not wanted:
        assert "tether has no such option" in message, message
    else:
        found = [names(message, option) for option in wanted]
        assert all(found) if every else any(found), (wanted, message)
    said = re.search(r"tether's is (.*?)(;| \(docs)", message)  # what it points to exists here
    assert said is None or set(trl_names.options_in(said.group(1))) <= fields(stage), message


def test_what_the_doc_says_is_not_in_tether_yet_is_answered_so():
    text = DOC.read_text(encoding="utf-8").split("### Not in tether yet", 1)[1].split("\n## ", 1)[0]
    settings = trl_settings(text)
    assert len(settings) >= 6, settings
    for name, value in settings:
        flag = "--" + name.replace("_", "-")
        message = refusal("grpo", [flag, value] if value else [flag])
        assert "is TRL's" in message and "tether has no such option" in message, message


def test_every_name_in_the_code_s_table_is_in_the_doc():
    in_doc = {m.split("=")[0] for m in SPAN.findall(DOC.read_text(encoding="utf-8"))}
    assert {row.trl for row in trl_names.ROWS} <= in_doc


@pytest.mark.parametrize("row", trl_names.ROWS, ids=lambda r: f"{r.trl}-{r.value}")
def test_each_row_s_options_exist_where_the_row_speaks(row):
    stages = ONLINE + OFFLINE if row.stages == trl_names.ALL else row.stages
    have = [trl_names.fits(row, stage, fields(stage)) for stage in stages]
    assert all(have) if row.stages != trl_names.ALL else any(have), row


@pytest.mark.parametrize("stage, argv, expected", [
    # the examples
    ("grpo", ["--num-generations", "8"], "--num-generations is TRL's name; tether's is "
     "--samples-per-prompt (docs/from_trl.md)"),
    ("grpo", ["--num_generations", "8"], "--num_generations is TRL's name; tether's is "
     "--samples-per-prompt (docs/from_trl.md)"),  # TRL's own underscores
    ("grpo", ["--use-vllm"], "--use-vllm is TRL's name; tether's is --engine vllm (docs/from_trl.md)"),
    ("grpo", ["--loss-type=dr_grpo"], "--loss-type dr_grpo is TRL's setting; tether's is "
     "--loss-aggregation sum; its loss is TRL's times max_completion_length: divide --lr by that "
     "under SGD (docs/from_trl.md)"),
    ("grpo", ["--epsilon-high", "0.28"], "--epsilon-high is TRL's name; tether's is --clip-high"),
    # one TRL name, a different tether option by stage
    ("sft", ["--num-train-epochs", "3"], "tether's is --epochs (docs/from_trl.md)"),
    ("grpo", ["--num-train-epochs", "3"], "tether's is --total-episodes;"),
    ("dpo", ["--loss-type", "ipo"], "--loss-type ipo is TRL's setting; tether's is --loss ipo"),
    ("dpo", ["--loss-type", "hinge"], "tether has no such option: its DPO losses are"),
    # the stage lacks the option TRL's name maps to: said, not pointed at
    ("sft", ["--num-generations", "8"], "--num-generations is TRL's name for tether's "
     "--samples-per-prompt, which tether sft does not have (docs/from_trl.md)"),
    ("grpo", ["--loss-type", "sigmoid"], "--loss-type sigmoid is TRL's setting for tether's "
     "--loss sigmoid, which tether grpo does not have"),
    ("dpo", ["--eval-steps", "10"], "which tether dpo does not have"),
    ("sft", ["--disable-dropout"], "--disable-dropout is TRL's name; tether sft has no such option"),
    # near misses, and the rest
    ("grpo", ["--sample-per-prompt", "4"], "unknown option --sample-per-prompt; did you mean "
     "--samples-per-prompt?"),
    ("sft", ["--lr-scheduler", "cosine"], "unknown option --lr-scheduler; did you mean --lr-schedule?"),
    ("grpo", ["--bogus", "1"], "unknown option --bogus; see tether grpo --help"),
])
def test_unknown_flags(stage, argv, expected):
    message = refusal(stage, argv)
    assert message.startswith(expected) or expected in message, message
    assert message.count("--") <= 6, message  # a hint, not the list of every option


@pytest.mark.parametrize("stage, text, expected", [
    ("grpo", "num_generations: 8\n", "config field 'num_generations' in {} is TRL's name; "
     "tether's is samples_per_prompt (docs/from_trl.md)"),
    ("grpo", "use_vllm: true\n", "tether's is engine: vllm"),
    ("grpo", "loss_type: dr_grpo\n", "config field 'loss_type: dr_grpo' in {} is TRL's setting; "
     "tether's is loss_aggregation: sum; its loss is TRL's times max_completion_length: divide "
     "lr by that under SGD"),
    ("dpo", "betta: 0.2\n", "unknown config field 'betta' in {}; did you mean 'beta'?"),
    ("dpo", "bogus: 1\n", "unknown config field 'bogus' in {}; see tether dpo --help"),
])
def test_unknown_yaml_keys(tmp_path, stage, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    message = refusal(stage, ["--config", str(path)])
    assert expected.format(path) in message, message
    assert "\n" not in message and message.count(",") < 5, message


def test_a_saved_config_s_unknown_key_names_its_stage():
    with pytest.raises(TetherError, match=r"'bogus' in RMConfig dict; see tether rm --help$"):
        config_from_dict(config("rm"), {"bogus": 1})


def test_valid_options_parse_unchanged():
    cfg = parse_config(config("grpo"), ["--policy", "p", "--prompts", "q", "--samples-per-prompt",
                                        "8", "--batch-size", "16", "--clip-high", "0.28",
                                        "--loss-aggregation", "sum", "--no-mask-truncated"])
    assert (cfg.samples_per_prompt, cfg.clip_high, cfg.loss_aggregation) == (8, 0.28, "sum")
    assert cfg.mask_truncated is False


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["grpo", "--policy", "p", "--prompts", "q", "--num-generations", "8"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --num-generations is TRL's name; tether's is --samples-per-prompt "
                   "(docs/from_trl.md)\n")


def test_every_unknown_name_of_a_command_line_is_answered_at_once(capsys):
    # A command copied from TRL holds several of its names: one line answers them all, each with
    # the hint it gets alone, in the order given (issue 47: five round trips before).
    argv = ["--policy", "p", "--num-generations", "8", "--learning_rate", "1e-6",
            "--max-completion-length", "64", "--use-vllm", "--prompts", "q", "--polcy", "x"]
    alone = [refusal("grpo", [flag, *value]).removesuffix(" (docs/from_trl.md)")
             for flag, *value in (["--num-generations", "8"], ["--learning_rate", "1e-6"],
                                  ["--max-completion-length", "64"], ["--use-vllm"],
                                  ["--polcy", "x"])]
    assert main(["grpo", *argv]) == 2
    err = capsys.readouterr().err
    assert err == ("error: 5 names tether does not know: " + " | ".join(alone)
                   + " (docs/from_trl.md)\n")


def test_every_unknown_key_of_a_config_file_is_answered_at_once(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_generations: 8\npolicy: p\nmax_completion_length: 64\nbetta: 1\n")
    message = refusal("grpo", ["--config", str(path)])
    assert message.startswith("3 names tether does not know: config field 'num_generations' in ")
    assert ("tether's is max_new_tokens | unknown config field 'betta' in "
            f"{path}; did you mean 'beta'? (docs/from_trl.md)") in message
    assert "\n" not in message


@pytest.mark.parametrize("row", [r for r in trl_names.ROWS if not r.tether],
                         ids=lambda r: f"{r.trl}-{r.value}")
def test_no_row_says_tether_lacks_an_option_it_has(row):
    # The table fell behind once: TRL's packing was answered "no such option" after --pack
    # landed. A row that names no option must not be a name tether's configs use (or use
    # with an -ing or a plural).
    every = set().union(*(fields(stage) for stage in ONLINE + OFFLINE))
    near = [f for f in every if row.trl in (f, f + "ing", f + "s", f + "es")]
    assert not near, f"{row.trl} is answered 'no such option', but tether has --{near[0]}"
