"""The commands around the stages: `tether eval` (`evaluate`), `generate`, `report`, `sweep` (with
its plan and report) and the reward-KL frontier maths (`frontier`); their configs in `config`."""
