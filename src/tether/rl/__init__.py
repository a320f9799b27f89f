"""The online pieces the loop in `tether.train.ppo` composes: rollout engines (`engines`) and the
rollout batch (`rollout`), scoring the sampled tokens (`scoring`), rewards from a model, a
server or a Python function (`reward`), environments and tools (`env`), the one update step
(`update`), held-out evaluation (`evaluation`) and what data parallelism adds (`roles`). Each
takes explicit arguments, never a stage config."""
