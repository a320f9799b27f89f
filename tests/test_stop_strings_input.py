"""`--stop-strings` as users give it (issue 23).

The flag takes its strings as separate values after one flag (`--stop-strings '###' 'Q:'`); each
value is one stop string, commas included. An empty value is inside every text, so it cut every
response to one token with exit 0; it is now one line naming it, before anything loads or is
written, from the command line, a YAML config, a sweep grid (`config_from_dict`) and the Python
API alike. The flag with no values means no stop strings, as omitting it does.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from refusals import refused

from tether.cli import main
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.rl.rollout import Rollout, apply_stop_strings
from tether.run.parse import config_from_dict, parse_config
from tether.tools.config import GenerateConfig
from tether.train.ppo_config import GRPOConfig, PPOConfig

EMPTY = r"--stop-strings value {k} is the empty string, which every response contains, so each " \
        r"would end after one token; drop it \(omit --stop-strings for none\)"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("stops")
    (base / "prompts.jsonl").write_text('{"prompt": "the movie"}\n{"prompt": "it was"}\n')
    (base / "rewards.py").write_text("def score(p, r):\n    return [0.0] * len(r)\n")
    (base / "stops.yaml").write_text('stop_strings: ["###", ""]\n')
    return base


@pytest.mark.parametrize("stage", ["ppo", "grpo", "rloo", "generate"])
@pytest.mark.parametrize("stops, k", [([""], 0), (["###", ""], 1), (["--config", "stops.yaml"], 1)],
                         ids=["empty", "second empty", "yaml"])
def test_an_empty_stop_string_is_one_line(stage, stops, k, root, tiny_model_dir, capsys):
    flags = ["--config", str(root / stops[1])] if stops[0] == "--config" else ["--stop-strings", *stops]
    if stage == "generate":
        argv = ["generate", "--model", str(tiny_model_dir), "--prompts", str(root / "prompts.jsonl"),
                "--output", str(root / "out.jsonl"), "--device", "cpu", *flags]
    else:
        argv = [stage, "--policy", str(tiny_model_dir), "--prompts", str(root / "prompts.jsonl"),
                "--reward-fn", f"{root / 'rewards.py'}:score", "--output-dir", str(root / "runs"),
                "--device", "cpu", *flags]
    line = refused(root, argv, EMPTY.format(k=k), capsys)
    assert re.fullmatch("error: " + EMPTY.format(k=k), line), line


def test_a_sweep_grid_or_python_caller_gets_the_same_line(tiny_model_dir):
    # A sweep grid's ppo block is read with config_from_dict; a Python caller may skip validation
    with pytest.raises(TetherError, match=EMPTY.format(k=0)):
        config_from_dict(PPOConfig, {"policy": "p", "prompts": "q", "stop_strings": [""]})
    with pytest.raises(TetherError, match=EMPTY.format(k=0)):
        config_from_dict(GenerateConfig, {"model": "m", "prompts": "q", "stop_strings": [""]})
    tok = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(TetherError, match=EMPTY.format(k=1)):
        apply_stop_strings(_rollout(tok, "good film. and more"), tok, [".", ""], tok.pad_token_id)


def test_how_the_flag_reads_its_values():
    def stops(*flags):
        return parse_config(GRPOConfig, ["--policy", "p", "--prompts", "q", *flags]).stop_strings

    assert stops() == []  # the default: none
    assert stops("--stop-strings") == []  # the flag with no values: none, as omitting it
    assert stops("--stop-strings", "###", "Q:") == ["###", "Q:"]  # several: separate values
    assert stops("--stop-strings", ",,") == [",,"]  # one value is one string, commas and all
    assert stops("--stop-strings", "a,b") == ["a,b"]
    assert stops("--stop-strings", " ") == [" "]  # whitespace is text (a newline is a usual stop)


def _rollout(tok, text: str) -> Rollout:
    prompt = tok("the")["input_ids"]
    response = tok(text)["input_ids"]
    ids = torch.tensor([prompt + response])
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Rollout(input_ids=ids, attention_mask=mask.long(), response_mask=mask[:, len(prompt):],
                   ended=torch.tensor([False]), context_length=len(prompt))


def test_a_stop_string_of_commas_is_that_string(tiny_model_dir):
    # ",," ends the response after the token that completes ",,", not at the first ","
    tok = load_tokenizer(str(tiny_model_dir))
    text = "the movie, was fine,, and more"
    rollout = _rollout(tok, text)
    tokens = rollout.input_ids[0, rollout.context_length:].tolist()

    def kept(stops):
        cut = apply_stop_strings(rollout, tok, stops, tok.pad_token_id)
        assert bool(cut.ended[0])
        return tok.decode(tokens[:int(cut.response_mask[0].sum())])

    assert kept([",,"]).endswith("fine,,") and kept([","]).endswith("movie,")
    assert "," not in kept([","])[:-1] and ",," not in kept([",,"])[:-2]


def test_the_flag_with_no_values_generates_as_without_it(root, tiny_model_dir):
    outputs = []
    for name, flags in (("without", []), ("empty_flag", ["--stop-strings"])):
        out = root / f"{name}.jsonl"
        assert main(["generate", "--model", str(tiny_model_dir), "--prompts",
                     str(root / "prompts.jsonl"), "--output", str(out), "--device", "cpu",
                     "--max-new-tokens", "6", "--seed", "2", *flags]) == 0
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2
