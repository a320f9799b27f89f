"""A torchrun rank ends when its launcher dies.

torchrun starts every rank in a session of its own (`subprocess.Popen(start_new_session=True)`
in torch.distributed.elastic, so that it can signal a rank's whole process group). Nothing ties a
rank to torchrun's life, then: `kill -9` of torchrun (or an OOM kill, or a node agent that only
knows torchrun's pid) leaves the ranks running, re-parented to init, and they can finish and
write `final/` while a resume of the same run is starting. `follow_launcher` makes the rank
follow its parent, the process that started it (with torchrun, the torchrun process itself):

- Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)` (prctl(2)); the kernel sends SIGKILL to this process
  when its parent exits. It is per process, so it holds whatever session the rank is in. (Strictly
  it fires when the parent *thread* that started us ends; torchrun starts its ranks from its main
  thread, so that is when torchrun exits.)
- Elsewhere (macOS has no prctl), or where the kernel refuses it: a daemon thread reads
  `os.getppid()` every `POLL_S` seconds; a process whose parent died is re-parented (to init or a
  subreaper), so a changed value means the launcher is gone, and the thread sends SIGKILL.

Either way a parent that died before this ran would go unseen, so the parent seen when this
module was imported (the `tether` command imports it first thing) is compared with the current
one right after.

Only torchrun's ranks do this (`under_torchrun`): one process changes nothing, and other
launchers (srun, mpirun) end their own tasks.

Why SIGKILL and not SIGTERM (which tether's single-process runs turn into a checkpoint and a
resumable stop; a torchrun rank of the `tether` command ends at once on either): a rank whose launcher died has nobody left to report to, and the user or the
scheduler that killed the launcher may be starting the resume right now. A checkpoint written
then would race that resume's reads (the failure this prevents, in another form), and under
torchrun a checkpoint is a collective (FSDP2 gathers the shards) that can wait out the 600 s
timeout on ranks that are dying one by one. Checkpoints and final models are written under a
temp name and renamed when complete (`tether.run.checkpoint`), so SIGKILL at any moment leaves
the last complete checkpoint intact: the rank ends as if it had been killed with its launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0  # the heartbeat's period: how late, at most, a rank notices its launcher died
WATCH_THREAD = "tether-launcher-watch"

# (this process, its parent) when this module is imported (by the `tether` command: before torch
# is), to tell later whether the parent died before `follow_launcher` ran. The pid tells whether
# the import happened in this process or in a parent that forked us (whose parent is not ours).
_AT_IMPORT = (os.getpid(), os.getppid())


def launcher_pid() -> int:
    """The parent this process had when this module was imported (or now, if imported by a parent
    that forked it)."""
    pid, ppid = _AT_IMPORT
    return ppid if pid == os.getpid() else os.getppid()


def under_torchrun() -> bool:
    """True in a rank torchrun started: its elastic agent sets TORCHELASTIC_RUN_ID for every
    worker (other launchers, such as srun or mpirun, end their tasks themselves)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher(poll_s: float = POLL_S) -> str:
    """End this process with SIGKILL when its parent dies; returns how: "prctl" or "heartbeat".

    Called twice (the CLI, then `launch.join`), the second call changes nothing."""
    launcher = launcher_pid()
    how = "prctl" if _set_death_signal(signal.SIGKILL) else "heartbeat"
    if os.getppid() != launcher:  # it died before the death signal was set: nobody will send it
        _kill_self()
    if how == "heartbeat" and not any(t.name == WATCH_THREAD for t in threading.enumerate()):
        threading.Thread(target=_watch, args=(launcher, poll_s), name=WATCH_THREAD,
                         daemon=True).start()
    return how


def _set_death_signal(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum) through libc; False where there is none or it fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # dlopen(NULL): the interpreter's own symbols, libc's among them (ctypes.util's
        # find_library would run ldconfig in a subprocess to find the same library)
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl to be found: the heartbeat instead
        return False


def _watch(launcher: int, poll_s: float) -> None:
    """The heartbeat: poll the parent pid until it changes, then end the process."""
    while os.getppid() == launcher:
        time.sleep(poll_s)
    _kill_self()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
