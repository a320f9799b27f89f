"""Rollout engines: what samples a batch of responses in the layout of `tether.rl.rollout`.
`native` is tether's own KV-cached sampler."""
