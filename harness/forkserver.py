"""A pre-imported fork server: one per device; forks one scenario child per request.

    python -m harness.forkserver cpu|cuda

The server sets the device switch and imports torch, Triton and every kernel and scenario
module, without touching CUDA, then answers JSON lines:
  in:  {"id": N, "spec": {...}, "report": PATH, "log": PATH}
  out: {"ready": true} once; {"id": N, "pid": PID} per fork; {"pid": PID, "returncode": RC}
       per reaped child (RC < 0: killed by signal -RC).
Each child starts a new session (so the client can kill its group) and writes stdout and stderr
to its log. The server is single-threaded: forking a process with threads can deadlock the child.
"""

from __future__ import annotations

import json
import os
import selectors
import sys
import time


def _preload(device: str) -> None:
    from harness import device as devices

    devices.activate(device)
    import torch  # noqa: F401
    import triton  # noqa: F401

    from repro import registry  # noqa: F401  (imports every kernel and scenario module)

    # NOTE: nothing here may ask torch about devices: torch.cuda.is_available() (which importing
    # torch.utils.cpp_extension calls) poisons every later fork for CUDA. Children load csrc.


def _fork(request: dict) -> int:
    started = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        from harness.child import execute

        execute(request["spec"], request["report"], started)
    finally:
        os._exit(70)  # only reached if execute itself broke


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(device: str) -> None:
    _preload(device)
    selector = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()
    selector.register(stdin, selectors.EVENT_READ)
    _send({"ready": True})
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == stdin:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    return  # the client is gone; running children finish on their own
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    pid = _fork(request)
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = pid
                    selector.register(pidfd, selectors.EVENT_READ)
                    _send({"id": request["id"], "pid": pid})
            else:
                pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(sys.argv[1])
