"""The configs of the offline stages (`tether sft`, `tether rm`, `tether dpo`): typed fields with a
default and a one-line help each, validated into one-line errors.

They live apart from the training loops, and import no torch, so that `--help` comes up at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from tether.errors import TetherError
from tether.run.config import RunConfig, require_positive


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """Fields of every offline stage: model, data, batching and optimisation."""

    # ---- model and device
    model: str
    """Causal LM to start from: a local directory or a hub name."""
    # ---- data
    data: str
    """Training rows: .jsonl, .json, .parquet, .csv, a save_to_disk directory, or a hub dataset name."""
    split: str = "train"
    """Split to read when `data` is a dataset with splits."""
    max_length: int = 512
    """Maximum tokens per sequence (prompt + response); longer responses are truncated and counted."""
    on_long_prompt: Literal["error", "skip"] = "error"
    """What to do with a prompt that leaves no room for a response: stop with an error, or skip the row (counted)."""
    # ---- optimisation
    batch_size: int = 8
    """Rows (SFT) or pairs (RM, DPO) per optimizer step."""
    epochs: int = 1
    """Passes over the data (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means `epochs` passes over the data."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay (applied to matrices only, not to biases or norms)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """Learning-rate decay after warm-up: constant, linear to 0, or cosine to 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: each forward/backward sees batch_size / grad_accum_steps rows (same update, less memory)."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "max_length", "batch_size", "epochs", "lr")
        require_positive(self, "max_steps", "warmup_steps", "weight_decay", "max_grad_norm",
                         allow_zero=True)
        if self.grad_accum_steps < 1 or self.batch_size % self.grad_accum_steps:
            raise TetherError(f"--grad-accum-steps {self.grad_accum_steps} must be >= 1 and divide "
                              f"--batch-size {self.batch_size} (each micro-batch has batch_size / "
                              "grad_accum_steps rows)")
        # --micro-batch-tokens >= 0, and not together with --grad-accum-steps (both cut a batch):
        # every stage has its own field (its help, its place)
        require_positive(self, "micro_batch_tokens", allow_zero=True)
        if self.micro_batch_tokens and self.grad_accum_steps > 1:
            raise TetherError(f"--micro-batch-tokens {self.micro_batch_tokens} and "
                              f"--grad-accum-steps {self.grad_accum_steps} both cut a batch; pass "
                              "one of them")


@dataclass(kw_only=True)
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on {prompt, response}, {prompt, completion}, {messages} or {text} rows."""

    STAGE: ClassVar[str] = "sft"  # the command; recorded in the run directory
    # (a field redefined for its default without a docstring keeps its base's help)

    lr: float = 2e-5
    loss_on: Literal["all", "last"] = "all"
    """Which assistant turns of a multi-turn chat carry loss: all of them, or the last only."""
    pack: bool = False
    """Run each micro-batch as packed rows: several sequences end to end per row, positions restarting per sequence (no padding; the same loss)."""
    micro_batch_tokens: int = 0
    """Tokens (prompt + response) per forward/backward instead of --grad-accum-steps: rows grouped longest first to fit (a longer row runs alone); 0: off."""


@dataclass(kw_only=True)
class RMConfig(TrainConfig):
    """Reward model on {prompt, chosen, rejected} rows (start from the SFT model)."""

    STAGE: ClassVar[str] = "rm"  # the command; recorded in the run directory

    lr: float = 1e-5  # TrainConfig's, named here to head the optimisation options of --help

    # ---- reward model
    margin_column: str = ""
    """Name of a numeric column to use as the Bradley-Terry margin m (empty: no margin)."""
    center_rewards_coef: float = 0.0
    """Weight c of the centring term c * mean((r_chosen + r_rejected)^2) (0: off)."""
    eval_data: str = ""
    """Held-out preference rows; empty: hold out `eval_fraction` of the training rows."""
    eval_fraction: float = 0.1
    """Fraction of training rows held out for accuracy when `eval_data` is empty (0: no eval)."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: only at the end)."""
    normalize_data: str = ""
    """SFT-format rows ({prompt, response}); after training, scores are normalised to mean 0, std 1 on them."""
    pack: bool = False
    """Run each micro-batch's chosen and rejected rows packed: several sequences end to end per row, positions restarting per sequence (no padding; the same scores)."""
    micro_batch_tokens: int = 0
    """Tokens per forward/backward instead of --grad-accum-steps: whole pairs (chosen + rejected rows) grouped longest first to fit (a longer pair runs alone); 0: off."""
    ensemble: int = 1
    """Reward models to train: K > 1 trains member k as `tether rm --seed SEED+k` into RUN/member<k>/, then writes RUN/final/ holding all K, which --reward-model reads as one ensemble (--reward-aggregate; docs/rm.md, "Ensembles")."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "ensemble")
        require_positive(self, "center_rewards_coef", "eval_every", allow_zero=True)
        if self.lora_dropout > 0:
            raise TetherError("--lora-dropout must be 0 for a reward model: dropout stays off so a "
                              "score does not depend on a dropout draw")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise TetherError(f"config field 'eval_fraction' must be in [0, 1), got {self.eval_fraction}")


@dataclass(kw_only=True)
class DPOConfig(TrainConfig):
    """DPO / IPO on {prompt, chosen, rejected} rows (start from the SFT model)."""

    STAGE: ClassVar[str] = "dpo"  # the command; recorded in the run directory

    lr: float = 5e-7
    """Peak learning rate (AdamW); DPO wants a small one (Rafailov et al. 2023 use 5e-7)."""
    # ---- preference optimisation
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's logistic loss; ipo: IPO's squared loss on per-token log-ratio averages."""
    beta: float = 0.1
    """Strength of the implicit KL leash (DPO beta, IPO tau); larger stays closer to the reference."""
    label_smoothing: float = 0.0
    """Assumed probability that a preference label is flipped, in [0, 0.5) (conservative DPO; sigmoid only)."""
    ref_model: str = ""
    """Reference model; empty: the starting `model` itself."""
    precompute_ref_logprobs: bool = False
    """Score the reference once before training and drop it (one model in memory, no ref forward per step)."""
    share_prompt: bool = True
    """One row per pair, [prompt | chosen | rejected], masked so the responses never see each other (same log-probs, fewer tokens)."""
    pack: bool = False
    """Run each micro-batch's chosen and rejected rows packed (policy and reference): sequences end to end, positions restarting per sequence (no padding; the same log-probs); needs --no-share-prompt."""
    micro_batch_tokens: int = 0
    """Tokens per forward/backward instead of --grad-accum-steps: whole pairs grouped longest first to fit (a longer pair runs alone); 0: off."""

    def validate(self) -> None:
        super().validate()
        if self.pack and self.share_prompt:
            raise TetherError("--pack packs the two-row pair layout, not the shared-prompt row "
                              "(its mask is not a packed sequence's); pass --no-share-prompt with "
                              "--pack")
        require_positive(self, "beta")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise TetherError(f"config field 'label_smoothing' must be in [0, 0.5), got {self.label_smoothing}")
        if self.lora_dropout > 0:
            raise TetherError("--lora-dropout must be 0 for dpo: policy and reference log-probs "
                              "are compared without dropout")
        if self.label_smoothing > 0 and self.loss == "ipo":
            raise TetherError("config field 'label_smoothing' applies to loss=sigmoid only; set it to 0 for ipo")
