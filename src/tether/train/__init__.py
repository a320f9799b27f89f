"""The training stages, one explicit loop per file: `sft`, `reward` (rm), `dpo`, and the online
loop `ppo` with its presets `rloo` and `grpo`.

Each stage module exposes `run(cfg) -> RunResult` for Python and `cli(argv) -> int` for
`tether <stage>`. Their configs live apart (`offline_config`, `ppo_config`) so `--help` imports no
torch; `offline` holds the bookkeeping the offline loops share, `ppo_setup` what the online loop
builds before its first batch.
"""
