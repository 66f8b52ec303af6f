"""The client side of fork servers (harness.forkserver): a private one of this process over a
socket pair, or a warm one (`repro serve`) in the user's directory (harness.userdir), started
detached and reached through its socket; and the environment every server and child runs with.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.forkserver import PROTOCOL, differing, installed_versions
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
HELLO_POLL_S = 0.25  # meanwhile, whether its process is stopped is looked at this often
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


def lock_name(device: str) -> str:
    return f"server-{device}.lock"


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds a warm server's lock (its pid is in the lock file)."""

    pid: int
    state: str  # /proc's state letter and word: "T (stopped)"
    started: float  # when it started, seconds since the epoch

    @property
    def stopped(self) -> bool:
        return self.state[:1] in ("T", "t", "Z", "X")

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid}, state {self.state}, running since {since}"


class Unresponsive(Exception):
    """A warm server took the connection but said no hello in time (or is stopped)."""

    def __init__(self, holder: Holder) -> None:
        super().__init__(holder.describe())
        self.holder = holder


def lock_holder(device: str, directory: UserDirectory) -> Holder | None:
    """This user's process that holds the device's server lock, whether it answers or not;
    None when no process holds it."""
    try:
        fd = directory.open_file(lock_name(device), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 64).decode(errors="replace").strip()
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
    finally:
        os.close(fd)
    return _process(int(text)) if text.isdigit() else None


def _process(pid: int) -> Holder | None:
    """The process `pid` if it is this user's (/proc: no privilege needed)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if int(fields.get("Uid", "-1").split()[1]) != os.getuid():
        return None
    started = btime + int(stat[19]) / os.sysconf("SC_CLK_TCK")
    return Holder(pid, fields.get("State", "?").strip(), started)


def end_holder(holder: Holder, device: str, directory: UserDirectory, wait_s: float = 10.0):
    """Kill a warm server that holds the lock but does not answer (this user's: checked), and
    wait for its lock and socket to go; True when they went."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(holder.pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if lock_holder(device, directory) is None:
            directory.unlink(socket_name(device))
            return True
        time.sleep(0.05)
    return False


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


def _hello(sock: socket.socket, pid: int) -> tuple[dict, bytes]:
    """The server's hello line (and what followed it); OSError when it does not come within
    WARM_HELLO_S, or as soon as its process is seen stopped."""
    data, deadline = b"", time.monotonic() + WARM_HELLO_S
    sock.settimeout(HELLO_POLL_S)
    while b"\n" not in data:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            holder = _process(pid)
            if holder is None or holder.stopped or time.monotonic() > deadline:
                raise OSError("no hello") from None
            continue
        if not chunk:
            raise OSError("closed before its hello")
        data += chunk
    line, _, rest = data.partition(b"\n")
    hello = json.loads(line)
    if not isinstance(hello, dict):
        raise ValueError("not a hello")
    return hello, rest


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
        answers (`stale` when it does not match this installation or this tree's copies of its
        own modules). Unresponsive: one of this user's took the connection and said no hello
        within WARM_HELLO_S (at once when its process is stopped)."""
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
        except OSError:  # nobody listens (gone, or still starting)
            sock.close()
            return None
        try:
            hello, rest = _hello(sock, pid)
        except (OSError, ValueError):
            sock.close()
            holder = _process(pid)
            if holder is None:
                return None
            raise Unresponsive(holder) from None
        sock.settimeout(None)
        server = cls(device, sock, None, None)
        server.ready, server.versions, server.pid = True, hello.get("versions", {}), pid
        server.buffer = rest
        server.log = directory.path / log_name(device)
        server.stale = hello.get("protocol") != PROTOCOL or server.versions != installed_versions()
        server.stale = server.stale or bool(differing(hello.get("sources", {}), str(ROOT)))
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
