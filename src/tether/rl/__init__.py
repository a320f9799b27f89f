"""The online pieces the loop in `tether.train.ppo` composes: rollout engines (`engines`) and the
rollout batch (`rollout`), scoring the sampled tokens (`scoring`), rewards from a model or a
Python function (`rewards`), the one update step (`update`), held-out evaluation (`evaluation`)
and what data parallelism adds (`roles`). Each takes explicit arguments, never a stage config."""
