"""Issue 33, clusters 3 and 4: what a model can take, refused from its config.json before any
weights load (tether.models.limits), through the real CLI on the tiny GPT-2 (learned positions,
`n_positions`) and the tiny Llama-style model (rotary, `max_position_embeddings`), 256 positions
each.

- A. lengths: a row (sft, rm, dpo) or a prompt plus --max-new-tokens (ppo, rloo, grpo, generate,
  eval, also with --engine vllm; one turn for episodes) longer than the positions of any model
  that reads it (policy, reference, tether reward model) was an IndexError mid-run; a hub reward
  model whose tokenizer outgrows its embedding rows was one at batch 1.
- B. a sequence classifier (a hub one, a tether reward model, a SEQ_CLS peft adapter) given where
  a language model is needed was loaded as a causal LM with a random head, exit 0.
- C. `tether eval --model ./nope` asked for --output instead of naming the missing path.

Each refusal runs under `no_loads` (tests/test_early_checks.py's guard: any weight load fails the
test) and `refused` (exit 2, one line, nothing written). The valid neighbours run for real: a
length exactly at the limit trains and samples, so the limit is neither too low nor one off.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import sample_texts
from offline_fixtures import write_jsonl
from refusals import refused
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from tether.cli import main
from tether.models.hub_reward import CLASSIFIER, check_reward_model
from tether.models.limits import language_model, positions
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.tiny import save_tiny, save_tiny_llama

MODELS = ["tiny_model_dir", "tiny_llama_dir"]
FIELD = {"tiny_model_dir": "n_positions", "tiny_llama_dir": "max_position_embeddings"}
LONG = " ".join(["the movie was good and the plot was fun"] * 40)  # ~360 tokens, 256 positions


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("fit")
    write_jsonl(base / "sft.jsonl", [{"prompt": "the movie was", "response": LONG},
                                     {"prompt": "it", "response": " fine."}])
    write_jsonl(base / "prefs.jsonl", [
        {"prompt": "the movie was", "chosen": " great" + LONG, "rejected": " dull."},
        {"prompt": "it", "chosen": " good.", "rejected": " bad."}])
    write_jsonl(base / "long_prompts.jsonl", [{"prompt": LONG}, {"prompt": "it"}])
    write_jsonl(base / "prompts.jsonl", [{"prompt": "the movie was"}, {"prompt": "it"}])
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [0.0] * len(responses)\n", encoding="utf-8")
    (base / "tools.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n'
                                   '        a: one\n        b: two\n    """\n    return a + b\n',
                                   encoding="utf-8")
    (base / "runs").mkdir()
    return base


def _refused(root, argv, pattern, capsys, monkeypatch, no_loads) -> str:
    monkeypatch.chdir(root)
    line = refused(root, [str(a) for a in argv], pattern, capsys)
    assert no_loads == [], f"models loaded before the error: {no_loads}"
    return line


def _classifier(model_dir, out, extra_tokens: int = 0):
    """`model_dir`'s architecture as a one-label sequence classifier (random weights: built from
    its config, nothing loaded) with its tokenizer, `extra_tokens` more ids than embedding rows."""
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([f"qq{i}zz" for i in range(extra_tokens)])
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def kinds(request, tmp_path_factory):
    """For each tiny model: the model itself; a copy with 128 positions and the same tokenizer (a
    reference that reads less); the reward-model kinds that are no language model (a hub
    classifier, a tether reward model, a peft SEQ_CLS adapter); a classifier whose tokenizer has
    2 ids past its embedding rows."""
    out = {}
    for name in MODELS:
        model_dir = request.getfixturevalue(name)
        base = tmp_path_factory.mktemp(f"kinds_{name}")
        save = save_tiny if name == "tiny_model_dir" else save_tiny_llama
        short = save(base / "short", sample_texts(), vocab_size=300,
                     **({"n_positions": 128} if name == "tiny_model_dir" else
                        {"max_positions": 128}))
        classifier = _classifier(model_dir, base / "classifier")
        tokenizer = load_tokenizer(str(model_dir))
        RewardModel.from_causal_lm(str(model_dir), tokenizer).save_pretrained(base / "tether_rm",
                                                                               tokenizer)
        from peft import LoraConfig, get_peft_model

        cls = AutoModelForSequenceClassification.from_pretrained(classifier)
        get_peft_model(cls, LoraConfig(task_type="SEQ_CLS", r=2, target_modules="all-linear")
                       ).save_pretrained(base / "seq_cls_adapter")
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(base / "seq_cls_adapter")
        out[name] = {"model": model_dir, "short": short, "classifier": classifier,
                     "tether_rm": base / "tether_rm", "adapter": base / "seq_cls_adapter",
                     "big_tokenizer": _classifier(model_dir, base / "big_tokenizer", 2)}
    return out


RUN = ["--output-dir", "runs", "--run-name", "x", "--device", "cpu"]
ONLINE = [*RUN, "--reward-fn", "rewards.py:score"]
EVAL = ["--output", "runs/eval.json", "--device", "cpu"]


# ----------------------------------------------------------------------------- A.1 rows

ROWS = [  # argv (M: the model, S: the 128-position copy), the model the line names
    (["sft", "--model", "M", "--data", "sft.jsonl", "--max-length", "400", *RUN], "M", 256),
    (["rm", "--model", "M", "--data", "prefs.jsonl", "--eval-fraction", "0", "--max-length",
      "400", *RUN], "M", 256),
    (["dpo", "--model", "M", "--data", "prefs.jsonl", "--max-length", "400", *RUN], "M", 256),
    (["dpo", "--model", "M", "--ref-model", "S", "--data", "prefs.jsonl", "--max-length", "200",
      *RUN], "S", 128),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("argv, named, limit", ROWS, ids=["sft", "rm", "dpo", "dpo-ref-model"])
def test_rows_longer_than_the_positions_are_refused(root, kinds, model, argv, named, limit,
                                                    capsys, monkeypatch, no_loads):
    paths = {"M": kinds[model]["model"], "S": kinds[model]["short"]}
    argv = [paths.get(a, a) for a in argv]
    field = FIELD[model]
    _refused(root, argv, rf"--max-length \d+ lets rows of .*\.jsonl reach \d+ tokens, "
             rf"more than the {limit} positions of model {paths[named]} \({field} in its "
             rf"config.json\); lower --max-length to at most {limit}$", capsys, monkeypatch,
             no_loads)


@pytest.mark.parametrize("model", MODELS)
def test_sft_rows_exactly_at_the_limit_train(root, kinds, model, tmp_path, monkeypatch, capsys):
    """The neighbour: the long row cut to --max-length 256, every position used, trains."""
    monkeypatch.chdir(root)
    code = main(["sft", "--model", str(kinds[model]["model"]), "--data", "sft.jsonl",
                 "--max-length", "256", "--max-steps", "1", "--batch-size", "2",
                 "--output-dir", str(tmp_path), "--run-name", "x", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "x" / "final").is_dir()


@pytest.mark.parametrize("model", MODELS)
def test_dpo_reference_exactly_at_its_limit_trains(root, kinds, model, tmp_path, monkeypatch,
                                                   capsys):
    monkeypatch.chdir(root)
    code = main(["dpo", "--model", str(kinds[model]["model"]), "--ref-model",
                 str(kinds[model]["short"]), "--data", "prefs.jsonl", "--max-length", "128",
                 "--max-steps", "1", "--batch-size", "2", "--output-dir", str(tmp_path),
                 "--run-name", "x", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err


# ----------------------------------------------------------------------------- A.2 samples

SAMPLES = [  # argv, the model the line names
    (["ppo", "--policy", "M", "--prompts", "long_prompts.jsonl", *ONLINE], "M", 256),
    (["rloo", "--policy", "M", "--prompts", "long_prompts.jsonl", *ONLINE], "M", 256),
    (["grpo", "--policy", "M", "--prompts", "long_prompts.jsonl", *ONLINE], "M", 256),
    (["grpo", "--policy", "M", "--prompts", "long_prompts.jsonl", "--engine", "vllm", *ONLINE],
     "M", 256),
    (["ppo", "--policy", "M", "--prompts", "prompts.jsonl", "--eval-prompts",
      "long_prompts.jsonl", *ONLINE], "M", 256),
    (["ppo", "--policy", "M", "--ref-model", "S", "--prompts", "long_prompts.jsonl",
      "--max-prompt-len", "120", "--max-new-tokens", "16", *ONLINE], "S", 128),
    (["generate", "--model", "M", "--prompts", "long_prompts.jsonl", "--device", "cpu"],
     "M", 256),
    (["generate", "--model", "M", "--prompts", "long_prompts.jsonl", "--engine", "vllm",
      "--device", "cpu"], "M", 256),
    (["eval", "--model", "M", "--prompts", "long_prompts.jsonl", *EVAL], "M", 256),
    (["eval", "--model", "M", "--reference", "S", "--prompts", "long_prompts.jsonl",
      "--max-prompt-len", "120", "--max-new-tokens", "16", *EVAL], "S", 128),
]
SAMPLE_IDS = ["ppo", "rloo", "grpo", "grpo-vllm", "ppo-eval-prompts", "ppo-ref-model",
              "generate", "generate-vllm", "eval", "eval-reference"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("argv, named, limit", SAMPLES, ids=SAMPLE_IDS)
def test_prompt_plus_new_tokens_longer_than_the_positions_is_refused(
        root, kinds, model, argv, named, limit, capsys, monkeypatch, no_loads):
    """Before any weights load, so before any engine starts: with --engine vllm too (the extra
    check is stubbed: vLLM need not be installed for a line that comes before it)."""
    monkeypatch.setattr("tether.cli.require_engine", lambda engine: None)
    paths = {"M": kinds[model]["model"], "S": kinds[model]["short"]}
    argv = [paths.get(a, a) for a in argv]
    _refused(root, argv, rf"^error: the longest prompt of .*long_prompts.jsonl \(\d+ tokens, "
             rf"--max-prompt-len \d+\) plus --max-new-tokens \d+ is \d+ tokens, more than the "
             rf"{limit} positions of model {paths[named]} \({FIELD[model]} in its config.json\); "
             rf"lower --(max-new-tokens|max-prompt-len) to at most \d+",
             capsys, monkeypatch, no_loads)


def test_the_fix_names_the_largest_values_that_fit(root, kinds, capsys, monkeypatch, no_loads):
    """--max-prompt-len 250 cuts the long prompt to 250; with 8 new tokens that is 258 > 256:
    either 6 new tokens or a prompt of 248 fits."""
    line = _refused(root, ["generate", "--model", kinds["tiny_model_dir"]["model"], "--prompts",
                           "long_prompts.jsonl", "--max-prompt-len", "250", "--max-new-tokens",
                           "8", "--device", "cpu"], "is 258 tokens", capsys, monkeypatch,
                    no_loads)
    assert line.endswith("lower --max-new-tokens to at most 6 or --max-prompt-len to at most 248")


@pytest.mark.parametrize("model", MODELS)
def test_generate_exactly_at_the_limit_samples(root, kinds, model, tmp_path, monkeypatch, capsys):
    """The neighbour of the native sampler's IndexError: 248 prompt tokens + 8 new = 256."""
    monkeypatch.chdir(root)
    out = tmp_path / "gen.jsonl"
    code = main(["generate", "--model", str(kinds[model]["model"]), "--prompts",
                 "long_prompts.jsonl", "--max-prompt-len", "248", "--max-new-tokens", "8",
                 "--device", "cpu", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("model", MODELS)
def test_grpo_exactly_at_the_limit_trains(root, kinds, model, tmp_path, monkeypatch, capsys):
    """Sampling, then the policy's and the reference's forward over all 256 positions."""
    monkeypatch.chdir(root)
    code = main(["grpo", "--policy", str(kinds[model]["model"]), "--prompts",
                 "long_prompts.jsonl", "--reward-fn", "rewards.py:score", "--max-prompt-len",
                 "248", "--max-new-tokens", "8", "--batch-size", "2", "--samples-per-prompt",
                 "2", "--total-episodes", "2", "--output-dir", str(tmp_path), "--run-name", "x",
                 "--device", "cpu"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("stage", ["grpo", "generate"])
def test_an_episode_turn_longer_than_the_positions_is_refused(root, kinds, stage, capsys,
                                                              monkeypatch, no_loads):
    model = kinds["tiny_llama_dir"]["model"]
    argv = (["grpo", "--policy", model, "--prompts", "prompts.jsonl", *ONLINE]
            if stage == "grpo" else ["generate", "--model", model, "--prompts", "prompts.jsonl",
                                     "--device", "cpu"])
    _refused(root, [*argv, "--tools", "tools.py:add", "--max-new-tokens", "256",
                    "--max-episode-tokens", "512"],
             rf"--max-new-tokens 256 leaves no room for a prompt within the 256 positions of "
             rf"model {model} \(max_position_embeddings in its config.json\); lower "
             r"--max-new-tokens to at most 255$", capsys, monkeypatch, no_loads)


# ----------------------------------------------------------------------------- A.3 vocabulary

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stage", ["grpo", "eval"])
def test_a_hub_reward_model_whose_tokenizer_outgrows_its_rows_is_refused(
        root, kinds, model, stage, capsys, monkeypatch, no_loads):
    rm = kinds[model]["big_tokenizer"]
    argv = (["grpo", "--policy", kinds[model]["model"], "--prompts", "prompts.jsonl", *RUN]
            if stage == "grpo" else
            ["eval", "--model", kinds[model]["model"], "--prompts", "prompts.jsonl", *EVAL])
    _refused(root, [*argv, "--reward-model", rm],
             rf"reward model {rm}: its tokenizer has 302 tokens but the model has 300 embedding "
             r"rows \(vocab_size in its config.json\), so ids from 300 on would index no row; "
             r"save the tokenizer it was trained with", capsys, monkeypatch, no_loads)


@pytest.mark.parametrize("model", MODELS)
def test_a_hub_reward_model_with_its_own_tokenizer_passes(kinds, model, no_loads):
    assert check_reward_model(str(kinds[model]["classifier"])) == CLASSIFIER


# ----------------------------------------------------------------------------- B. not an LM

WHERE = [  # argv with X for the model under test, the option the line names, takes --reward-model
    (["sft", "--model", "X", "--data", "sft.jsonl", *RUN], "--model", False),
    (["dpo", "--model", "X", "--data", "prefs.jsonl", *RUN], "--model", False),
    (["dpo", "--model", "M", "--ref-model", "X", "--data", "prefs.jsonl", *RUN], "--ref-model",
     False),
    (["ppo", "--policy", "X", "--prompts", "prompts.jsonl", *ONLINE], "--policy", True),
    (["rloo", "--policy", "X", "--prompts", "prompts.jsonl", *ONLINE], "--policy", True),
    (["grpo", "--policy", "X", "--prompts", "prompts.jsonl", *ONLINE], "--policy", True),
    (["ppo", "--policy", "M", "--ref-model", "X", "--prompts", "prompts.jsonl", *ONLINE],
     "--ref-model", True),
    (["generate", "--model", "X", "--prompts", "prompts.jsonl", "--device", "cpu"], "--model",
     False),
    (["eval", "--model", "X", "--prompts", "prompts.jsonl", *EVAL], "--model", True),
    (["eval", "--model", "M", "--reference", "X", "--prompts", "prompts.jsonl", *EVAL],
     "--reference", True),
]
WHERE_IDS = ["sft", "dpo", "dpo-ref-model", "ppo", "rloo", "grpo", "ppo-ref-model", "generate",
             "eval", "eval-reference"]
WHAT = {"classifier": "ForSequenceClassification, a sequence-classification model",
        "tether_rm": "a tether reward model \\(it has tether_reward.json",
        "adapter": "a peft adapter of task SEQ_CLS"}


def _not_an_lm(option: str, path, kind: str, takes_reward_model: bool) -> str:
    fix = (rf"pass it as --reward-model, and a causal LM \(e.g. the SFT model\) as {option}$"
           if takes_reward_model else
           rf"pass a causal LM \(e.g. the SFT model\) as {option}; a reward model scores in "
           r"tether ppo, rloo, grpo and eval \(--reward-model\)$")
    return rf"^error: {option} {path} is not a language model: it is .*{WHAT[kind]}.*; {fix}"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("argv, option, takes_rm", WHERE, ids=WHERE_IDS)
def test_a_classifier_where_a_language_model_is_needed_is_refused(
        root, kinds, model, argv, option, takes_rm, capsys, monkeypatch, no_loads):
    given = kinds[model]["classifier"]
    argv = [{"X": given, "M": kinds[model]["model"]}.get(a, a) for a in argv]
    _refused(root, argv, _not_an_lm(option, given, "classifier", takes_rm), capsys, monkeypatch,
             no_loads)


@pytest.mark.parametrize("kind", ["tether_rm", "adapter"])
@pytest.mark.parametrize("argv, option, takes_rm", [WHERE[0], WHERE[5], WHERE[7], WHERE[8]],
                         ids=["sft", "grpo", "generate", "eval"])
def test_a_reward_model_of_any_kind_is_no_language_model(root, kinds, kind, argv, option,
                                                         takes_rm, capsys, monkeypatch,
                                                         no_loads):
    """A tether reward model (round two's `eval --model` of one exited 0) and a SEQ_CLS adapter,
    on GPT-2 (the kind is read from files that do not depend on the architecture)."""
    given = kinds["tiny_model_dir"][kind]
    argv = [{"X": given}.get(a, a) for a in argv]
    _refused(root, argv, _not_an_lm(option, given, kind, takes_rm), capsys, monkeypatch,
             no_loads)


@pytest.mark.parametrize("model", MODELS)
def test_a_language_model_passes_with_its_positions(kinds, model, no_loads):
    found = language_model(str(kinds[model]["model"]), "--model")
    assert (found.limit, found.field) == (256, FIELD[model])
    assert language_model(str(kinds[model]["short"]), "--model").limit == 128


def test_a_declared_rope_scaling_extends_the_limit():
    """Qwen2.5's long-context recipe: YaRN with factor 4 over 32768 positions reads 131072."""
    config = transformers.Qwen2Config(max_position_embeddings=32768, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    found = positions(config, "qwen")
    assert (found.limit, found.field) == (131072, "max_position_embeddings x rope_scaling factor 4")
    assert positions(transformers.LlamaConfig(max_position_embeddings=4096), "l").limit == 4096


# ----------------------------------------------------------------------------- C. eval path

def test_eval_of_a_missing_model_path_names_the_path(root, capsys, monkeypatch, no_loads):
    _refused(root, ["eval", "--model", "./nope", "--prompts", "prompts.jsonl", "--device", "cpu"],
             r"^error: model path \./nope does not exist; pass a model directory or hub name$",
             capsys, monkeypatch, no_loads)


def test_eval_of_a_hub_name_still_asks_for_output(root, capsys, monkeypatch, no_loads):
    """The neighbour: a hub name has no directory to write beside."""
    _refused(root, ["eval", "--model", "someone/some-model", "--prompts", "prompts.jsonl",
                    "--device", "cpu"], r"is not a local directory; pass --output FILE.json",
             capsys, monkeypatch, no_loads)


def test_the_guard_sees_a_model_load(kinds, no_loads):
    """`no_loads` does catch the loads the stages make (else every refusal above proves nothing)."""
    with pytest.raises(AssertionError, match="was loaded before"):
        AutoModelForSequenceClassification.from_pretrained(kinds["tiny_model_dir"]["classifier"])
