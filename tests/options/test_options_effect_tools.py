"""Every option of `tether generate`, `tether eval`, `tether report` and `tether sweep` takes
effect: each test fails when its option is silently ignored (tests/audit/mutate_options.py makes
one ignored and runs the tests mapped to it in tests/audit/option_tests.py).

The commands run through the command line (`tether.cli.main`), on the tiny GPT-2 and Llama-style
models, a few prompts and a few tokens. What the sampler is handed is recorded by a spy around
`sample_responses` (rows, prompt width, temperature, longest response), and checked against the
outcome where that is cheap: lengths within --max-new-tokens, the same seed giving the same
samples, near-zero temperature sampling the argmax whatever the seed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from pages import fake_run
from test_options_effect import ModelCalls

from tether.cli import main
from tether.errors import TetherError
from tether.rl import evaluation
from tether.rl.engines import native
from tether.tools import evaluate

PROMPTS = ["the movie was", "a film with a long plot and a long story and", "it",
           "the ending was very", "music", "the actor", "loved the story but", "the scene"]
TOOLS = ["generate", "eval"]
FAMILIES = ["tiny_model_dir", "tiny_llama_dir"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 for r in responses]


def e_count(prompts, responses):
    return [float(r.count("e")) for r in responses]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """Copies of the tiny models (eval writes <model>.eval.json beside its model by default; the
    shared fixtures' directories stay clean) and a second GPT-2 of another seed, same tokenizer, for a reference."""
    root = tmp_path_factory.mktemp("tool_models")
    out = {"tiny_model_dir": str(shutil.copytree(tiny_model_dir, root / "gpt2")),
           "tiny_llama_dir": str(shutil.copytree(tiny_llama_dir, root / "llama"))}
    other = shutil.copytree(tiny_model_dir, root / "other")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(other)
    out["other"] = str(other)
    return out


class Sampler:
    """Spy on the native `sample_responses` as generate and eval call it: one dict per call."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        real = native.sample_responses

        def spy(policy, ids, mask, **kwargs):
            out = real(policy, ids, mask, **kwargs)
            self.calls.append({"rows": ids.shape[0], "width": ids.shape[1],
                               "temperature": kwargs["temperature"],
                               "longest": int(out.response_mask.sum(1).max())})
            return out
        # both tools sample with the native engine (tether.rl.engines.make_engine), which calls it
        monkeypatch.setattr(native, "sample_responses", spy)


def run_tool(tool, model, prompts, tmp_path, *extra, name="out") -> list[dict]:
    """Run `tether <tool>` on the command line; its samples: generate's JSONL rows, eval's
    recorded samples (one per prompt), interpolate's of its last point (the line from the model
    to itself, each point evaluated); bon's curve (a pool of 2)."""
    out = tmp_path / f"{name}.{'jsonl' if tool == 'generate' else 'json'}"
    target = {"interpolate": ["--from", model, "--to", model, "--points", "0,1", "--output-dir",
                              str(tmp_path / name)],
              "bon": ["--model", model, "--n", "2", "--output", str(out),
                      "--reward-fn", f"{__file__}:length_reward"]}
    argv = [tool, *target.get(tool, ["--model", model, "--output", str(out)]), "--prompts",
            prompts, "--device", "cpu", "--max-new-tokens", "6", *extra]
    assert main(argv) == 0
    if tool == "generate":
        return [json.loads(line) for line in out.read_text().splitlines()]
    if tool == "interpolate":
        return json.loads((tmp_path / name / "eta1.eval.json").read_text())["samples"]
    return json.loads(out.read_text()) if tool == "bon" else json.loads(out.read_text())["samples"]


def responses(rows):
    return [r["response"] for r in rows]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool", TOOLS)
def test_sampling_settings_reach_the_sampler(tool, family, models, prompts, tmp_path, monkeypatch):
    sampler = Sampler(monkeypatch)
    rows = run_tool(tool, models[family], prompts, tmp_path, "--batch-size", "3",
                    "--max-prompt-len", "4", "--temperature", "0.7", "--max-new-tokens", "3")
    # 8 prompts in chunks of 3: 3, 3, 2 rows; prompts cut to 4 tokens (the long one is longer)
    assert [c["rows"] for c in sampler.calls] == [3, 3, 2]
    assert max(c["width"] for c in sampler.calls) == 4
    assert {c["temperature"] for c in sampler.calls} == {0.7}
    assert max(c["longest"] for c in sampler.calls) == 3  # a random model rarely stops in 3
    assert [r["prompt"] for r in rows] == PROMPTS
    if tool == "generate":
        assert all(1 <= r["length"] <= 3 for r in rows) and any(r["length"] == 3 for r in rows)


@pytest.mark.parametrize("tool", TOOLS)
def test_seed_reproduces_and_a_cold_temperature_samples_the_argmax(tool, models, prompts, tmp_path):
    model = models["tiny_model_dir"]
    first = responses(run_tool(tool, model, prompts, tmp_path, "--seed", "5", name="a"))
    again = responses(run_tool(tool, model, prompts, tmp_path, "--seed", "5", name="b"))
    other = responses(run_tool(tool, model, prompts, tmp_path, name="c"))  # the default seed 0
    assert first == again and first != other
    # At T = 1e-4 the softmax puts all its mass on the argmax: the seed no longer matters
    # (the tiny random model's logit gaps are far above 1e-4 * log(vocab)).
    cold = [responses(run_tool(tool, model, prompts, tmp_path, "--temperature", "1e-4",
                               "--seed", str(s), name=f"cold{s}")) for s in (0, 5)]
    assert cold[0] == cold[1] and cold[0] != other


def greedy(model_dir, prompt_ids, steps, eos):
    """Argmax decoding by hand, one prompt at a time (no padding): the independent truth for
    a near-zero temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = list(ids)
            for _ in range(steps):
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                seq.append(nxt)
                if nxt in eos:
                    break
            out.append(len(seq) - len(ids))
    return out


def test_cold_generate_lengths_equal_greedy_decoding_by_hand(models, prompts, tmp_path):
    from tether.models.pretrained import load_tokenizer
    from tether.tools.config import GenerateConfig

    model = models["tiny_model_dir"]
    rows = run_tool("generate", model, prompts, tmp_path, "--temperature", "1e-4")
    tokenizer = load_tokenizer(model)
    cfg = GenerateConfig(model=model, prompts=prompts, max_new_tokens=6)
    inputs = evaluation.eval_inputs(tokenizer, prompts, [tokenizer.eos_token_id], cfg)
    assert [r["length"] for r in rows] == greedy(model, inputs.prompt_ids, 6,
                                                  {tokenizer.eos_token_id})


@pytest.mark.parametrize("tool", [*TOOLS, "bon", "interpolate"])
def test_device_dtype_and_trust_remote_code_reach_the_loaders(tool, models, prompts, tmp_path,
                                                              monkeypatch):
    from transformers import AutoTokenizer

    model = models["tiny_llama_dir"]
    if not torch.cuda.is_available():  # the device is used: cuda is refused on a machine without it
        with pytest.raises(AssertionError):
            run_tool(tool, model, prompts, tmp_path, "--device", "cuda", name="x")
        assert not (tmp_path / "x").exists() and not (tmp_path / "x.json").exists()
    seen, dtypes = [], []
    original = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, *args, **kwargs)
    real_load = evaluate.load_frozen_lm

    def load(*args, **kwargs):
        lm = real_load(*args, **kwargs)
        dtypes.append(next(lm.parameters()).dtype)
        return lm
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    monkeypatch.setattr(evaluate, "load_frozen_lm", load)  # generate's policy too (load_policy)
    run_tool(tool, model, prompts, tmp_path, "--trust-remote-code", "--dtype", "bfloat16")
    assert seen and all(seen)
    assert dtypes and set(dtypes) == {torch.bfloat16}


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_writes_k_samples_per_prompt_and_cuts_at_stop_strings(family, models, prompts,
                                                                      tmp_path, capsys):
    model = models[family]
    rows = run_tool("generate", model, prompts, tmp_path, "--samples-per-prompt", "3")
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, k) for p in PROMPTS for k in range(3)]
    # --output: the file above; without it the same lines go to stdout
    capsys.readouterr()
    assert main(["generate", "--model", model, "--prompts", prompts, "--device", "cpu",
                 "--max-new-tokens", "6", "--samples-per-prompt", "3"]) == 0
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == rows
    # A stop string cuts each response at the first token that completes it (same draws: the
    # cut response is a prefix of the uncut one, and holds the stop string).
    stop = "e"
    cut = run_tool("generate", model, prompts, tmp_path, "--samples-per-prompt", "3",
                   "--stop-strings", stop, name="cut")
    shortened = 0
    for full, short in zip(rows, cut, strict=True):
        if stop in full["response"]:
            assert full["response"].startswith(short["response"]) and stop in short["response"]
            assert short["ended"] and short["length"] <= full["length"]
            shortened += short["length"] < full["length"]
        else:
            assert short == full
    assert shortened > 0


def test_eval_reference_rewards_output_and_chunking(models, prompts, tmp_path):
    from tether.models.pretrained import load_tokenizer
    from tether.models.reward_model import RewardModel

    model = models["tiny_model_dir"]
    rm = tmp_path / "rm"
    RewardModel.from_causal_lm(model, load_tokenizer(model)).save_pretrained(rm, load_tokenizer(model))
    base = ["eval", "--model", model, "--prompts", prompts, "--device", "cpu",
            "--max-new-tokens", "6"]
    # No --output: <model>.eval.json beside the model (no config.yaml there: the reference is
    # the model)
    assert main(base) == 0
    default = json.loads(Path(f"{model}.eval.json").read_text())
    assert default["reference"] == model and default["metrics"]["eval/kl_exact"] == 0.0
    out = tmp_path / "e.json"
    with ModelCalls() as chunked:
        assert main([*base, "--output", str(out), "--reference", models["other"],
                     "--reward-fn", f"{__file__}:length_reward",
                     "--gold-fn", f"{__file__}:e_count"]) == 0
    record = json.loads(out.read_text())
    metrics, texts = record["metrics"], responses(record["samples"])
    assert record["reference"] == models["other"] and metrics["eval/kl_exact"] > 0
    assert texts == responses(default["samples"])  # same policy, same seed: same samples
    assert metrics["eval/score"] == pytest.approx(sum(length_reward(PROMPTS, texts)) / 8)
    assert metrics["eval/gold_score"] == pytest.approx(sum(e_count(PROMPTS, texts)) / 8)
    assert chunked.full_logits == 0
    # --no-chunked-lm-head: full [N, T, V] logits, the same numbers within rounding
    with ModelCalls() as plain:
        assert main([*base, "--output", str(out), "--reference", models["other"],
                     "--no-chunked-lm-head"]) == 0
    assert plain.full_logits > 0
    assert json.loads(out.read_text())["metrics"]["eval/kl_exact"] == pytest.approx(
        metrics["eval/kl_exact"], rel=1e-4)
    # --reward-model: a proxy score for every sample (none without a proxy, as above in
    # `default`), averaged into eval/score
    assert all(s["score"] is None for s in default["samples"])
    assert "eval/score" not in default["metrics"]
    assert main([*base, "--output", str(out), "--reward-model", str(rm)]) == 0
    record = json.loads(out.read_text())
    scores = [s["score"] for s in record["samples"]]
    assert all(isinstance(x, float) for x in scores) and len(set(scores)) > 1
    # eval's mean is a float32 sum: its rounding is relative to the scores, not to their mean,
    # which cancels towards 0 (the head starts random, from whatever RNG state the tests before
    # left: -0.0051 from scores near +-0.1 failed rel=1e-6 in one xdist order)
    scale = max(abs(x) for x in scores)
    assert record["metrics"]["eval/score"] == pytest.approx(sum(scores) / len(scores),
                                                            abs=1e-6 * scale)


def test_report_runs_output_and_title(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an ignored --output writes the default report.html here
    a = fake_run(tmp_path, "alpha", {"lr": 1e-3}, [{"step": s, "train/loss": 1.0 / s} for s in (1, 2)])
    b = fake_run(tmp_path, "beta", {"lr": 2e-3}, [{"step": s, "train/loss": 2.0 / s} for s in (1, 2)])
    out = tmp_path / "pages" / "mine.html"
    assert main(["report", str(a), str(b), "--output", str(out), "--title", "Two runs <today>"]) == 0
    text = out.read_text()
    assert "<title>Two runs &lt;today&gt;</title>" in text and "<h1>Two runs &lt;today&gt;</h1>" in text
    assert "Runs: alpha, beta." in text and "href='../alpha/config.yaml'" in text


def stand_in_run(run) -> None:
    """A sweep run, replaced (a real PPO run per worker would take seconds): it says where it
    ran, waits long enough for the others to start, and fails."""
    print(f"stand-in for {run.name} in pid {os.getpid()}", flush=True)
    time.sleep(0.6)
    raise TetherError("stand-in run")


def test_sweep_grid_output_dir_and_jobs(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """--jobs N keeps N worker processes running at once. Each run is replaced by a stand-in that
    sleeps and fails (module-level, so that a worker imports it by name): what is observed is the
    sweep's own scheduling: how many workers run, how many runs before any ends, and its logs."""
    import yaml

    from tether.tools import sweep

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "it"}) + "\n")
    spec = {"name": "s", "output_dir": str(tmp_path / "grid_default"), "seeds": [0, 1],
            "ppo": {"policy": str(tiny_model_dir), "prompts": str(tmp_path / "prompts.jsonl"),
                    "eval_prompts": str(tmp_path / "prompts.jsonl"), "gold_fn": f"{__file__}:e_count",
                    "reward_fn": f"{__file__}:length_reward", "batch_size": 1,
                    "total_episodes": 1, "device": "cpu", "beta": [0.0, 0.5]}}
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(sweep, "execute_run", stand_in_run)
    assert main(["sweep", str(grid), "--jobs", "3", "--output-dir", str(tmp_path / "here")]) == 1
    lines = capsys.readouterr().out.splitlines()
    root = tmp_path / "here" / "s"
    assert not (tmp_path / "grid_default").exists()
    # four grid points (two betas, two seeds), each in its own log, run by three workers
    logs = {p.name: p.read_text() for p in (root / "logs").iterdir()}
    assert sorted(logs) == sorted(f"ppo-beta{b}-seed{s}.log" for b in ("0", "0.5") for s in (0, 1))
    pids = {int(text.split(" in pid ")[1]) for text in logs.values()}
    assert len(pids) == 3 and os.getpid() not in pids
    # the first run to end left the other two running and the fourth still to start
    ended = [x for x in lines if " failed in " in x]
    assert len(ended) == 4 and "stand-in run (logs/" in ended[0], lines
    assert "; 2 running, 1 to start; " in ended[0] and any("4 to run, 3 at a time" in x
                                                            for x in lines)


@pytest.mark.parametrize("tool", [*TOOLS, "bon", "interpolate"])
def test_threads_is_used(tool, models, prompts, tmp_path):
    """--threads N sets torch's count; auto (0) gives the tiny model one thread (run/threads.py)."""
    before = torch.get_num_threads()
    try:
        run_tool(tool, models["tiny_model_dir"], prompts, tmp_path, "--threads", "2", name="two")
        assert torch.get_num_threads() == 2
        run_tool(tool, models["tiny_model_dir"], prompts, tmp_path, name="auto")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
