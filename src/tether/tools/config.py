"""The configs of the tools (`tether generate`, `eval`, `interpolate`, `report`, `set-base`,
`sweep`, `serve-rm`), apart from their code so that `--help` imports no torch.

The sampling, reward and device fields are the sections PPOConfig is made of
(tether.run.config: `SamplingOptions`, `RewardOptions`, `DeviceOptions`, `EnvOptions`), because
the evaluation samples and scores exactly as PPO's held-out evaluation does
(tether.rl.evaluation.eval_inputs): `tether eval` of a PPO run's starting model with that run's
settings gives the numbers its step 0 logged.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import ClassVar

from tether.errors import TetherError
from tether.run.config import (
    RM_API_KEY_ENV,
    DeviceOptions,
    EnvOptions,
    LMHeadOptions,
    RewardOptions,
    SamplingOptions,
    require_positive,
)


@dataclass(kw_only=True)
class SamplingConfig(DeviceOptions, EnvOptions, SamplingOptions):
    """Fields shared by generate and eval: the model, the prompts and how responses are sampled."""

    model: str
    """The policy: the final/ directory of any stage (full model or LoRA adapter) or a hub name."""
    base: str = ""
    """--model a LoRA adapter: its base model (default: where the adapter records it; for a base that moved, docs/loading.md)."""
    prompts: str
    """Prompts: rows with `prompt` or `messages` (JSONL, JSON, Parquet, CSV, dataset dir)."""
    batch_size: int = 32
    """Prompts sampled together; part of the seeded stream, so keep it to reproduce a PPO run's evaluation."""
    seed: int = 0
    """Seed of the sampling stream (a PPO run's --seed gives its evaluation's stream)."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "batch_size")


@dataclass(kw_only=True)
class GenerateConfig(SamplingConfig):
    """Sample responses to prompts and write them as JSONL, with training's encoding and EOS rules."""

    COMMAND: ClassVar[str] = "generate"
    output: str = ""
    """JSONL file to write ({prompt, response, sample, ended, length} per line); empty: stdout."""
    samples_per_prompt: int = 1
    """Responses per prompt, written in consecutive lines."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "samples_per_prompt")


@dataclass(kw_only=True)
class EvalConfig(SamplingConfig, RewardOptions, LMHeadOptions):
    """Held-out evaluation of a policy, as PPO and the demo run it: proxy and gold score, KL to
    the reference (k1 and exact), entropy, EOS rate, distinct-2, length."""

    COMMAND: ClassVar[str] = "eval"
    reference: str = ""
    """Reference for the KL (default: the starting model recorded in the run's config.yaml beside --model; else none)."""
    output: str = ""
    """JSON file for the metrics, settings and samples (default: beside --model's directory, never inside it: runs/x/final -> runs/x/final.eval.json)."""


@dataclass(kw_only=True)
class BonConfig(SamplingConfig, RewardOptions):
    """Best-of-n from one pool (Gao et al. 2022; Beirami et al. 2024): --n responses (or episodes)
    per prompt sampled once, as tether eval samples them, and for every n up to it the expected
    proxy and gold of the best of n by the proxy, the usual KL bound and the exact KL on the pool."""

    COMMAND: ClassVar[str] = "bon"
    n: int = 16
    """Responses sampled per prompt (the pool): the curve covers every n from 1 to it."""
    output: str
    """JSON file to write: one object per n {n, proxy, proxy_se, gold, gold_se, kl_bound, kl_exact}."""

    def validate(self) -> None:
        super().validate()
        if self.n < 2:
            raise TetherError(f"--n {self.n} is a pool of {max(self.n, 0)}: the best of one is the "
                              "model itself; give --n 2 or more")


@dataclass(kw_only=True)
class InterpolateConfig(DeviceOptions, EnvOptions, SamplingOptions, RewardOptions, LMHeadOptions):
    """The models on the line from an SFT model to an RL model trained from it, theta(eta) =
    theta_SFT + eta (theta_RL - theta_SFT) (WiSE-FT, Wortsman et al. 2022; WARP's LITI, Rame et
    al. 2024), one directory per point; with --prompts each is evaluated as tether eval does."""

    COMMAND: ClassVar[str] = "interpolate"
    FLAG_NAMES: ClassVar[dict[str, str]] = {"--from": "--reference", "--to": "--model"}

    # ---- models and points
    reference: str
    """The SFT model, eta 0 (a full model's directory): the line's start and every KL's reference."""
    model: str
    """The RL model, eta 1: a full model of --from's architecture and shapes, or a LoRA adapter on --from."""
    points: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """The etas, increasing, in [0, 1]; each names its directory (0.25: D/eta0.25/; a LoRA --to: an adapter with B scaled by eta)."""
    output_dir: str
    """Where the models go, D/eta<point>/, with interpolate.json (and D/eta<point>.eval.json); new or empty."""
    prompts: str = ""
    """Prompts to evaluate every point on, as tether eval does, KL to --from (none: the models alone)."""
    batch_size: int = 32
    """Prompts sampled together (tether eval's --batch-size)."""
    seed: int = 0
    """Seed of the sampling stream, the same for every point."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "batch_size")
        etas = self.points
        if not etas or etas[0] < 0 or etas[-1] > 1 or any(a >= b for a, b in zip(etas, etas[1:])):
            raise TetherError(f"--points {','.join(map(str, etas)) or '(none)'} must be "
                              "distinct etas in [0, 1], increasing, e.g. --points 0,0.5,1")
        if not self.prompts and (self.reward_fn or self.reward_model or self.reward_url
                                 or self.gold_fn):
            raise TetherError("a reward or --gold-fn scores the points on --prompts: give both")


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
class ServeRMConfig(DeviceOptions):
    """Serve a reward model over HTTP for --reward-url: POST /score {"prompts", "responses"} -> {"scores"}, GET /info (docs/rm.md, "Serving a reward model")."""

    POSITIONAL = "model"  # `tether serve-rm DIR` reads as `--model DIR`
    model: str
    """The reward model: `tether rm`'s output (full or LoRA) or a hub/local sequence classifier with one label (given as the command's first argument)."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface, which needs an API key; plain HTTP: put a TLS proxy in front off a private network)."""
    port: int = 8000
    """Port to listen on (0: any free one, named in the ready line)."""
    batch_size: int = 16
    """Rows per forward: each request is scored this many rows at a time, the requests in flight taking turns."""
    api_key: str = ""
    """The key every request must carry (Authorization: Bearer KEY); default: $TETHER_RM_API_KEY, which --reward-url sends (the variable keeps it off the command line). Required unless --host is loopback."""
    max_body_mb: float = 64.0
    """The largest request body read, in MB; a larger one is HTTP 413, refused before it is read whole."""
    max_rows: int = 4096
    """The most rows one POST /score may carry; more is HTTP 413."""

    @property
    def key(self) -> str:
        """The API key in force: --api-key, else $TETHER_RM_API_KEY ("" for none)."""
        return self.api_key or os.environ.get(RM_API_KEY_ENV, "")

    def validate(self) -> None:
        super().validate()
        require_positive(self, "batch_size", "max_body_mb", "max_rows")
        if not 0 <= self.port <= 65535:
            raise TetherError(f"--port {self.port} is not a port; give 0 to 65535 (0: any free one)")
        if not (self.key or is_loopback(self.host)):
            raise TetherError(f"--host {self.host} is reachable beyond this machine and the API "
                              f"would be open to anyone: set {RM_API_KEY_ENV} (or --api-key) to "
                              "a secret the clients share, or serve on 127.0.0.1")
        if self.key and not (self.key.isascii() and self.key.isprintable() and " " not in self.key):
            raise TetherError("the API key must be printable ASCII without spaces (an HTTP header "
                              "carries it)")


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine alone: localhost or a loopback address (a name that is
    not localhost may resolve elsewhere, so it is not)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
