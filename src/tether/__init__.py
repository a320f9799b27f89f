"""tether: RLHF with a KL leash.

The maths layer (`tether.kl`, `tether.logprobs`, `tether.advantages`, `tether.losses`) is pure
tensor functions; the stages in `tether.train` are explicit loops built on it.
"""

__version__ = "0.1.0"
