"""`tether <stage> [options]`: dispatch to a stage module's `cli(argv)`.

A `TetherError` (bad input or config) prints one line, `error: <message>`, and exits with code 2.

Under torchrun every rank runs this, validates the same config and so fails with the same error:
rank 0 prints the line at once. Another rank's error is printed only if that rank is still alive
`ERROR_GRACE_S` later, i.e. when rank 0 did not fail too (torchrun stops the other ranks, with
SIGTERM, as soon as one exits non-zero). Either way the process group is torn down on the way
out, so no rank is left waiting in a collective, and a torchrun rank ends through
`distributed.exit_process`, which skips the interpreter finalization where a finished rank could
abort.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import time
from typing import NamedTuple, NoReturn

from tether import version
from tether.errors import AlreadyFinished, TetherError
from tether.run import interrupt, parent
from tether.run.extras import require_engine, require_stage
from tether.run.interrupt import Interrupted


class Stage(NamedTuple):
    """A `tether` command: the module whose `cli(argv)` runs it, its config class (importable
    without torch: `tether <stage> --help` loads only that), and its line in `tether --help`."""

    module: str
    config_module: str
    config_class: str
    help: str


STAGES = {
    "sft": Stage("tether.train.sft", "tether.train.offline_config", "SFTConfig",
                 "supervised fine-tuning: next-token loss on response tokens"),
    "rm": Stage("tether.train.reward", "tether.train.offline_config", "RMConfig",
                "reward model: Bradley-Terry loss on preference pairs"),
    "dpo": Stage("tether.train.dpo", "tether.train.offline_config", "DPOConfig",
                 "DPO / IPO: preference optimisation against a frozen reference"),
    "ppo": Stage("tether.train.ppo", "tether.train.ppo_config", "PPOConfig",
                 "PPO with a per-token KL penalty to the reference (any --advantage)"),
    "rloo": Stage("tether.train.rloo", "tether.train.ppo_config", "RLOOConfig",
                  "RLOO: k samples per prompt, leave-one-out baseline, no critic"),
    "grpo": Stage("tether.train.grpo", "tether.train.ppo_config", "GRPOConfig",
                  "GRPO: k samples per prompt, group-normalised advantages, KL in the loss"),
    "distill": Stage("tether.train.distill", "tether.train.ppo_config", "DistillConfig",
                     "on-policy distillation: the policy samples, a --teacher scores every token"),
    "demo": Stage("tether.demo", "tether.demo.config", "DemoConfig",
                  "a small end-to-end run on a tiny local model"),
    "tiny-model": Stage("tether.demo.tiny_model", "tether.demo.config", "TinyModelConfig",
                        "an untrained tiny model and tokenizer, built offline in seconds"),
    "generate": Stage("tether.tools.generate", "tether.tools.config", "GenerateConfig",
                      "sample responses from any saved policy to JSONL"),
    "eval": Stage("tether.tools.evaluate", "tether.tools.config", "EvalConfig",
                  "held-out evaluation of any saved policy: proxy, gold, KL, diversity"),
    "bon": Stage("tether.tools.bon", "tether.tools.config", "BonConfig",
                 "the best-of-n curve from one pool of samples: proxy, gold, exact KL"),
    "interpolate": Stage("tether.tools.interpolate", "tether.tools.config", "InterpolateConfig",
                         "the weights between an SFT and an RL model, each point evaluated"),
    "report": Stage("tether.tools.report_frontier", "tether.tools.config", "ReportConfig",
                    "run directories of any stage on one HTML page, configs diffed"),
    "set-base": Stage("tether.tools.set_base", "tether.tools.config", "SetBaseConfig",
                      "re-point a LoRA adapter at its base model where it is now (checked first)"),
    "sweep": Stage("tether.tools.sweep", "tether.tools.config", "SweepConfig",
                   "a grid of PPO and DPO/IPO runs from one YAML file, and the reward-KL frontier"),
    "serve-rm": Stage("tether.tools.serve_rm", "tether.tools.config", "ServeRMConfig",
                      "a reward model over HTTP, for --reward-url of the online stages and eval"),
}


def config_class(stage: str) -> type:
    """The config class of `tether <stage>`, imported without torch."""
    return getattr(importlib.import_module(STAGES[stage].config_module), STAGES[stage].config_class)


def usage() -> str:
    lines = ["usage: tether <stage> [--config FILE.yaml] [--field value ...]",
             "       tether --version", "", "stages:"]
    width = max(map(len, STAGES))
    lines += [f"  {name:<{width}}  {stage.help}" for name, stage in STAGES.items()]
    lines += ["", "`tether <stage> --help` lists every field of that stage's config and its default.",
              "Flags override values from --config; errors exit with code 2."]
    return "\n".join(lines)


def entry() -> NoReturn:
    """The `tether` command (and `python -m tether`, as torchrun runs it): `main`, then exit with
    its code; a torchrun rank through `distributed.exit_process` (see there for why)."""
    if parent.under_torchrun():
        parent.follow_launcher()  # first thing: a rank dies with torchrun, even while it imports
    code = main()
    # distributed.launched()'s test, spelled out: importing tether.run.distributed imports torch,
    # which `tether --help` and the stage helps do not load
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        from tether.run import distributed

        distributed.exit_process(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(f"tether {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"error: unknown stage {stage!r}; choose one of: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    # The config first, before torch: a bad option, file or missing extra fails in a fraction
    # of a second, and a good one gets a first line at once, not after seconds of imports.
    # --help is the config's alone (no torch, no transformers): its help page, then exit.
    try:
        first_line = preflight(stage, ["--help"] if "-h" in rest or "--help" in rest else rest)
    except TetherError as exc:
        _report(f"error: {exc}")
        return 2
    except SystemExit as exc:
        return int(exc.code or 0)
    except BrokenPipeError:  # `tether ppo --help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    if first_line and int(os.environ.get("RANK", "0")) == 0:
        print(first_line, flush=True)  # stdout, with the progress lines (stderr: errors only)
    # The stages' own progress lines tell the story; transformers' load and save bars only add
    # noise (and, off a terminal, lines of control characters).
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    module = importlib.import_module(STAGES[stage].module)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        # torchrun stops ranks with SIGTERM when one fails: keep its default (end at once) rather
        # than the graceful stop-at-the-next-step, which a rank stuck in a collective never reaches.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    else:
        interrupt.install()
    try:
        return _run(module, rest)
    finally:
        from tether.run import distributed

        distributed.teardown()


def preflight(stage: str, argv: list[str]) -> str:
    """Parse `argv` with the stage's config class alone (no torch: the stage parses it again,
    in a millisecond), check the reward settings (which need no model: tether.run.reward_checks;
    a Python caller's rewards are checked by the wiring), that the extras the stage, its
    engine and its trackers need are installed, the user's code as named (`check_named_code`)
    and that no model path that looks local is missing (validation checks the trackers it names); returns the line(s) to show while torch,
    transformers and the model load ("" for stages that print their own)."""
    from tether.run.parse import parse_config
    from tether.run.paths import MODEL_PATH_FIELDS, check_local_path
    from tether.run.reward_checks import check_rewards
    from tether.run.trackers import auto_note
    from tether.run.user_code.load import check_named_code

    cfg = parse_config(config_class(stage), argv, prog=f"tether {stage}")
    if hasattr(cfg, "reward_fn"):  # the online stages and eval: the CLI passes no Python reward
        check_rewards(cfg, training=stage not in ("eval", "interpolate"))
    require_stage(stage)
    require_engine(getattr(cfg, "engine", "native"))
    check_named_code(cfg)
    for field in sorted(MODEL_PATH_FIELDS):  # a missing local model is a typo, said before torch loads
        if getattr(cfg, field, ""):
            check_local_path(getattr(cfg, field))
    if stage in ("demo", "report", "sweep", "tiny-model") or stage == "generate" and not cfg.output:
        # the demo prints its own first line; a report and tiny-model load no model, a sweep's
        # runs print their own; generate without --output writes its JSONL to stdout, which stays data
        return ""
    model = getattr(cfg, "policy", "") or getattr(cfg, "model", "")
    name = getattr(cfg, "run_name", "")
    note = auto_note(getattr(cfg, "report_to", ""))  # the default, on a core install
    return (f"{stage}{' ' + name if name else ''}: loading torch and transformers, then {model}"
            + (f"\n{note}" if note else ""))


ERROR_GRACE_S = 5.0  # a non-zero rank waits this long for torchrun to end it before reporting


def _report(message: str, rank_0_waits: bool = False) -> None:
    """Print one error line: at once on rank 0 (or alone); on another rank only if torchrun has
    not ended this process within ERROR_GRACE_S (then rank 0 had nothing to report). With
    `rank_0_waits` rank 0 waits too, quietly, for torchrun to stop it: the error is another's."""
    if rank_0_waits or int(os.environ.get("RANK", "0")) != 0:
        from tether.run import distributed

        distributed.teardown()  # the other ranks see the group end instead of waiting on us
        time.sleep(ERROR_GRACE_S)
    print(message, file=sys.stderr, flush=True)


def _lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank ended (its own error is the one to report)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer",
                                  "NCCL", "gloo", "Broken pipe"))


def _run(module, rest: list[str]) -> int:
    try:
        return int(module.cli(rest) or 0)
    except AlreadyFinished as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(exc), file=sys.stderr)
        return 0
    except Interrupted as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: quit at once; the last checkpoint is kept (--resume continues from "
              "it)", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
            raise
        _report(f"error: cannot write {exc.filename or 'the run directory'}: {exc.strerror}; free "
                "space or choose a writable --output-dir (the last complete checkpoint is intact)")
        return 2
    except TetherError as exc:
        _report(f"error: {exc}")
        return 2
    except Exception as exc:
        if not ("WORLD_SIZE" in os.environ and "RANK" in os.environ and _lost_peer(exc)):
            raise
        _report("error: another rank failed and left the process group (its error is above); "
                "the last complete checkpoint is intact", rank_0_waits=True)
        return 1


if __name__ == "__main__":
    entry()
