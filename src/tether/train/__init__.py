"""The training stages, one explicit loop per file: `sft`, `reward` (rm), `dpo`, `ppo`.

Each stage module exposes `run(cfg) -> RunResult` for Python and `cli(argv) -> int` for
`tether <stage>`. `common` holds what the offline stages share (optimizer, LR schedule, resume).
"""
