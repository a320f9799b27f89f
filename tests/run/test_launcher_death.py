"""A torchrun rank dies with its launcher (`tether.run.parent`), tested by killing it with kill -9.

torchrun starts each rank in a session of its own, so before this a `kill -9` of torchrun left the
ranks running: they finished and wrote `final/` while a resume was starting. The ranks here are
real processes; "dead" is read from /proc (a killed orphan may linger as a zombie of init's).
The truths checked: the kernel's own record of the death signal (prctl PR_GET_PDEATHSIG), the
ranks' pids and parent in /proc, and the run directory afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from offline_fixtures import sft_rows, write_jsonl
from torchrun_helpers import ROOT, torchrun, torchrun_command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; the death signal is Linux's prctl")

ORPHAN = str(ROOT / "tests" / "dist_orphan.py")
START_S = 180  # torchrun and two ranks importing torch on a loaded 2-core machine
DEATH_S = 10  # SIGKILL from the kernel is immediate; the heartbeat polls (0.1 s here)


def stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc/<pid>/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, not yet reaped by init) is dead."""
    found = stat(pid)
    return found is not None and found[0] not in ("Z", "X")


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


def kill_leftovers(pids: list[int]) -> None:
    """The test's own processes that outlived a failed assertion (an orphan must not run on)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def rank_files(out: Path) -> list[tuple[int, int]]:
    """(pid, death signal) written by each rank of dist_orphan.py."""
    return [tuple(int(x) for x in (out / f"rank{r}").read_text().split()) for r in (0, 1)]


def test_a_normal_torchrun_run_ends_well_with_the_death_signal_set(tmp_path):
    """Nothing changes for a run whose launcher lives: exit 0 and final/ written; both ranks
    carry SIGKILL (9) as their parent-death signal, as the kernel reports it."""
    (tmp_path / "go").touch()
    out = torchrun([ORPHAN, str(tmp_path)], timeout=START_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final").is_dir()
    assert [sig for _, sig in rank_files(tmp_path)] == [signal.SIGKILL, signal.SIGKILL]


def test_one_process_sets_no_death_signal(tmp_path):
    """Without torchrun (no TORCHELASTIC_RUN_ID) join ties the process to nothing."""
    (tmp_path / "go").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, ORPHAN, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "final").is_dir()
    assert (tmp_path / "rank0").read_text().split()[1] == "0"


def test_kill_9_of_torchrun_ends_its_ranks_and_nothing_more_is_written(tmp_path):
    """The issue: both ranks up and working, torchrun killed with SIGKILL; both ranks are gone
    within seconds, and when their work would have ended (OUT/go) no final/ appears."""
    cmd, env = torchrun_command([ORPHAN, str(tmp_path)])
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        wait_for(lambda: (tmp_path / "rank1").exists() and (tmp_path / "rank0").exists()
                 or launcher.poll() is not None, START_S, "both ranks")
        assert launcher.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        pids = [pid for pid, _ in rank_files(tmp_path)]
        for pid in pids:  # torchrun is the ranks' parent, and each rank leads its own session
            assert stat(pid)[1] == launcher.pid and os.getsid(pid) == pid
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(alive(pid) for pid in pids), DEATH_S, "the ranks to die")
        (tmp_path / "go").touch()  # a rank still alive would now write final/ within 0.05 s
        time.sleep(1.0)
        assert not (tmp_path / "final").exists()
    finally:
        kill_leftovers(pids)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := stat(int(entry.name))) and info[1] == pid:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_kill_9_of_torchrun_ends_a_tether_sft_run(tiny_llama_dir, tmp_path):
    """The same through the `tether` command on the Llama-style model: once training has logged
    a step, kill -9 of torchrun ends both ranks and metrics.jsonl grows no more."""
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(12))
    cmd, env = torchrun_command(["-m", "tether", "sft", "--run-name", "r", "--output-dir",
                                 str(tmp_path / "runs"), "--model", str(tiny_llama_dir),
                                 "--data", str(data), "--device", "cpu", "--batch-size", "4",
                                 "--max-steps", "100000", "--log-every", "1", "--save-every",
                                 "0", "--report-to", "none"])
    metrics = tmp_path / "runs" / "r" / "metrics.jsonl"
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1
                 or launcher.poll() is not None, START_S, "the first logged step")
        assert launcher.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        pids = children(launcher.pid)
        assert len(pids) == 2
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(alive(pid) for pid in pids), DEATH_S, "the ranks to die")
        lines = metrics.read_text().count("\n")
        time.sleep(2.0)  # a surviving rank 0 logs a step every few hundredths of a second
        assert metrics.read_text().count("\n") == lines
        assert not (tmp_path / "runs" / "r" / "final").exists()
    finally:
        kill_leftovers(pids)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# A launcher (MIDDLE) that starts CHILD and sleeps; the test kills MIDDLE with SIGKILL.
MIDDLE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', *sys.argv[1:]]); " \
         "time.sleep(120)"
CHILD = """
import ctypes, os, sys, time
from pathlib import Path
from tether.run import parent

def say(name, text):
    (out / f".{name}").write_text(text)
    os.replace(out / f".{name}", out / name)

out, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "heartbeat":
    parent._set_death_signal = lambda signum: False  # as on macOS: no prctl, the thread instead
    how = parent.follow_launcher(poll_s=0.1)
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    say("child", f"{os.getpid()} {how} {value.value}")
else:  # "late": the launcher dies after tether's import, before follow_launcher
    say("child", f"{os.getpid()} late 0")
    while os.getppid() == parent.launcher_pid():
        time.sleep(0.05)
    parent.follow_launcher()
    say("survived", "")
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["heartbeat", "late"])
def test_a_child_dies_with_its_launcher_without_prctl_and_when_it_died_first(tmp_path, mode):
    """heartbeat: no death signal set (0, as the kernel reports), the polling thread ends the
    child. late: the launcher is already dead when follow_launcher runs; the check right after
    prctl ends the child (the kernel would never send the signal)."""
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    with open(tmp_path / "log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-c", MIDDLE, CHILD, str(tmp_path), mode],
                                    env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    pid = None
    try:
        wait_for(lambda: (tmp_path / "child").exists(), 60, "the child")
        pid, how, death_signal = (tmp_path / "child").read_text().split()
        pid = int(pid)
        assert (how, death_signal) == (mode, "0") and stat(pid)[1] == launcher.pid
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(pid), DEATH_S, "the child to die")
        assert not (tmp_path / "survived").exists(), (tmp_path / "log").read_text()
    finally:
        kill_leftovers([pid] if pid else [])
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
