"""`python -m tether ...`, which is also how torchrun launches it: `torchrun --nproc-per-node N -m
tether sft ...`."""

import sys

from tether.cli import main

sys.exit(main())
