"""Every stage's CLI against bad input: exit code 2, exactly one line on stderr that starts with
`error:`, no traceback, and nothing created or changed on disk (file hashes before and after).

The cases are the mistakes users make: bad flag values (NaN too), paths that do not exist,
broken data files, models that cannot load, reward functions that cannot be imported, flags that
contradict each other. The catalogue of these errors and their fixes is docs/errors.md.
"""

from __future__ import annotations

import json
import shutil

import pytest
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from refusals import refused

from tether.cli import main

SFT, PREFS, PROMPTS = "sft.jsonl", "prefs.jsonl", "prompts.jsonl"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir):
    """Good inputs, broken ones, and a finished run that no bad call may touch."""
    base = tmp_path_factory.mktemp("bad")
    write_jsonl(base / SFT, sft_rows(8))
    write_jsonl(base / PREFS, preference_rows(8))
    write_jsonl(base / PROMPTS, [{"prompt": "the movie was"}, {"prompt": "it"}])
    files = {
        "empty.jsonl": b"",
        "badjson.jsonl": b'{"prompt": "a", "response": "b"}\n{"prompt": \n',
        "latin1.jsonl": '{"prompt": "caf\xe9", "response": "ok"}\n'.encode("latin-1"),
        "list.jsonl": b'[1, 2]\n',
        "noresponse.jsonl": b'{"prompt": "the movie"}\n',
        "data.txt": b"the movie was fine\n",
        "same.jsonl": b'{"prompt": "p", "chosen": "x", "rejected": "x"}\n',
        "margin.jsonl": b'{"prompt": "p", "chosen": "a", "rejected": "b", "m": "high"}\n',
        "long.jsonl": b'{"prompt": "' + b"the movie was long " * 40 + b'", "response": "ok"}\n',
        "chatprompt.jsonl": b'{"prompt": [{"role": "user", "content": "hi"}], "response": "a"}\n',
        "noprompt.jsonl": b'{"text": "the movie"}\n',
        "emptyprompt.jsonl": b'{"prompt": ""}\n',
        # TRL's shapes and content parts (docs/data.md): what is still wrong with them
        "imagepart.jsonl": b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                           b'"image_url": {"url": "a.png"}}]}, {"role": "assistant", "content": "b"}]}\n',
        "numbercontent.jsonl": b'{"messages": [{"role": "user", "content": 3}, '
                               b'{"role": "assistant", "content": "b"}]}\n',
        "nocompletion.jsonl": b'{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n',
        "mixedsft.jsonl": b'{"prompt": "a", "response": "b"}\n{"prompt": "c", "completion": "d"}\n',
        "mixedprefs.jsonl": b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                            b'{"chosen": "a b", "rejected": "a c"}\n',
        "nocommon.jsonl": b'{"chosen": "good.", "rejected": "dull."}\n',
        "bad.yaml": b"lr: [1, 2\n",
        "unknown.yaml": b"learning_rate: 0.1\n",
        "typed.yaml": b"batch_size: many\n",
        "nan.yaml": b"lr: .nan\n",
        "rewards.py": b"def score(prompts, responses):\n    return [0.0] * len(responses)\n",
        "broken.py": b"import not_a_module_anywhere\n",
    }
    for name, content in files.items():
        (base / name).write_bytes(content)
    (base / "not_a_model").mkdir()
    (base / "not_a_model" / "config.json").write_text(json.dumps({"model_type": "nonsense"}))
    _reward_model_lookalikes(base, tiny_model_dir)
    out = base / "runs"
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(base / SFT), "--run-name",
                 "done", "--output-dir", str(out), "--max-steps", "1", "--batch-size", "4",
                 "--device", "cpu"]) == 0
    # A run stopped after its first checkpoint (no final model): resumable.
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(base / SFT), "--run-name",
                 "partial", "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4",
                 "--save-every", "1", "--device", "cpu"]) == 0
    shutil.rmtree(out / "partial" / "final")
    return base


def _reward_model_lookalikes(base, tiny_model_dir):
    """What `--reward-model` must refuse: a two-label classifier and a causal LM's LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base / "two_labels")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(
        base / "two_labels")
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(lm, LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM")
                   ).save_pretrained(base / "lm_adapter")


OFFLINE = [  # (stage, data file, extra flags, pattern the one line must contain)
    ("sft", "missing.jsonl", [], "data file .*missing.jsonl not found"),
    ("sft", "empty.jsonl", [], "has no rows"),
    ("sft", "badjson.jsonl", [], "line 2 is not valid JSON"),
    ("sft", "latin1.jsonl", [], "not valid UTF-8"),
    ("sft", "list.jsonl", [], "every row must be an object"),
    ("sft", "noresponse.jsonl", [], "no column 'response'"),
    ("sft", "data.txt", [], "unknown data format '.txt'"),
    ("sft", "long.jsonl", ["--max-length", "16"], "prompt has .* tokens"),
    ("sft", "long.jsonl", ["--max-length", "16", "--on-long-prompt", "skip"], "every row was skipped"),
    ("sft", "chatprompt.jsonl", [], "chat template"),
    ("sft", "imagepart.jsonl", [], "row 0 'messages' message 0 content part 0 has type 'image_url'"),
    ("sft", "numbercontent.jsonl", [], "content must be a string or a list of text parts"),
    ("sft", "nocompletion.jsonl", [], r"row 1 has no column 'response' \(or 'completion'\)"),
    ("sft", "mixedsft.jsonl", [], r"row 1 is a \{prompt, completion\} row but row 0 is a \{prompt, response\}"),
    ("sft", SFT, ["--lr", "nan"], "'lr' must be a finite number"),
    ("sft", SFT, ["--lr", "inf"], "'lr' must be a finite number"),
    ("sft", SFT, ["--lr", "-1"], "'lr' must be > 0"),
    ("sft", SFT, ["--max-grad-norm", "nan"], "'max_grad_norm' must be a finite number"),
    ("sft", SFT, ["--batch-size", "0"], "'batch_size' must be > 0"),
    ("sft", SFT, ["--max-length", "0"], "'max_length' must be > 0"),
    ("sft", SFT, ["--epochs", "0"], "'epochs' must be > 0"),
    ("sft", SFT, ["--batch-size", "8", "--grad-accum-steps", "3"], "--grad-accum-steps 3 must"),
    ("sft", SFT, ["--grad-accum-steps", "0"], "--grad-accum-steps 0 must"),
    ("sft", SFT, ["--warmup-steps", "-2"], "'warmup_steps' must be >= 0"),
    ("sft", SFT, ["--lr-schedule", "step"], "lr-schedule|lr_schedule"),
    ("sft", SFT, ["--loss-on", "first"], "'loss_on' must be one of: all, last"),
    ("sft", SFT, ["--dtype", "float8"], "dtype"),
    ("sft", SFT, ["--mixed-precision", "fp8"], "mixed-precision|mixed_precision"),
    ("sft", SFT, ["--mixed-precision", "bf16", "--dtype", "float16"], "float16"),
    ("sft", SFT, ["--device", "tpu"], "'device' must be one of"),
    ("sft", SFT, ["--run-name", ".."], "'run_name' must be a plain non-empty name"),
    ("sft", SFT, ["--run-name", "a/b"], "'run_name' must be a plain non-empty name"),
    ("sft", SFT, ["--lora-r", "-1"], "'lora_r' must be >= 0"),
    ("sft", SFT, ["--lora-r", "4", "--lora-dropout", "1.0"], "'lora_dropout' must be in"),
    ("sft", SFT, ["--lora-r", "4", "--lora-target-modules", "qkv"], "qkv matches no linear"),
    ("sft", SFT, ["--merge-lora"], "--merge-lora applies with --lora-r above 0"),
    ("sft", SFT, ["--learning-rate", "1"], "--learning-rate is TRL's name; tether's is --lr "),
    ("sft", SFT, ["--config", "missing.yaml"], "config file .* not found"),
    ("sft", SFT, ["--config", "bad.yaml"], "not valid UTF-8 YAML"),
    ("sft", SFT, ["--config", "unknown.yaml"], "config field 'learning_rate' in .* tether's is lr "),
    ("sft", SFT, ["--config", "typed.yaml"], "'batch_size' must be an integer"),
    ("sft", SFT, ["--config", "nan.yaml"], "'lr' must be a finite number"),
    ("sft", SFT, ["--model", "MISSING_MODEL"], "model path .* does not exist"),
    ("sft", SFT, ["--model", "not_a_model"], "tokenizer|cannot load"),
    ("sft", SFT, ["--model", "org/not-cached-model"], "HF_HUB_OFFLINE"),
    ("sft", SFT, ["--resume", "--lr", "1"], "--resume with a different config"),
    ("sft", SFT, ["--run-name", "done"], "already has results"),
    ("rm", SFT, [], "no column 'chosen'"),
    ("rm", "same.jsonl", [], "identical chosen and rejected"),
    ("rm", "mixedprefs.jsonl", [], r"row 1 is a \{chosen, rejected\} row but row 0"),
    ("dpo", "nocommon.jsonl", [], "share no opening words"),
    ("dpo", "imagepart.jsonl", [], "no column 'chosen'"),
    ("rm", "margin.jsonl", ["--margin-column", "m"], "column 'm' must be a number"),
    ("rm", PREFS, ["--margin-column", "missing"], "no column 'missing'"),
    ("rm", PREFS, ["--eval-fraction", "1.5"], "'eval_fraction' must be in"),
    ("rm", PREFS, ["--center-rewards-coef", "-1"], "'center_rewards_coef' must be >= 0"),
    ("rm", PREFS, ["--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout must be 0"),
    ("rm", PREFS, ["--eval-data", "missing.jsonl"], "not found"),
    ("dpo", SFT, [], "no column"),
    ("dpo", PREFS, ["--beta", "0"], "'beta' must be > 0"),
    ("dpo", PREFS, ["--beta", "nan"], "'beta' must be a finite number"),
    ("dpo", PREFS, ["--label-smoothing", "0.5"], "'label_smoothing' must be in"),
    ("dpo", PREFS, ["--loss", "ipo", "--label-smoothing", "0.1"], "applies to loss=sigmoid"),
    ("dpo", PREFS, ["--loss", "hinge"], "loss"),
    ("dpo", PREFS, ["--ref-model", "MISSING_MODEL"], "does not exist"),
    ("dpo", PREFS, ["--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout must be 0"),
]

PPO = [  # extra flags after a good --policy (unless replaced) and --prompts
    (["--reward-fn", "rewards.py:score", "--reward-model", "x"], "give exactly one reward"),
    ([], "give exactly one reward.*none"),
    (["--reward-fn", "nocolon"], "must look like module:function"),
    (["--reward-fn", "missing.py:score"], "does not exist"),
    (["--reward-fn", "broken.py:score"], "cannot import"),
    (["--reward-fn", "rewards.py:nothing"], "no callable named 'nothing'"),
    (["--reward-fn", "rewards.py:score", "--prompts", "missing.jsonl"], "not found"),
    (["--reward-fn", "rewards.py:score", "--prompts", "noprompt.jsonl"], "row 0 has neither"),
    (["--reward-fn", "rewards.py:score", "--prompts", "emptyprompt.jsonl"], "empty prompt"),
    (["--reward-fn", "rewards.py:score", "--prompts", "imagepart.jsonl"],
     "row 0 'messages' message 0 content part 0 has type 'image_url'"),
    (["--reward-fn", "rewards.py:score", "--kl-in", "both"], "'kl_in' must be one of: reward, loss"),
    (["--reward-fn", "rewards.py:score", "--kl-in", "loss", "--kl-estimator", "k1"],
     "no useful gradient as a loss term"),
    (["--reward-fn", "rewards.py:score", "--batch-size", "8", "--num-minibatches", "3"],
     "--num-minibatches 3 must divide"),
    (["--reward-fn", "rewards.py:score", "--batch-size", "8", "--micro-batch-size", "3"],
     "micro-batch-size"),
    (["--reward-fn", "rewards.py:score", "--batch-size", "8", "--total-episodes", "4"],
     "less than one batch"),
    (["--reward-fn", "rewards.py:score", "--gamma", "2"], "'gamma' must lie in"),
    (["--reward-fn", "rewards.py:score", "--temperature", "0"], "'temperature' must be > 0"),
    (["--reward-fn", "rewards.py:score", "--temperature", "nan"], "finite number"),
    (["--reward-fn", "rewards.py:score", "--beta", "nan"], "'beta' must be a finite number"),
    (["--reward-fn", "rewards.py:score", "--kl-ctl", "adaptive", "--kl-target", "nan"],
     "'kl_target' must be a finite number"),
    (["--reward-fn", "rewards.py:score", "--kl-ctl", "adaptive", "--kl-target", "0"],
     "'kl_target' must be > 0"),
    (["--reward-fn", "rewards.py:score", "--max-kl", "-1"], "'max_kl' must be >= 0"),
    (["--reward-fn", "rewards.py:score", "--gold-fn", "rewards.py:score"],
     "--gold-fn applies with --eval-prompts.*pass --eval-prompts"),
    (["--reward-fn", "rewards.py:score", "--lora-r", "4", "--lora-dropout", "0.1"],
     "--lora-dropout must be 0 for ppo"),
    (["--reward-model", "MISSING_MODEL"], "does not exist|not a tether reward model"),
    (["--reward-model", "POLICY"], "is not a reward model: it has no tether_reward.json .* "
     "GPT2LMHeadModel, not a sequence-classification model"),
    (["--reward-model", "not_a_model"], "cannot read the reward model's config"),
    (["--reward-model", "two_labels"], "with 2 labels; a reward model gives one score"),
    (["--reward-model", "lm_adapter"], "peft adapter of task CAUSAL_LM, not a reward model"),
    (["--reward-fn", "rewards.py:score", "--ref-model", "MISSING_MODEL"], "does not exist"),
    (["--reward-fn", "rewards.py:score", "--critic", "twin"], "critic"),
    (["--reward-fn", "rewards.py:score", "--advantage", "vtrace"], "'advantage' must be one of"),
    (["--reward-fn", "rewards.py:score", "--advantage", "grpo", "--scale-rewards", "max"],
     "'scale_rewards' must be one of"),
    (["--reward-fn", "rewards.py:score", "--whiten-advantages", "yes"],
     "'whiten_advantages' must be one of: auto, on, off"),
    (["--reward-fn", "rewards.py:score", "--samples-per-prompt", "0"], "--samples-per-prompt 0"),
    (["--reward-fn", "rewards.py:score", "--kl-estimator", "exact"], "exact is a loss term"),
    (["--reward-fn", "rewards.py:score", "--report-to", "comet"], "'comet' is not a tracker"),
    (["--reward-fn", "rewards.py:score", "--clip-high", "-0.1"], "'clip_high' must be >= 0"),
    (["--reward-fn", "rewards.py:score", "--importance-level", "prompt"],
     "'importance_level' must be one of"),
    (["--reward-fn", "rewards.py:score", "--policy-loss", "sapo"], "'policy_loss' must be one of"),
    (["--reward-fn", "rewards.py:score", "--overlong-penalty", "32"],
     "--overlong-penalty 32 must lie in .0, --max-new-tokens 32."),
    (["--reward-fn", "rewards.py:score", "--loss-aggregation", "mean"],
     "'loss_aggregation' must be one of: auto, token, sequence, sum"),
    (["--reward-fn", "rewards.py:score", "--dynamic-sampling", "-1"],
     "--dynamic-sampling -1 must be >= 0"),
    (["--reward-fn", "rewards.py:score", "--dynamic-sampling", "2"],
     "a group of one always does: pass --samples-per-prompt 2"),
    (["--reward-fn", "rewards.py:score", "--engine", "sglang"], "'engine' must be one of"),
    (["--reward-fn", "rewards.py:score", "--engine", "vllm", "--engine-kv-cache-mb", "0"],
     "'engine_kv_cache_mb' must be > 0"),
    (["--reward-fn", "rewards.py:score", "--engine", "vllm", "--engine-is-cap", "0.5"],
     "--engine-is-cap 0.5 must be 0 .off. or >= 1"),
    (["--reward-fn", "rewards.py:score", "--engine", "vllm", "--engine-mask-kl", "-1"],
     "'engine_mask_kl' must be >= 0"),
    (["--reward-fn", "rewards.py:score", "--engine-is-cap", "2"],
     "--engine-is-cap applies with --engine vllm or --max-staleness above 0, and tether ppo runs "
     "with --engine native"),
]

DEMO = [
    (["--device", "tpu"], "'device' must be one of"),
    (["--run-name", ".."], "'run_name' must be a plain non-empty name"),
    (["--kl-target", "nan"], "'kl_target' must be a finite number"),
    (["--seeds", "0"], "'seeds' must be > 0"),
    (["--ppo-lr", "-1"], "'ppo_lr' must be > 0"),
    (["--sweep-betas", "0.1", "-0.5"], "'sweep_betas' must hold betas >= 0"),
    (["--sweep-batches", "0"], "'sweep_batches' must be > 0"),
]


def _resolve(base, model_dir, value):
    if value == "MISSING_MODEL":
        return str(base / "missing_model")
    if value == "POLICY":
        return str(model_dir)
    if value.endswith((".jsonl", ".txt", ".yaml", ".py")) or value in ("not_a_model", "two_labels", "lm_adapter"):
        return str(base / value)
    if value.endswith(".py:score") or value.endswith(".py:nothing"):
        return str(base / value)
    return value


@pytest.mark.parametrize("stage, data, extra, pattern", OFFLINE,
                         ids=[f"{c[0]}-{' '.join(c[2]) or c[1]}" for c in OFFLINE])
def test_offline_stage_bad_input(stage, data, extra, pattern, root, tiny_model_dir, capsys):
    argv = [stage, "--model", str(tiny_model_dir), "--data", str(root / data), "--run-name", "b",
            "--output-dir", str(root / "runs"), "--device", "cpu"]
    if "--run-name" in extra or "--resume" in extra:  # target the finished run, or replace
        argv = argv[:-6] + ["--output-dir", str(root / "runs"), "--device", "cpu"]
        if "--resume" in extra:
            argv += ["--run-name", "partial"]
    argv += [_resolve(root, tiny_model_dir, v) for v in extra]
    refused(root, argv, pattern, capsys)


@pytest.mark.parametrize("extra, pattern", PPO, ids=[" ".join(c[0]) or "no reward" for c in PPO])
def test_ppo_bad_input(extra, pattern, root, tiny_model_dir, capsys):
    argv = ["ppo", "--policy", str(tiny_model_dir), "--prompts", str(root / PROMPTS),
            "--run-name", "p", "--output-dir", str(root / "runs"), "--device", "cpu",
            *[_resolve(root, tiny_model_dir, v) for v in extra]]
    refused(root, argv, pattern, capsys)


@pytest.mark.parametrize("extra, pattern", DEMO, ids=[" ".join(c[0]) for c in DEMO])
def test_demo_bad_input(extra, pattern, root, capsys):
    refused(root, ["demo", "--output-dir", str(root / "runs"), *extra], pattern, capsys)


def test_there_are_at_least_sixty_cases():
    assert len(OFFLINE) + len(PPO) + len(DEMO) >= 60
