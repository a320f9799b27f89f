"""Typed stage configs: what every stage shares (`RunConfig`), the checks their `validate()`
calls, how a config is recorded (`config_to_dict`; what its paths mean is `tether.run.paths`), and
how its values reach the settings of the code that reads them (`section`).

Every stage config is a dataclass that inherits `RunConfig`; each field has a type, a default and a
docstring, which `--help` shows (`tether.run.config_help`). Reading one from flags and YAML is
`tether.run.parse`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from tether.choices import ENGINES, NUMBER
from tether.errors import TetherError
from tether.run.paths import resolved_paths
from tether.run.scopes import Scope, from_table

C = TypeVar("C")

DTYPES = ("float32", "bfloat16", "float16")
# The API key of `tether serve-rm`, read by the server (unless --api-key) and sent by --reward-url:
# an environment variable, so the secret is neither in a run's config.yaml nor on a command line
RM_API_KEY_ENV = "TETHER_RM_API_KEY"
# What `tether rm --ensemble K` writes beside its members: a directory holding it is an ensemble
ENSEMBLE_JSON = "tether_ensemble.json"


def is_ensemble(path: str) -> bool:
    return bool(path) and (Path(path).expanduser() / ENSEMBLE_JSON).is_file()


def ensemble_members(path: str) -> list[str]:
    """The member directories of the reward-model ensemble at `path` (ENSEMBLE_JSON's names, each
    a directory beside it), [] for a single model."""
    if not is_ensemble(path):
        return []
    listed = Path(path).expanduser() / ENSEMBLE_JSON
    try:
        names = json.loads(listed.read_text(encoding="utf-8"))["members"]
        assert names and all(isinstance(name, str) and name for name in names)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise TetherError(f"{listed} does not list the ensemble's members as {{\"members\": "
                          "[\"member0\", ...]}; write it again, or train the ensemble with tether "
                          "rm --ensemble K") from None
    return [str(listed.parent / name) for name in names]


def parse_aggregate(spec: str) -> tuple[str, float]:
    """--reward-aggregate as (mean | min | uwo, its LAMBDA: 0 but for uwo), or one line."""
    found = re.fullmatch(rf"(mean|min)|uwo:{NUMBER}", spec)
    if found is None or found[2] is not None and float(found[2]) > 1e30:
        raise TetherError(f"--reward-aggregate {spec} is not mean, min or uwo:LAMBDA with LAMBDA "
                          ">= 0 (e.g. uwo:0.5: the members' mean minus 0.5 times their variance)")
    return (found[1], 0.0) if found[1] else ("uwo", float(found[2]))


@dataclass(kw_only=True)
class Section:
    """A group of config fields that owns their help, their checks and their option scopes
    (`EnvOptions`, `SamplingOptions`, ...). A config is the sections it inherits plus its own
    fields; `validate` is cooperative, so a config runs every section's checks, and `SCOPES`
    (field -> `tether.run.scopes.Scope`) merge over its bases."""

    SCOPES: ClassVar[dict[str, Scope]] = {}

    def validate(self) -> None:
        """Check values that the types alone cannot; raise TetherError naming the field."""


@dataclass(kw_only=True)
class DeviceOptions(Section):
    """Where and how a model runs: every stage, `tether eval`, `generate` and `serve-rm`."""

    # ---- model and device
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    threads: int = 0
    """CPU threads per operation; 0 (auto): 1 for a model under 10M parameters on the CPU (more are slower there), else torch's default (one per core, or OMP_NUM_THREADS)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code (off unless you trust the source)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model weights are loaded in."""

    def validate(self) -> None:
        super().validate()
        check_threads(self.threads)
        check_device(self.device)


@dataclass(kw_only=True)
class LMHeadOptions(Section):
    """How log-probs are read off a language model: the stages and `tether eval`."""

    # ---- memory and scale (docs/scaling.md)
    chunked_lm_head: bool = True
    """Compute log-probs, entropy and KL from hidden states through the LM head in chunks, never a [B, R, V] logits tensor (off: the plain path, for comparison)."""


@dataclass(kw_only=True)
class RunConfig(DeviceOptions, LMHeadOptions):
    """Fields every stage shares: where outputs go, seeding, checkpointing, device."""

    # ---- run and logging
    run_name: str
    """Name of the run; everything is written to <output_dir>/<run_name>/."""
    output_dir: str = "runs"
    """Directory that holds run directories."""
    seed: int = 0
    """Seed for Python, NumPy and torch (data order, initialisation, sampling)."""
    resume: bool = False
    """Continue from the last checkpoint in the run directory (model, optimizer, scheduler, RNG, data position)."""
    resume_allow_changes: bool = False
    """On --resume, accept changed logging, checkpoint or device settings (recorded in resumes.jsonl); other changes are refused."""
    log_every: int = 10
    """Optimizer steps between metric log lines (metrics.jsonl and the --report-to trackers)."""
    save_every: int = 100
    """Optimizer steps between checkpoints (0: only the final model)."""
    report_to: str = "auto"
    """Trackers beside metrics.jsonl, comma-separated: tensorboard, wandb, mlflow, or none; auto: tensorboard when installed, else none (each is an extra: pip install -e '.[tensorboard]')."""

    # ---- memory and scale (docs/scaling.md)
    lora_r: int = 0
    """LoRA rank; 0 trains every weight. With LoRA all roles share one frozen base (docs/scaling.md)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) * B A."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (sft only: rm, dpo and ppo keep dropout off)."""
    lora_target_modules: str = "all-linear"
    """Comma-separated names of the linear layers that get adapters; all-linear: every linear layer of the trunk."""
    merge_lora: bool = False
    """Also write the adapter merged into its base as a plain Hugging Face model (<run>/merged/)."""
    fsdp: bool = False
    """Under torchrun: shard parameters, gradients and optimizer state over the ranks with FSDP2 instead of replicating the model with DDP (docs/scaling.md)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~30% more compute)."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """Run forward passes under torch.autocast in bfloat16 (weights and optimizer stay in `dtype`; log-probs, KL and advantages in fp32)."""

    SCOPES: ClassVar[dict[str, Scope]] = {
        "merge_lora": Scope("--lora-r above 0", lambda c: c.lora_r > 0,
                            lambda c: "--lora-r 0, which trains every weight",
                            "pass --lora-r (e.g. 16)")}

    def validate(self) -> None:
        super().validate()
        check_run_name(self.run_name)
        from tether.run.trackers import parse_report_to

        parse_report_to(self.report_to)
        if self.log_every < 1:
            raise TetherError(f"config field 'log_every' must be >= 1, got {self.log_every}")
        require_positive(self, "lora_r", "lora_dropout", allow_zero=True)
        require_positive(self, "lora_alpha")
        if self.lora_dropout >= 1:
            raise TetherError(f"config field 'lora_dropout' must be in [0, 1), got {self.lora_dropout}")
        if self.mixed_precision == "bf16" and self.dtype == "float16":
            raise TetherError("--mixed-precision bf16 would recast float16 weights to bfloat16; "
                              "use --dtype float32 (or bfloat16) with it")
        require_positive(self, "save_every", allow_zero=True)


# Tokens a chat template may write around one observation (role markers, the next turn's
# generation prompt): part of the derived episode budget.
TEMPLATE_ALLOWANCE = 64

EPISODES = Scope("--env or --tools", lambda c: c.episodic, lambda c: "no environment",
                 "pass --env or --tools (docs/agents.md)")


@dataclass(kw_only=True)
class EnvOptions(Section):
    """Episodes with an environment (docs/agents.md): the fields the online stages, `tether
    generate` and `tether eval` share. A config with these also has `max_new_tokens`."""

    # ---- environments and tools (docs/agents.md)
    env: str = ""
    """An environment factory `file.py:make_env` (or `module:make_env`), or an adapter: `reasoning-gym:<dataset>[?size=...]`, `openenv:<server url>` (docs/agents.md). Each prompt row starts an episode of turns, the policy's and the environment's, rewarded by the environment; the row goes to its reset()."""
    tools: list[str] = dataclasses.field(default_factory=list)
    """Typed Python functions the model may call (`file.py:add`): a ready environment whose episode ends when the model answers without a call, that answer scored by --reward-fn (generate writes the episodes unscored)."""
    max_turns: int = 4
    """Most turns of the policy in an episode (--max-new-tokens is per turn)."""
    max_episode_tokens: int = 0
    """Most tokens after an episode's first prompt, turns, observations and template tokens together (0: max_turns * (max_new_tokens + max_observation_tokens + 64))."""
    max_observation_tokens: int = 256
    """An observation's content longer than this keeps its first tokens and a visible marker."""
    env_timeout: float = 60.0
    """Seconds an environment's reset() or step() may take; a call past it stops the run with one line."""
    env_workers: int = 8
    """Environment calls that run at once (each synchronous one in a thread of its own)."""

    SCOPES: ClassVar[dict[str, Scope]] = dict.fromkeys(
        ("max_turns", "max_episode_tokens", "max_observation_tokens", "env_timeout",
         "env_workers"), EPISODES)

    @property
    def episodic(self) -> bool:  # derived: the rows are environments' episodes
        return bool(self.env or self.tools)

    @property
    def resolved_max_episode_tokens(self) -> int:  # derived: 0 -> every turn and observation
        return self.max_episode_tokens or self.max_turns * (
            self.max_new_tokens + self.max_observation_tokens + TEMPLATE_ALLOWANCE)

    def validate(self) -> None:
        super().validate()
        if self.env and self.tools:
            raise TetherError("give --env or --tools, not both: --tools is an environment of its "
                              "own (docs/agents.md)")
        require_positive(self, "max_turns", "max_observation_tokens", "env_timeout",
                         "env_workers")
        require_positive(self, "max_episode_tokens", allow_zero=True)
        if self.max_episode_tokens and self.max_episode_tokens < self.max_new_tokens:
            raise TetherError(f"--max-episode-tokens {self.max_episode_tokens} is less than one "
                              f"turn of --max-new-tokens {self.max_new_tokens}; raise it, or 0 "
                              "for every turn and observation")


@dataclass(kw_only=True)
class SamplingOptions(Section):
    """How responses are sampled: the online stages, their held-out evaluation, `tether eval` and
    `tether generate` alike (tether.rl.evaluation.eval_inputs), so an evaluation samples what
    training's would."""

    # ---- prompts and rollout
    max_prompt_len: int = 256
    """Longer prompts lose the start of their content; BOS, role markers and the generation prompt stay."""
    max_new_tokens: int = 32
    """Longest response (with an environment: turn), in tokens; one cut there has not ended (no EOS or stop string)."""
    temperature: float = 1.0
    """Sampling temperature, plain ancestral sampling (no top-k or top-p); every log-prob (policy, old policy, reference) uses it too."""
    stop_strings: list[str] = dataclasses.field(default_factory=list)
    """Strings that end a response (kept in it); EOS always ends one."""

    # ---- rollout engine (docs/engine.md)
    engine: Literal[tuple(ENGINES)] = "native"
    """Who samples (tether.choices.ENGINES; docs/engine.md): native (tether's KV-cached sampler on the trainer's model) or vllm (vLLM in this process, fed the weights in memory before each rollout; pip install -e '.[vllm]')."""
    engine_kv_cache_mb: int = 512
    """vllm: the engine's KV cache in MiB (vLLM would otherwise take 90% of the device's memory)."""

    SCOPES: ClassVar[dict[str, Scope]] = from_table("engine", ENGINES)

    def validate(self) -> None:
        super().validate()
        require_positive(self, "max_prompt_len", "max_new_tokens", "temperature",
                         "engine_kv_cache_mb")
        check_stop_strings(self.stop_strings)


@dataclass(kw_only=True)
class RewardOptions(Section):
    """Where scores come from: the online stages and `tether eval` (tether.rl.reward)."""

    # ---- models and reward
    reward_model: str = ""
    """A reward model: `tether rm`'s output (full or LoRA) or a hub/local sequence classifier with one label (give this, --reward-url or --reward-fn)."""
    reward_url: str = ""
    """A reward model served by `tether serve-rm`: http://HOST:PORT, several joined by commas, each batch split over them (give this, --reward-model or --reward-fn; docs/rm.md); a server's API key goes in $TETHER_RM_API_KEY."""
    reward_url_timeout: float = 300.0
    """Seconds one --reward-url request may take; past it the command ends with one line, exit 2, its checkpoints intact."""
    reward_fn: str = ""
    """Python reward functions `file.py:function` (or `module:function`), several joined by commas: (prompts, responses) -> list[float], or TRL's (prompts, completions, completion_ids, **kwargs) with the prompt file's other columns as keywords (docs/ppo.md)."""
    gold_fn: str = ""
    """A gold reward function `file.py:function` (or `module:function`), scored beside the proxy on held-out prompts only (--eval-prompts; tether eval: --prompts), never trained on."""
    reward_fn_timeout: float = 600.0
    """Seconds one call of a --reward-fn or --gold-fn function may take; past it the command ends with one line, exit 2, its checkpoints intact (0: no limit). With --reward-workers N > 1 it is each call's limit inside the pool: past it the call fails and is retried."""
    reward_workers: int = 0
    """The reward pool: N > 1 scores each response with its own call of the --reward-fn and --gold-fn functions, N calls at a time (threads, or one event loop for async def functions); a response whose score fails after --reward-retries is counted (reward_pool/failed) and in training its group dropped and drawn again, in tether eval the command ends with one line (0 or 1: one call per batch; docs/ppo.md)."""
    reward_retries: int = 2
    """The reward pool: times a call that raised or passed --reward-fn-timeout is tried again, after 0.1 s, then twice as long each time (a NaN or out-of-range score is not retried)."""
    reward_aggregate: str = "mean"
    """How an ensemble of reward models (`tether rm --ensemble K`'s final/) makes one score: mean, min (the worst member's) or uwo:LAMBDA (the members' mean minus LAMBDA times their variance; docs/rm.md, "Ensembles")."""

    SCOPES: ClassVar[dict[str, Scope]] = {
        "reward_url_timeout": Scope("--reward-url", lambda c: bool(c.reward_url),
                                    lambda c: "no --reward-url", "pass --reward-url (a "
                                    "--reward-fn function's calls have --reward-fn-timeout)"),
        "reward_aggregate": Scope("--reward-model ENSEMBLE", lambda c: is_ensemble(c.reward_model),
                                  lambda c: f"--reward-model {c.reward_model}, one model"
                                  if c.reward_model else "no --reward-model", "pass an ensemble "
                                  "(tether rm --ensemble K's final/) to --reward-model")}

    def validate(self) -> None:
        super().validate()
        require_positive(self, "reward_url_timeout")
        require_positive(self, "reward_fn_timeout", allow_zero=True)
        parse_aggregate(self.reward_aggregate)


def check_run_name(name: str) -> None:
    """A run name is one plain directory name: never a path that could leave `output_dir`."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise TetherError(f"config field 'run_name' must be a plain non-empty name (no '/', not "
                          f"'.' or '..'), got {name!r}")


def check_device(device: str) -> None:
    if not (device in ("auto", "cpu", "cuda", "mps")
            or (device.startswith("cuda:") and device[5:].isdigit())):
        raise TetherError(f"config field 'device' must be one of: auto, cpu, cuda, cuda:N, mps "
                          f"(got {device!r})")


# torch takes a 32-bit count (a larger one is a ValueError from inside it) and starts that many
# threads at the first parallel operation; past a few thousand the system runs out first.
MAX_THREADS = 4096


def check_threads(threads: int, option: str = "--threads") -> None:
    """`--threads` (or `option`: --generator-threads) is 0 (auto) or a count torch can start."""
    if not 0 <= threads <= MAX_THREADS:
        raise TetherError(f"{option} {threads} is out of range: give 0 (auto) or 1 to "
                          f"{MAX_THREADS} threads per operation (this machine has "
                          f"{os.cpu_count()} CPU cores; more threads than cores only wait on "
                          "each other)")


def check_stop_strings(stop_strings: Any) -> None:
    """An empty stop string is inside every text, so it would end each response after its first
    token; no stop strings is the empty list (`--stop-strings` omitted, or given no values)."""
    for k, stop in enumerate(stop_strings):
        if stop == "":
            raise TetherError(f"--stop-strings value {k} is the empty string, which every response "
                              "contains, so each would end after one token; drop it (omit "
                              "--stop-strings for none)")


def require_positive(cfg: Any, *names: str, allow_zero: bool = False) -> None:
    """Raise TetherError for the first field in `names` that is not > 0 (or >= 0)."""
    for name in names:
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise TetherError(f"config field '{name}' must be {bound}, got {value}")


def section(cls: type[C], cfg: Any, **derived: Any) -> C:
    """The dataclass `cls` filled from the run's config by field name: each field takes
    `cfg.resolved_<name>` where the config derives one (an "auto" resolved), else `cfg.<name>`; a
    field whose default is itself such a dataclass is filled the same way. `derived` gives the
    fields the config cannot know alone (this process's share of a batch). A setting thus reaches
    the code that reads it in one hop, and a new one is a field here and in the config, nothing
    copied by hand between them."""
    values = {}
    for spec_field in dataclasses.fields(cls):
        name, default = spec_field.name, spec_field.default
        if name in derived:
            values[name] = derived[name]
        elif dataclasses.is_dataclass(default):
            values[name] = section(type(default), cfg)
        else:
            resolved = f"resolved_{name}"
            values[name] = getattr(cfg, resolved if hasattr(type(cfg), resolved) else name)
    return cls(**values)


# ----------------------------------------------------------------------------- dict round trip

def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain JSON/YAML-safe values (tuples become lists), its paths resolved
    (`resolved_paths`): what a run directory records means the same from any directory."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v
    return resolved_paths({f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
