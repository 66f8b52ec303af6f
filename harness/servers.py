"""The client side of fork servers (harness.forkserver): a private one of this process over a
socket pair, or a warm one (`repro serve`) in the user's directory (harness.userdir), started
detached and reached through its socket; and the environment every server and child runs with.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.forkserver import PROTOCOL, installed_versions
from harness.outcome import ENV_ORACLE
from harness.userdir import UserDirectory, peer

ROOT = Path(__file__).resolve().parent.parent
# `python -c`: sys.path[0] would be the working directory; the tree is ROOT, passed as argv[1].
BOOT = "import sys; sys.path[:] = [sys.argv[1], *(p for p in sys.path if p)]; "
SERVER_BOOT = BOOT + "from harness.forkserver import serve; serve(sys.argv[2], int(sys.argv[3]))"
WARM_BOOT = (
    BOOT + "from harness.forkserver import serve_warm; "
    "serve_warm(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))"
)
ENV_SERVER = "REPRO_SERVER"  # auto: use a warm server when one runs (repro serve); off: never
WARM_HELLO_S = 5.0  # a warm server that does not say hello by then is not used
WARM_IDLE_S = 600.0  # a warm server exits after this long without a client


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_ORACLE}  # per job only
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # many children at once; scenarios are tiny
    return env


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def socket_name(device: str) -> str:
    return f"server-{device}.sock"


def log_name(device: str) -> str:
    return f"server-{device}.log"


def start_warm(device: str, idle_s: float, directory: UserDirectory, root: Path = ROOT):
    """A detached warm server for `device` in `directory` (it inherits the directory's open
    descriptor; its socket appears once torch is imported). OSError: its log cannot be opened
    (a symlink planted there is refused)."""
    log = directory.open_file(log_name(device), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", WARM_BOOT, str(root), device, str(directory.fd), str(idle_s)],
            pass_fds=(directory.fd,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )
    finally:
        os.close(log)


class Server:
    """Client side of one fork server (harness.forkserver): a private one over a socket pair
    (`start`), or a warm one on its per-user socket (`connect`)."""

    def __init__(self, device: str, sock: socket.socket, log: Path | None, proc) -> None:
        self.device, self.sock, self.log, self.proc = device, sock, log, proc
        self.buffer, self.started, self.ready = b"", time.monotonic(), False
        self.versions: dict[str, str] = {}
        self.pid: int | None = proc.pid if proc is not None else None
        self.stale = False  # a warm server of another protocol or installation
        self.runs: dict[int, object] = {}  # request id -> its run (harness.isolate)

    @classmethod
    def start(cls, device: str, root: Path, log: Path) -> Server:
        ours, theirs = socket.socketpair()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVER_BOOT, str(root), device, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
                start_new_session=True,
            )
        theirs.close()
        return cls(device, ours, log, proc)

    @classmethod
    def connect(cls, device: str, directory: UserDirectory) -> Server | None:
        """The warm server of `device` in `directory`, if one of this user's runs there and
        answers (`stale` when it does not match this installation)."""
        if not directory.exists(socket_name(device)):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(WARM_HELLO_S)
        try:
            sock.connect(directory.address(socket_name(device)))
            pid, uid = peer(sock)
            if uid != os.getuid():
                print(
                    f"repro: {directory.path / socket_name(device)} is served by uid {uid}, "
                    "not by this user: not used",
                    file=sys.stderr,
                )
                sock.close()
                return None
            hello = json.loads(sock.makefile("rb").readline())
        except (OSError, ValueError):
            sock.close()
            return None
        sock.settimeout(None)
        server = cls(device, sock, None, None)
        server.ready, server.versions, server.pid = True, hello.get("versions", {}), pid
        server.log = directory.path / log_name(device)
        server.stale = hello.get("protocol") != PROTOCOL or server.versions != installed_versions()
        return server

    def send(self, message: dict) -> bool:
        """False when the server is gone."""
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            return False
        return True

    def receive(self) -> list[dict] | None:
        """The complete messages that arrived; None when the server is gone."""
        try:
            chunk = self.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            return None
        *lines, self.buffer = (self.buffer + chunk).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def evidence(self) -> str:
        return tail(self.log) if self.proc else f"(a warm server: its log is {self.log})"

    def stop(self) -> None:
        """A private server: kill it (its children die with it: parent-death signal) and reap
        it. A warm one: leave (it kills this connection's children and stays warm)."""
        if self.proc is not None:
            self.proc.kill()
        self.sock.close()
        if self.proc is not None:
            self.proc.wait()
