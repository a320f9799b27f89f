"""The configs of the tools (`tether generate`, `eval`, `report`, `set-base`, `sweep`, `serve-rm`), apart from their code so
that `--help` imports no torch.

The sampling fields (max_prompt_len, max_new_tokens, temperature, batch_size, seed) carry the
names and defaults of PPOConfig's, because the evaluation samples exactly as PPO's held-out
evaluation does (tether.rl.evaluation.eval_inputs): `tether eval` of a PPO run's starting model with
that run's settings gives the numbers its step 0 logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tether.errors import TetherError
from tether.run.config import (
    EnvOptions,
    check_device,
    check_engine_options,
    check_stop_strings,
    check_threads,
    require_positive,
)


@dataclass(kw_only=True)
class SamplingConfig(EnvOptions):
    """Fields shared by generate and eval: the model, the prompts and how responses are sampled."""

    model: str
    """The policy: the final/ directory of any stage (full model or LoRA adapter) or a hub name."""
    base: str = ""
    """--model a LoRA adapter: its base model (default: where the adapter records it; for a base that moved, docs/loading.md)."""
    prompts: str
    """Prompts: rows with `prompt` or `messages` (JSONL, JSON, Parquet, CSV, dataset dir)."""
    max_prompt_len: int = 256
    """Longer prompts lose the start of their content; BOS, role markers and the generation prompt stay."""
    max_new_tokens: int = 32
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (plain ancestral sampling, no top-k or top-p)."""
    batch_size: int = 32
    """Prompts sampled together; part of the seeded stream, so keep it to reproduce a PPO run's evaluation."""
    seed: int = 0
    """Seed of the sampling stream (a PPO run's --seed gives its evaluation's stream)."""
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    threads: int = 0
    """CPU threads per operation; 0 (auto): 1 for a model under 10M parameters on the CPU (more are slower there), else torch's default (one per core, or OMP_NUM_THREADS)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model weights are loaded in."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code (off unless you trust the source)."""
    engine: Literal["native", "vllm"] = "native"
    """Who samples: native (tether's sampler) or vllm (vLLM in this process; pip install -e '.[vllm]'; docs/engine.md)."""
    engine_kv_cache_mb: int = 512
    """vllm: the engine's KV cache in MiB."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a response (kept in it); EOS always ends one."""

    def validate(self) -> None:
        require_positive(self, "max_prompt_len", "max_new_tokens", "temperature", "batch_size",
                         "engine_kv_cache_mb")
        check_threads(self.threads)
        check_device(self.device)
        check_stop_strings(self.stop_strings)
        check_engine_options(self)
        self.check_env()


@dataclass(kw_only=True)
class GenerateConfig(SamplingConfig):
    """Sample responses to prompts and write them as JSONL, with training's encoding and EOS rules."""

    output: str = ""
    """JSONL file to write ({prompt, response, sample, ended, length} per line); empty: stdout."""
    samples_per_prompt: int = 1
    """Responses per prompt, written in consecutive lines."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "samples_per_prompt")


@dataclass(kw_only=True)
class EvalConfig(SamplingConfig):
    """Held-out evaluation of a policy, as PPO and the demo run it: proxy and gold score, KL to
    the reference (k1 and exact), entropy, EOS rate, distinct-2, length."""

    reference: str = ""
    """Reference for the KL (default: the starting model recorded in the run's config.yaml beside --model; else none)."""
    reward_model: str = ""
    """A reward model (`tether rm`'s output, full or LoRA, or a hub/local sequence classifier with one label): the proxy score."""
    reward_url: str = ""
    """The proxy score from a reward model served by `tether serve-rm`: http://HOST:PORT, several joined by commas (docs/rm.md)."""
    reward_url_timeout: float = 300.0
    """Seconds one --reward-url request may take; past it the command ends with one line, exit 2."""
    reward_fn: str = ""
    """A Python proxy reward `module:function` or `file.py:function`, (prompts, responses) -> list[float]."""
    gold_fn: str = ""
    """A Python gold reward `module:function`, scored beside the proxy."""
    reward_fn_timeout: float = 600.0
    """Seconds one call of the --reward-fn or --gold-fn function may take; past it the command ends with one line, exit 2 (0: no limit). With --reward-workers N > 1 it is each call's limit inside the pool: past it the call fails and is retried."""
    reward_workers: int = 0
    """The reward pool: N > 1 scores each response with its own call of the --reward-fn and --gold-fn functions, N calls at a time; a response still without a score after --reward-retries ends the command with one line (0 or 1: one call per batch)."""
    reward_retries: int = 2
    """The reward pool: times a call that raised or passed --reward-fn-timeout is tried again, after 0.1 s, then twice as long each time."""
    output: str = ""
    """JSON file for the metrics, settings and samples (default: beside --model's directory, never inside it: runs/x/final -> runs/x/final.eval.json)."""
    chunked_lm_head: bool = True
    """Log-probs, entropy and exact KL through the LM head in chunks (off: full logits)."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "reward_fn_timeout", allow_zero=True)
        require_positive(self, "reward_url_timeout")


@dataclass(kw_only=True)
class ReportConfig:
    """Run directories of any stage on one HTML page: metric curves side by side, configs diffed."""

    POSITIONAL = "runs"  # `tether report A B` reads as `--runs A B` (not a field: no annotation)
    runs: list[str] = field(default_factory=list)
    """Run directories (given as the command's positional arguments: tether report RUN RUN ...)."""
    output: str = "report.html"
    """The HTML file to write (self-contained: the figures are inline)."""
    title: str = "tether runs"
    """The page's title."""


@dataclass(kw_only=True)
class SetBaseConfig:
    """Re-point a LoRA adapter directory at its base model where it is now (a run directory copied
    to another machine, a base moved): checked against the adapter's record of its base, then
    both files that name it are rewritten (docs/loading.md)."""

    POSITIONAL = "adapter"  # `tether set-base DIR --base PATH` reads as `--adapter DIR`
    adapter: str
    """The adapter directory (a LoRA run's final/), given as the command's first argument."""
    base: str
    """The base model it was trained on, where it is now: a directory or a hub name."""
    trust_remote_code: bool = False
    """Allow the base's repository to run its own Python code while it is loaded for the check."""


@dataclass(kw_only=True)
class SweepConfig:
    """Run a grid of PPO and DPO/IPO runs from one YAML file; write the frontier report."""

    POSITIONAL = "grid"  # `tether sweep grid.yaml` reads as `--grid grid.yaml` (not a field)
    grid: str
    """The grid file (YAML: name, output_dir, seeds, and ppo / dpo / eval blocks; see docs/frontier.md)."""
    jobs: int = 1
    """Runs at once, each in its own process (1: one after another, in this process)."""
    output_dir: str = ""
    """Where the sweep directory goes (default: the grid file's output_dir, else runs)."""

    def validate(self) -> None:
        require_positive(self, "jobs")


@dataclass(kw_only=True)
class ServeRMConfig:
    """Serve a reward model over HTTP for --reward-url: POST /score {"prompts", "responses"} -> {"scores"}, GET /info (docs/rm.md, "Serving a reward model")."""

    POSITIONAL = "model"  # `tether serve-rm DIR` reads as `--model DIR`
    model: str
    """The reward model: `tether rm`'s output (full or LoRA) or a hub/local sequence classifier with one label (given as the command's first argument)."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface; the API has no authentication)."""
    port: int = 8000
    """Port to listen on (0: any free one, named in the ready line)."""
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    threads: int = 0
    """CPU threads per operation; 0 (auto): 1 for a model under 10M parameters on the CPU (more are slower there), else torch's default (one per core, or OMP_NUM_THREADS)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model weights are loaded in (the in-process --reward-model uses the stage's --dtype)."""
    batch_size: int = 16
    """Rows per forward (a request of more rows is scored this many at a time)."""
    trust_remote_code: bool = False
    """Allow the model's repository to run its own Python code (off unless you trust the source)."""

    def validate(self) -> None:
        require_positive(self, "batch_size")
        check_device(self.device)
        check_threads(self.threads)
        if not 0 <= self.port <= 65535:
            raise TetherError(f"--port {self.port} is not a port; give 0 to 65535 (0: any free one)")
