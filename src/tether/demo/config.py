"""`DemoConfig`: the demo's few knobs, and `TinyModelConfig`, `tether tiny-model`'s, apart from
their code so that `--help` imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from tether.errors import TetherError
from tether.run.config import check_device, check_run_name, require_positive


@dataclass(kw_only=True)
class DemoConfig:
    """The demo's few knobs; the defaults finish in minutes on two CPU cores."""

    output_dir: str = "runs"
    """Directory that holds run directories."""
    run_name: str = "demo"
    """Everything is written to <output_dir>/<run_name>/ (refused if it already holds a demo, unless --resume)."""
    quick: bool = False
    """A smaller, faster demo (one seed, shorter runs): first contact and CI."""
    seed: int = 0
    """Seed of the data, SFT and reward model; PPO runs use seed, seed+1, ..."""
    seeds: int = 3
    """PPO seeds per variant (--quick uses 1)."""
    ppo_batches: int = 100
    """PPO batches of 32 prompts per run (--quick: 40)."""
    ppo_lr: float = 1e-4
    """PPO learning rate of the tiny policy (and its critic)."""
    fixed_beta: float = 0.1
    """beta of the fixed-penalty run."""
    adaptive_start_beta: float = 0.2
    """Adaptive run's starting beta."""
    kl_target: float = 3.0
    """Adaptive controller's KL target, in nats per response."""
    kl_horizon: int = 256
    """Adaptive controller's horizon, in episodes (Ziegler et al. used 10000 over far longer runs)."""
    sweep_betas: list[float] = field(default_factory=lambda: [0.0, 0.03, 0.1, 0.3, 1.0])
    """Fixed betas of the "which beta?" sweep, one seed each (--quick: the first and last; empty: no sweep)."""
    sweep_batches: int = 40
    """PPO batches of 32 prompts per sweep run (--quick: 12)."""
    device: str = "cpu"
    """Device for every stage."""
    jobs: int = 0
    """Stages run at once after SFT and the RM, one process each (0: one per available core); the numbers are the same for any value."""
    resume: bool = False
    """Continue an interrupted demo (same settings): finished stages are kept, the others go on from their last checkpoint."""

    def validate(self) -> None:
        require_positive(self, "seeds", "ppo_batches", "ppo_lr", "kl_target", "kl_horizon",
                         "adaptive_start_beta", "sweep_batches")
        require_positive(self, "fixed_beta", "jobs", allow_zero=True)
        if any(beta < 0 for beta in self.sweep_betas):
            raise TetherError(f"config field 'sweep_betas' must hold betas >= 0, got {self.sweep_betas}")
        check_run_name(self.run_name)
        check_device(self.device)

    def scaled(self) -> DemoConfig:  # derived: the --quick variant
        if not self.quick:
            return self
        betas = self.sweep_betas
        quick_betas = [betas[0], betas[-1]] if len(betas) > 2 else betas  # the two extremes
        return replace(self, seeds=1, ppo_batches=min(self.ppo_batches, 40),
                       sweep_betas=quick_betas, sweep_batches=min(self.sweep_batches, 12))


@dataclass(kw_only=True)
class TinyModelConfig:
    """Build an untrained tiny causal LM and its tokenizer offline, in seconds, to try any command on a machine with no hub (docs/demo.md, "A tiny model")."""

    arch: Literal["gpt2", "llama", "mistral", "qwen2"] = "gpt2"
    """The family: gpt2 (learned positions, tied head), llama (rotary, GQA), mistral (llama's blocks, a sliding window, a SentencePiece-style tokenizer) or qwen2 (ChatML tokens, two EOS ids)."""
    chat: bool = False
    """Give the tokenizer its family's chat template: ChatML (qwen2), Llama-style, Mistral's [INST] (gpt2 has none)."""
    output: str
    """The directory to write (refused if it exists and is not empty: nothing is written over)."""

    def validate(self) -> None:
        if self.chat and self.arch == "gpt2":
            raise TetherError("--chat: GPT-2 has no chat template; pass --arch qwen2 (ChatML), "
                              "llama or mistral, or drop --chat")
        out = Path(self.output)
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise TetherError(f"--output {self.output} exists and is not empty; tiny-model writes "
                              "nothing over it: choose a new directory")
