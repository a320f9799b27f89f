"""`tether sft ...` under torchrun where one rank (FAIL_RANK) fails on its own in step 2, as a
rank-local fault would (a bad disk, a broken device): the job must end with that rank's one error
line, no hang.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_fail.py sft --model ...
"""

import os
import sys
import time

from tether import cli
from tether.errors import TetherError
from tether.train import sft

if int(os.environ["RANK"]) == int(os.environ.get("FAIL_RANK", "1")):
    real, calls = sft.optimizer_step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            if os.environ.get("FAIL_TIME_FILE"):  # when the failure happened, for the test's clock
                with open(os.environ["FAIL_TIME_FILE"], "w") as f:
                    f.write(str(time.time()))
            raise TetherError(f"rank {os.environ['RANK']} failed on its own in step 2")
        return real(*args, **kwargs)
    sft.optimizer_step = failing_step

sys.exit(cli.main(sys.argv[1:]))
