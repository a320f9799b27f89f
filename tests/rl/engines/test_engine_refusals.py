"""Engine settings that cannot work, refused in tether's words (issue 33, cluster 1 and the
engine case of cluster 5): vLLM's start-up errors keep their cause and name tether's options,
never vLLM's knobs; an impossible --engine-kv-cache-mb is refused from the model's config before
the weights load; the user's VLLM_ENABLE_V1_MULTIPROCESSING=1 is overridden with a note; a
native run resumed with --engine vllm is refused before anything loads; vLLM-only options with
--engine native are refused.

Most of these need no vLLM: the checks run before vLLM is imported (the CLI's "is vLLM installed"
preflight is stubbed where a case must reach them). The cases marked `needs_vllm` start or
validate a real engine; they skip without vLLM, and fail instead under TETHER_REQUIRE_VLLM=1 (CI).

The KV arithmetic is checked against vLLM itself (`test_the_cache_size_tether_asks_for_is_the_
least_vllm_starts_with`): a token takes 2 * layers * kv_heads * head_dim * dtype bytes; a
sequence takes whole blocks (128 tokens on vLLM's CPU backend) and vLLM keeps one more block as
its null block.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import transformers
from conftest import sample_texts
from offline_fixtures import sft_rows, write_jsonl
from refusals import refused

from tether.cli import main
from tether.errors import TetherError
from tether.models.tiny import save_tiny, save_tiny_llama
from tether.rl import engines
from tether.rl.engines.vllm_limits import (
    MULTIPROCESSING_VAR,
    check_kv_cache,
    keep_engine_in_process,
    kv_bytes_per_token,
    kv_cache_mb_needed,
    start_failure,
    vllm_cause,
)
from tether.run.parse import parse_config
from tether.run.rundir import RunDir
from tether.train.ppo_config import GRPOConfig

VLLM_KNOBS = ("kv_cache_memory_bytes", "max_model_len", "gpu_memory_utilization",
              "--kv-cache-memory-bytes", "VLLM_CPU_KVCACHE_SPACE")


def needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TETHER_REQUIRE_VLLM"):
            raise RuntimeError("TETHER_REQUIRE_VLLM is set but vllm is not installed: "
                               "pip install -e '.[vllm]'")
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("engine_refusals")
    write_jsonl(base / "prompts.jsonl", [{"prompt": r["prompt"]} for r in sft_rows(4)])
    (base / "rewards.py").write_text("def score(prompts, responses):\n"
                                     "    return [0.0] * len(responses)\n", encoding="utf-8")
    (base / "runs").mkdir()
    return base


@pytest.fixture(scope="module")
def gpt2_wide(tmp_path_factory):
    """GPT-2, 4 layers of 8 heads of 32: 2 * 4 * 8 * 32 * 4 = 8 KiB a token in fp32, so 1 MiB
    is one 128-token block (vLLM's null block) and no room for a sequence."""
    return save_tiny(tmp_path_factory.mktemp("gpt2_wide"), sample_texts(), vocab_size=300,
                     n_layer=4, n_embd=256, n_head=8, n_positions=1024)


@pytest.fixture(scope="module")
def llama_wide(tmp_path_factory):
    """Llama-style, 8 layers, 2 KV heads of 32 (8 query heads): 2 * 8 * 2 * 32 * 4 = 4 KiB a
    token, a 128-token block is 0.5 MiB."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama_wide"), sample_texts(), vocab_size=300,
                           hidden_size=256, n_head=8, n_kv_head=2, n_layer=8, max_positions=1024)


@pytest.fixture
def no_engine(monkeypatch, no_loads):
    """vLLM counts as installed for the CLI's preflight, and any model load (`no_loads`) or
    engine start fails the test: the refusals below come before both."""
    import tether.cli

    def no_start(*args, **kwargs):
        raise AssertionError("an engine started before the bad input was found")
    monkeypatch.setattr(tether.cli, "require_engine", lambda engine: None)
    for name, engine in engines.ENGINES.items():
        monkeypatch.setitem(engines.ENGINES, name, replace(engine, start=no_start,
                                                           generator=no_start))
    return no_loads


def grpo_argv(policy, root, *more: str) -> list[str]:
    return ["grpo", "--policy", str(policy), "--prompts", str(root / "prompts.jsonl"),
            "--reward-fn", f"{root / 'rewards.py'}:score", "--output-dir", str(root / "runs"),
            "--run-name", "r", "--device", "cpu", *more]


def sampling_argv(stage, model, root, *more: str) -> list[str]:
    out = ["--output", str(root / "runs" / ("e.json" if stage == "eval" else "g.jsonl"))]
    return [stage, "--model", str(model), "--prompts", str(root / "prompts.jsonl"), *out,
            "--device", "cpu", *more]


# ---- the KV arithmetic, by hand

def test_kv_bytes_per_token_from_the_config(gpt2_wide, llama_wide):
    gpt2 = transformers.AutoConfig.from_pretrained(gpt2_wide)
    llama = transformers.AutoConfig.from_pretrained(llama_wide)
    assert kv_bytes_per_token(gpt2, "float32") == 2 * 4 * 8 * 32 * 4 == 8192
    assert kv_bytes_per_token(gpt2, "bfloat16") == 4096
    # grouped-query attention: the 2 KV heads count, not the 8 query heads
    assert kv_bytes_per_token(llama, "float32") == 2 * 8 * 2 * 32 * 4 == 4096
    # 200 tokens: 2 blocks of 128 plus the null block, 3 * 128 * 8 KiB = 3 MiB
    assert kv_cache_mb_needed(gpt2, "float32", 200, "cpu") == 3
    assert kv_cache_mb_needed(gpt2, "float32", 256, "cpu") == 3
    assert kv_cache_mb_needed(gpt2, "float32", 257, "cpu") == 4
    # 201 tokens of the Llama: 3 blocks of 0.5 MiB
    assert kv_cache_mb_needed(llama, "float32", 201, "cpu") == 2
    check_kv_cache(3, gpt2, "float32", 200, "cpu", free_mb=1 << 20)  # the neighbour that fits
    with pytest.raises(TetherError, match="--engine-kv-cache-mb 2 holds less than one sequence "
                                          "of 200 tokens .* pass --engine-kv-cache-mb 3 or more"):
        check_kv_cache(2, gpt2, "float32", 200, "cpu", free_mb=1 << 20)
    with pytest.raises(TetherError, match="--engine-kv-cache-mb 5000 is more than the 4000 MiB "
                                          "of memory free here; .*at least 3"):
        check_kv_cache(5000, gpt2, "float32", 200, "cpu", free_mb=4000)


# ---- case 1 and 3: vLLM's start-up errors in tether's words

def _validation_error(message: str):
    """A pydantic ValidationError from a validator that refuses, as vLLM's ModelConfig does."""
    import pydantic

    class ModelConfig(pydantic.BaseModel):
        tokenizer_mode: str = "auto"

        @pydantic.field_validator("tokenizer_mode")
        @classmethod
        def refuse(cls, value):
            raise ValueError(message)
    try:
        ModelConfig(tokenizer_mode="x")
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("no ValidationError")


def test_an_unknown_validation_error_keeps_its_field_and_message_not_its_header():
    pytest.importorskip("pydantic")
    exc = _validation_error("tokenizer_mode 'x' is not one of auto, slow")
    assert "1 validation error for ModelConfig" in str(exc)  # what the old line showed, alone
    assert vllm_cause(exc) == "tokenizer_mode: tokenizer_mode 'x' is not one of auto, slow"
    line = start_failure(exc, "GPT2LMHeadModel", 512, 64, 2)
    assert "1 validation error" not in line and "tokenizer_mode 'x' is not one of" in line
    assert line.startswith("vLLM could not start GPT2LMHeadModel (tokenizer_mode: ")
    assert "\n" not in line


# vLLM 0.32's own texts (the real exceptions are checked in the needs_vllm tests below)
TOO_LONG = ("1 validation error for ModelConfig\n  Value error, User-specified max_model_len "
            "(300) is greater than the derived max_model_len (max_position_embeddings=256.0 or "
            "model_max_length=None in model's config.json). To allow overriding this maximum, "
            "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
NO_BLOCKS = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
             "when initializing the engine")
SHORT = ("To serve at least one request with the model's max seq len (200), (0.0 GiB KV cache "
         "is needed, which is larger than the available KV cache memory (0.0 GiB).")
NO_RAM = ("Available memory on node 0 (10.25/10.84 GiB) on kv cache allocation is less than "
          "requested memory for kv (9765.62 GiB). Decrease --kv-cache-memory-bytes, "
          "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.")


@pytest.mark.parametrize(("text", "pattern"), [
    (TOO_LONG, r"^the longest prompt plus --max-new-tokens is 300 tokens, more than the 256 "
               r"positions of GPT2LMHeadModel; lower --max-new-tokens or --max-prompt-len$"),
    (NO_BLOCKS, r"^--engine-kv-cache-mb 1 holds less than one sequence of 300 tokens .*: pass "
                r"--engine-kv-cache-mb 4 or more"),
    (SHORT, r"^--engine-kv-cache-mb 1 holds less than one sequence of 300 tokens"),
    (NO_RAM, r"^--engine-kv-cache-mb 1 is more than the memory free for it on this device; pass "
             r"a smaller --engine-kv-cache-mb \(at least 4 "),
], ids=["max-new-tokens-past-positions", "no-block", "short-cache", "more-than-free"])
def test_known_causes_name_tethers_options_and_the_fix(text, pattern):
    import re

    line = start_failure(ValueError(text), "GPT2LMHeadModel", 1, 300, 4)
    assert re.search(pattern, line), line
    assert not any(knob in line for knob in VLLM_KNOBS), line
    assert "--engine native" not in line  # a supported model with a wrong setting


# ---- case 2: an impossible --engine-kv-cache-mb, refused before the weights load

@pytest.mark.parametrize("stage", ["grpo", "generate", "eval"])
@pytest.mark.parametrize(("model", "new_tokens", "needed"), [
    ("gpt2_wide", "16", 2),  # a few prompt tokens + 16 <= 128: 1 block + the null block, 2 MiB
    ("llama_wide", "200", 2),  # 201+ tokens: 2 blocks + the null block of 0.5 MiB, 1.5 -> 2 MiB
])
def test_a_cache_too_small_for_one_sequence_is_refused_before_the_weights_load(
        stage, model, new_tokens, needed, root, no_engine, capsys, request):
    path = request.getfixturevalue(model)
    more = ("--engine", "vllm", "--engine-kv-cache-mb", "1", "--max-new-tokens", new_tokens)
    argv = grpo_argv(path, root, *more) if stage == "grpo" else sampling_argv(stage, path, root,
                                                                              *more)
    line = refused(root, argv, rf"--engine-kv-cache-mb 1 holds less than one sequence of \d+ "
                               rf"tokens .*pass --engine-kv-cache-mb {needed} or more", capsys)
    assert not any(knob in line for knob in VLLM_KNOBS), line
    assert no_engine == []


def test_a_cache_larger_than_the_machine_is_refused_before_the_weights_load(gpt2_wide, root,
                                                                            no_engine, capsys):
    argv = sampling_argv("generate", gpt2_wide, root, "--engine", "vllm",
                         "--engine-kv-cache-mb", str(1 << 39))  # 512 PiB, in range
    refused(root, argv, rf"--engine-kv-cache-mb {1 << 39} is more than the \d+ MiB of memory "
                        r"free here; pass a smaller --engine-kv-cache-mb \(at least 2 ", capsys)


@pytest.mark.parametrize("stage", ["grpo", "eval"])
def test_a_head_size_vllm_has_no_cpu_kernel_for_is_refused_before_the_weights_load(
        stage, tiny_llama_dir, root, no_engine, capsys):
    # the suite's tiny Llama: hidden 64 over 4 heads, head size 16. vLLM cannot run it on CPU:
    # here --engine native is the right advice.
    more = ("--engine", "vllm")
    argv = grpo_argv(tiny_llama_dir, root, *more) if stage == "grpo" else sampling_argv(
        stage, tiny_llama_dir, root, *more)
    refused(root, argv, r"vLLM's CPU attention has no kernel for head size 16 \(LlamaForCausalLM\)"
                        r".* Use --engine native for this model", capsys)


# ---- case 4: VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment

def test_the_multiprocess_engine_is_overridden_with_a_note(monkeypatch):
    monkeypatch.setenv(MULTIPROCESSING_VAR, "1")
    note = keep_engine_in_process()
    assert note is not None and note.startswith(f"{MULTIPROCESSING_VAR}=1 is ignored")
    assert os.environ[MULTIPROCESSING_VAR] == "0"
    assert keep_engine_in_process() is None  # said once: it is 0 now
    monkeypatch.delenv(MULTIPROCESSING_VAR)
    assert keep_engine_in_process() is None and os.environ[MULTIPROCESSING_VAR] == "0"


# ---- case 5: a native run resumed with --engine vllm

def test_a_native_run_resumed_with_vllm_is_refused_before_anything_loads(tiny_model_dir, root,
                                                                          no_engine, capsys):
    argv = grpo_argv(tiny_model_dir, root)
    run = RunDir(root / "runs", "r")
    run.save_config(parse_config(GRPOConfig, argv[1:], prog="tether grpo"))
    run.release()
    try:
        refused(root, [*argv, "--resume", "--engine", "vllm"],
                r"--resume with a different config would mix two runs \(engine: 'native' -> "
                r"'vllm'\)", capsys)
        # the neighbour: the same engine passes the same check
        RunDir(root / "runs", "r", resume=True).check_resume(
            parse_config(GRPOConfig, [*argv[1:], "--resume"], prog="tether grpo"))
    finally:
        import shutil

        shutil.rmtree(root / "runs" / "r")


def test_a_run_that_fails_after_its_last_batch_still_closes_its_engine(tiny_model_dir, root,
                                                                       monkeypatch, capsys):
    # An engine left open is stopped by vLLM's exit hook, after the CLI has torn the process
    # group down: a 16-line traceback under the error line. Every way out of the run closes it,
    # the final evaluation's failure too (here a gold function that raises).
    from tether.rl.engines.native import NativeEngine

    closed = []
    monkeypatch.setattr(NativeEngine, "close", lambda self: closed.append(self))
    (root / "gold.py").write_text("def gold(prompts, responses):\n    raise ValueError('boom')\n",
                                  encoding="utf-8")
    argv = [*grpo_argv(tiny_model_dir, root, "--run-name", "failed"), "--eval-prompts",
            str(root / "prompts.jsonl"), "--gold-fn", f"{root / 'gold.py'}:gold",
            "--batch-size", "4", "--samples-per-prompt", "2", "--total-episodes", "4",
            "--max-new-tokens", "4"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        line for line in err.splitlines() if "boom" in line], err
    assert "Traceback" not in err and len(closed) >= 1


# ---- case 6: vLLM-only options with --engine native

@pytest.mark.parametrize(("stage", "flag", "value"), [
    ("grpo", "--engine-kv-cache-mb", "1024"), ("generate", "--engine-kv-cache-mb", "1024"),
    ("eval", "--engine-kv-cache-mb", "64"), ("grpo", "--engine-is-cap", "2.0"),
    ("grpo", "--engine-mask-kl", "0.5"),
])
def test_vllm_only_options_with_the_native_engine_are_refused(stage, flag, value, tiny_model_dir,
                                                              root, no_engine, capsys):
    more = (flag, value)
    argv = grpo_argv(tiny_model_dir, root, *more) if stage == "grpo" else sampling_argv(
        stage, tiny_model_dir, root, *more)
    # one line of the one scope mechanism (tether.run.scopes), the engines' facts from their
    # table: the option, where it acts, what this run has instead
    command = "eval" if stage == "eval" else stage
    line = refused(root, argv, rf"^error: {flag} applies with --engine vllm.*, and tether "
                               rf"{command} runs with --engine native.*, where it has no effect; "
                               rf"drop it, or pass --engine vllm", capsys)
    assert no_engine == []
    # the neighbours: the same value with --engine vllm, and the default with native, validate
    cls = GRPOConfig if stage == "grpo" else None
    if cls is not None:
        parse_config(cls, [*argv[1:], "--engine", "vllm"], prog="tether grpo").validate()
        parse_config(cls, grpo_argv(tiny_model_dir, root)[1:], prog="tether grpo").validate()
    assert "Traceback" not in line


# ---- with vLLM: the real errors, translated

def test_max_new_tokens_past_the_positions_is_said_in_tethers_words(tiny_model_dir, root, capsys,
                                                                   monkeypatch, tmp_path):
    needs_vllm()
    warm = tmp_path / "inductor" / "fxgraph"  # no cold-start note: the one line is the error
    warm.mkdir(parents=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(warm.parent))
    # 300 new tokens on a 256-position GPT-2. vLLM refuses it while validating its settings
    # (no engine starts); a check of the lengths before the weights load, where there is one,
    # says it first in its own words, which name --max-new-tokens too.
    argv = sampling_argv("generate", tiny_model_dir, root, "--engine", "vllm",
                         "--max-new-tokens", "300")
    line = refused(root, argv, r"--max-new-tokens", capsys)
    assert not any(knob in line for knob in VLLM_KNOBS), line
    assert "--engine native" not in line and "validation error" not in line


@pytest.mark.slow
def test_the_cache_size_tether_asks_for_is_the_least_vllm_starts_with(gpt2_wide, monkeypatch):
    """tether's arithmetic against vLLM's own: with tether's check off, vLLM refuses one MiB
    less than tether asks for (and says so through tether's line) and starts with it."""
    needs_vllm()
    import torch

    from tether.models.prepare import load_frozen_lm
    from tether.models.pretrained import load_tokenizer
    from tether.rl.engines import vllm_engine
    from tether.run.distributed import current

    tokenizer = load_tokenizer(str(gpt2_wide))
    model = load_frozen_lm(str(gpt2_wide), tokenizer, "float32", False, torch.device("cpu"))
    monkeypatch.setattr(vllm_engine, "check_kv_cache", lambda *args, **kwargs: None)
    needed = kv_cache_mb_needed(model.config, "float32", 200, "cpu")
    assert needed == 3
    with pytest.raises(TetherError) as refusal:
        vllm_engine.VLLMEngine(model, None, vllm_engine.EngineOptions(needed - 1, "float32", 200,
                                                                      0),
                               current(), torch.device("cpu"))
    assert str(refusal.value) == ("--engine-kv-cache-mb 2 holds less than one sequence of 200 "
                                  "tokens (the longest prompt plus --max-new-tokens) of "
                                  "GPT2LMHeadModel: pass --engine-kv-cache-mb 3 or more, or lower "
                                  "--max-new-tokens or --max-prompt-len")
    engine = vllm_engine.VLLMEngine(model, None, vllm_engine.EngineOptions(needed, "float32", 200,
                                                                           0),
                                    current(), torch.device("cpu"))
    engine.close()
    with pytest.raises(TetherError, match=r"^--engine-kv-cache-mb \d+ is more than the memory "
                                          r"free for it on this device; .*at least 3"):
        vllm_engine.VLLMEngine(model, None, vllm_engine.EngineOptions(1 << 30, "float32", 200, 0),
                               current(), torch.device("cpu"))


@pytest.mark.slow
def test_a_multiprocess_environment_still_samples_and_syncs(tiny_model_dir, root, monkeypatch,
                                                            capsys):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 used to kill the first weight sync with a traceback; the
    engine now runs in-process anyway, says so in one note, and generate writes its rows."""
    needs_vllm()
    monkeypatch.setenv(MULTIPROCESSING_VAR, "1")
    out = root / "runs" / "mp.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--prompts", str(root / "prompts.jsonl"),
            "--output", str(out), "--device", "cpu", "--engine", "vllm", "--max-new-tokens", "4"]
    try:
        capsys.readouterr()
        assert main(argv) == 0
        err = capsys.readouterr().err
        notes = [line for line in err.splitlines() if MULTIPROCESSING_VAR in line]
        assert notes == [f"note: {MULTIPROCESSING_VAR}=1 is ignored for tether's engine: it runs "
                         "vLLM in this process to pass it the weights in memory "
                         "(docs/engine.md)"], err
        assert "Traceback" not in err
        assert len(out.read_text().splitlines()) == 4
    finally:
        out.unlink(missing_ok=True)
