"""A fork server: imports torch, Triton and numpy once, then forks one scenario child per request.

    serve(DEVICE, FD)     (harness.isolate starts it with ROOT first on sys.path)

It sets the device switch and preloads third-party modules only, never the project's: each child
drops any project module it inherited and imports harness, kernels and repro from ROOT after the
fork, so a child never runs stale code. Nothing here asks torch about devices:
torch.cuda.is_available() would poison every later fork for CUDA.

Protocol: JSON lines over the socket FD; stdout and stderr are only a log, so a library that
prints cannot break it.
  in:  {"id": N, "root": DIR, "request": {...}}   (the child's request, see harness.child)
  out: {"ready": true, "versions": {...}} once, after the preload;
       {"id": N, "pid": PID} per fork; {"id": N, "returncode": RC} per reaped child (RC < 0:
       killed by signal -RC).
When the socket closes (the client exited or was killed) the server kills every child's group
and exits. Each child leads its own session, dies with the server (parent-death signal) and
keeps its own time limit. The server is single-threaded: forking with threads can deadlock.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

from harness import lifetime

PROJECT_PACKAGES = ("harness", "kernels", "repro", "tests")


def _preload(device: str) -> dict[str, str]:
    if device == "cpu":  # Triton's interpreter; must be set before triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import numpy
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__}


def _fresh_project(root: str) -> None:
    """Forget inherited project modules; import them from `root` from now on."""
    for name in list(sys.modules):
        if name.partition(".")[0] in PROJECT_PACKAGES:
            del sys.modules[name]
    sys.path[:] = [root, *(p for p in sys.path if p not in ("", root))]


def _child(message: dict, server_pid: int) -> None:
    """In the forked child: detach, redirect output to the log, run; never returns."""
    started = time.monotonic()
    try:
        os.setsid()
        lifetime.die_with_parent(server_pid)
        request = message["request"]
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        lifetime.close_inherited_fds()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _fresh_project(message["root"])
        from harness.child import main

        main(request, started)
    finally:
        os._exit(70)  # only reached if the child's own code broke


def _send(sock: socket.socket, message: dict) -> bool:
    """False when the client is gone."""
    try:
        sock.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        return False
    return True


def serve(device: str, fd: int) -> None:
    sock, server_pid = socket.socket(fileno=fd), os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides; it closes the socket
    _send(sock, {"ready": True, "versions": _preload(device)})
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    _shutdown(children)
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(message, server_pid)
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = (message["id"], pid)
                    selector.register(pidfd, selectors.EVENT_READ)
                    if not _send(sock, {"id": message["id"], "pid": pid}):
                        _shutdown(children)
                        return
            else:
                rid, pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                if not _send(sock, {"id": rid, "returncode": os.waitstatus_to_exitcode(status)}):
                    _shutdown(children)
                    return


def _shutdown(children: dict[int, tuple[int, int]]) -> None:
    """The client is gone: nothing of its run may outlive it."""
    for _, pid in children.values():
        lifetime.kill_group(pid)
    for pidfd, (_, pid) in children.items():
        os.waitpid(pid, 0)
        os.close(pidfd)
