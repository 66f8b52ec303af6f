"""A fork server: imports torch, Triton and numpy once, then forks one scenario child per request.

    serve(DEVICE, FD)               a private server of one client (harness.isolate)
    serve_warm(DEVICE, PATH, IDLE)  a warm server on a per-user socket (`repro serve`)

Both are started with their tree first on sys.path. A server sets the device switch and preloads
third-party modules only, never the project's: each child drops any project module it inherited
and imports harness, kernels and repro from the root its request names, after the fork, in the
environment the request carries (the client's), on the GPU it names. So a warm server never runs
stale project code, whoever started it and whatever was checked out since. Nothing here asks
torch about devices: torch.cuda.is_available() would poison every later fork for CUDA.

Protocol: JSON lines over each connection; stdout and stderr are only a log, so a library that
prints cannot break it.
  in:  {"id": N, "root": DIR, "request": {...}}   (the child's request, see harness.child)
       {"stop": true}                              (a warm server: exit now)
  out: {"ready": true, "protocol": P, "pid": PID, "versions": {...}} once per connection;
       {"id": N, "pid": PID} per fork; {"id": N, "returncode": RC} per reaped child (RC < 0:
       killed by signal -RC).
When a connection closes (its client exited or was killed) the server kills every child of that
connection. A private server then exits; a warm one exits when idle for IDLE seconds, when asked,
or when its socket file is removed. Each child leads its own session, dies with the server
(parent-death signal) and keeps its own time limit. The server is single-threaded: forking with
threads can deadlock.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import selectors
import signal
import socket
import sys
import time

from harness import lifetime

PROJECT_PACKAGES = ("harness", "kernels", "repro", "tests")
PROTOCOL = 2  # bumped with any change of the messages: a client replaces an older warm server


def _preload(device: str) -> dict[str, str]:
    if device == "cpu":  # Triton's interpreter; must be set before triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import triton  # noqa: F401

    return installed_versions()


def installed_versions() -> dict[str, str]:
    """The installed third-party versions a server preloads (package metadata: no import)."""
    return {name: importlib.metadata.version(name) for name in ("torch", "triton", "numpy")}


def _fresh_project(root: str) -> None:
    """Forget inherited project modules; import them from `root` from now on."""
    for name in list(sys.modules):
        if name.partition(".")[0] in PROJECT_PACKAGES:
            del sys.modules[name]
    sys.path[:] = [root, *(p for p in sys.path if p not in ("", root))]


def _child(message: dict, server_pid: int) -> None:
    """In the forked child: detach, take the client's environment, redirect output to the log,
    run; never returns."""
    started = time.monotonic()
    try:
        os.setsid()
        lifetime.die_with_parent(server_pid)
        request = message["request"]
        if "env" in request:
            os.environ.clear()
            os.environ.update(request["env"])
        if request.get("gpu") is not None:  # before anything initializes CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = request["gpu"]
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


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, b""
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)


class _Server:
    """The event loop: connections, their requests, and their children's exits."""

    def __init__(self, versions: dict[str, str], listener: socket.socket | None = None) -> None:
        self.versions, self.listener, self.pid = versions, listener, os.getpid()
        self.selector = selectors.DefaultSelector()
        self.connections: set[_Connection] = set()
        self.last_active, self.stopping = time.monotonic(), False
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ, "listener")

    def add(self, sock: socket.socket) -> None:
        conn = _Connection(sock)
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        hello = {"ready": True, "protocol": PROTOCOL, "pid": self.pid, "versions": self.versions}
        if not _send(sock, hello):
            self.drop(conn)

    def drop(self, conn: _Connection) -> None:
        """The connection's client is gone: nothing of its run may outlive it."""
        for _, pid in conn.children.values():
            lifetime.kill_group(pid)
        for pidfd, (_, pid) in conn.children.items():
            self.selector.unregister(pidfd)
            os.waitpid(pid, 0)
            os.close(pidfd)
        self.selector.unregister(conn.sock)
        conn.sock.close()
        self.connections.discard(conn)
        self.last_active = time.monotonic()

    def run(self, idle_s: float | None = None, path: str | None = None) -> None:
        while not self.stopping:
            for key, _ in self.selector.select(timeout=1.0 if path else None):
                if key.data == "listener":
                    self.add(self.listener.accept()[0])
                elif isinstance(key.data, _Connection):
                    if key.data in self.connections:  # not dropped earlier in this round
                        self._read(key.data)
                elif key.data[1] in key.data[0].children:
                    self._reaped(*key.data)
            if path is None and not self.connections:
                return  # a private server: its one client is gone
            if path is not None and self._should_exit(idle_s, path):
                return
        for conn in list(self.connections):
            self.drop(conn)

    def _should_exit(self, idle_s: float | None, path: str) -> bool:
        """Idle (no client, so no child) for idle_s, or the socket file was removed."""
        quiet = time.monotonic() - self.last_active
        idle = not self.connections and idle_s is not None and quiet > idle_s
        return idle or not os.path.exists(path)

    def _read(self, conn: _Connection) -> None:
        chunk = conn.sock.recv(1 << 16)
        if not chunk:
            self.drop(conn)
            return
        *lines, conn.pending = (conn.pending + chunk).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if message.get("stop"):
                self.stopping = True
                return
            if conn not in self.connections:
                return
            self._fork(conn, message)

    def _fork(self, conn: _Connection, message: dict) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(message, self.pid)
        pidfd = os.pidfd_open(pid)
        conn.children[pidfd] = (message["id"], pid)
        self.selector.register(pidfd, selectors.EVENT_READ, (conn, pidfd))
        self.last_active = time.monotonic()
        if not _send(conn.sock, {"id": message["id"], "pid": pid}):
            self.drop(conn)

    def _reaped(self, conn: _Connection, pidfd: int) -> None:
        rid, pid = conn.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.last_active = time.monotonic()
        if not _send(conn.sock, {"id": rid, "returncode": os.waitstatus_to_exitcode(status)}):
            self.drop(conn)


def serve(device: str, fd: int) -> None:
    """A private server for the client at the other end of socket FD."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides; it closes the socket
    sock = socket.socket(fileno=fd)
    server = _Server(_preload(device))
    server.add(sock)
    server.run()


def serve_warm(device: str, path: str, idle_s: float) -> None:
    """A warm server listening on `path` (its directory is the user's, mode 0700)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    versions = _preload(device)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    try:
        _Server(versions, listener).run(idle_s, path)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
