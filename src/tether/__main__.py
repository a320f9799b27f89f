"""`python -m tether ...`, which is also how torchrun launches it: `torchrun --nproc-per-node N -m
tether sft ...`."""

from tether.cli import entry

entry()
