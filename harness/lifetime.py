"""Process lifetime: children die with their parent, keep their own time limit, die as a group.

Standard library only: the fork server imports this before torch, and the CLI parent imports it
without ever importing torch. Linux: the parent-death signal is prctl(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import time

PR_SET_PDEATHSIG = 1
# A child's own time limit fires a little after the parent's: the parent kills first when it
# is alive (outcome timeout); the child's alarm only matters when nobody is left to kill it.
OWN_LIMIT_GRACE = (2.0, 0.1)  # seconds + fraction of the limit


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits; exit now if the parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(137)


def arm_own_time_limit(seconds: float) -> None:
    """SIGALRM (default action: terminate) after `seconds` + grace, whatever else happens."""
    fixed, fraction = OWN_LIMIT_GRACE
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, seconds * (1 + fraction) + fixed)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (each child leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def close_inherited_fds(keep: tuple[int, ...] = (0, 1, 2)) -> None:
    """Close every descriptor but `keep`: a child must not hold its server's socket open."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def hand_over(fd: int, message: dict) -> bool:
    """Write a child waiting on a pipe its request, one JSON line, and close the pipe; False
    when the child died meanwhile."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write((json.dumps(message) + "\n").encode())
    except OSError:
        return False
    return True


def wait_for(fd: int) -> dict | None:
    """In a child waiting on a pipe: the request its parent writes (hand_over), or None at EOF
    (not needed after all)."""
    with os.fdopen(fd, "rb") as pipe:
        line = pipe.readline()
    return json.loads(line) if line.endswith(b"\n") else None


def let_go(children: list[list[int]], wait_s: float) -> None:
    """Children of this process waiting on a pipe for a request ([pid, write end] each), handed
    none: EOF on each pipe, each reaped; one not gone within `wait_s` is killed and left to
    this process's exit (one stuck in the driver)."""
    for _, fd in children:
        with contextlib.suppress(OSError):
            os.close(fd)
    deadline = time.monotonic() + wait_s
    for pid, _ in children:
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.02)
