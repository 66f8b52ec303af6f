"""A fork server: imports torch, Triton and numpy once, then forks one scenario child per request.

    serve(DEVICE, FD)               a private server of one client (harness.isolate)
    serve_warm(DEVICE, DIR_FD, IDLE)  a warm server in the user's directory (`repro serve`)

Both are started with their tree first on sys.path. A server sets the device switch and preloads
third-party modules only, never the project's: each child drops any project module it inherited
and imports harness, kernels and repro from the root its request names, after the fork, in the
environment the request carries (the client's), on the GPU it names. So a warm server never runs
stale project code, whoever started it and whatever was checked out since. Nothing here asks
torch about devices: torch.cuda.is_available() would poison every later fork for CUDA.

What every child would repeat and is CUDA-free is done once, before any fork (_preload): Triton's
own cache key (a hash of its compiler and its library: 0.4 s per child on an H100 machine), the
modules its compiler imports at the first launch, and torch._dynamo (imported by the first use of
a TorchDispatchMode, which the graph emulation records with: 1.2 s per capturing child). A warm
cuda server also keeps SPARES spare children per GPU ahead of the next requests (each scenario of
a check, and of its confirming run, finds a CUDA context made; a matrix finds its contexts made
ahead of it): forked in the environment of the newest request (at start, the server's own), a
spare creates its CUDA context (and reads Triton's device properties: _warm_context) and
waits; a request with that same environment and GPU takes it (its clock starts then), any other
request gets a fresh fork. A scenario of N ranks needs a coordinator with no
CUDA context (its ranks are its children, harness.ranks): once one came, the server also keeps
RANK_GROUPS spare coordinators of N ranks, each with its N rank children forked ahead, their
contexts made (the six ranks of one check made theirs in 0.9 s of its 2.4 s on one
H200), which harness.ranks hands each rank's request to. The contexts are made before any
project module is imported and nothing is allocated, so a spare runs a scenario as a fresh child
would.

Protocol: JSON lines over each connection; stdout and stderr are only a log, so a library that
prints cannot break it.
  in:  {"id": N, "root": DIR, "request": {...}}   (the child's request, see harness.child)
       {"stop": true}                              (a warm server: exit now)
  out: {"ready": true, "protocol": P, "pid": PID, "versions": {...}, "sources": {PATH: SHA256}}
       once per connection; {"id": N, "pid": PID} per fork; {"id": N, "returncode": RC} per
       reaped child (RC < 0: killed by signal -RC); {"id": N, "refused": WHY} for a request whose
       tree holds other copies of the server's own modules than the server runs from memory.
A peer that sends anything else (garbage, a line over MAX_LINE, a message without its fields),
resets its connection or does not read what it is sent within SEND_S is dropped; the server
carries on. "sources" are the project files the server itself runs (this module and what it
imports of harness), hashed when it started: a client whose tree differs replaces it.
When a connection closes (its client exited or was killed) the server kills every child of that
connection. A private server then exits; a warm one exits when idle for IDLE seconds, when asked,
or when its socket file is removed; it answers only clients of its own uid (SO_PEERCRED) and holds
a lock file while it runs (its pid written in it), so one socket has one server. Each child leads
its own session, dies with the server (parent-death signal) and keeps its own time limit. The
server is single-threaded: forking with threads can deadlock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from harness import lifetime
from harness.ranks import RANK_SPARES, enter_rank  # the rank spares' hand-over is that module's
from harness.userdir import UserDirectory, peer

PROJECT_PACKAGES = ("harness", "kernels", "repro", "tests")
PROTOCOL = 6  # bumped with any change of the messages or of what a server checks: a client
# replaces an older warm server
LOCK_WAIT_S = 10.0  # a second warm server for one socket waits this long for the lock, then exits
SPARES = 8  # spare children per GPU of a warm cuda server (a check's scenarios at once)
RANK_GROUPS = 2  # spare coordinators per number of ranks a request had (a scenario, its twin)
MAX_SPARE_RANKS = 8  # a scenario of more ranks gets no spare coordinators (contexts held idle)
RANK_SIZES = 2  # spare coordinators for the newest this many numbers of ranks only (contexts)
LET_GO_S = 10.0  # a spare coordinator let go: its ranks' time to exit before they are killed
MAX_LINE = 1 << 20  # a request longer than this is no request
SEND_S = 5.0  # a peer that does not take a message within this long is dropped
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _preload(device: str) -> dict[str, str]:
    if device == "cpu":  # Triton's interpreter; must be set before triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import numpy  # noqa: F401
    import torch
    import triton  # noqa: F401

    with contextlib.suppress(ImportError):  # a TorchDispatchMode's first use imports it (1.2 s):
        import torch._dynamo  # noqa: F401  # every child that captures a graph would repeat it

    _prime_triton(device)
    return installed_versions()


def _prime_triton(device: str) -> None:
    """Triton's per-process work that every child would repeat, none of it touching CUDA."""
    with contextlib.suppress(ImportError):  # imported by the compiler at the first launch
        import triton.experimental.gluon  # noqa: F401
    if device == "cuda":  # the interpreter never compiles
        from triton.runtime import cache

        key = getattr(cache, "triton_key", None)  # cached per process
        if key is not None:
            key()


def own_sources(root: str = ROOT) -> dict[str, str]:
    """{path under root: sha256} of the project modules this process has imported (a server:
    the code it runs from memory, whatever its tree holds later)."""
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.partition(".")[0] in PROJECT_PACKAGES and path:
            rel = os.path.relpath(os.path.abspath(path), root)
            if not rel.startswith(".."):
                found[rel] = file_hash(os.path.join(root, rel))
    return found


def file_hash(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "missing"


def differing(sources: dict[str, str], root: str) -> list[str]:
    """The paths of `sources` whose copy under `root` is not the one hashed."""
    return sorted(
        rel for rel, digest in sources.items() if file_hash(os.path.join(root, rel)) != digest
    )


def installed_versions() -> dict[str, str]:
    """The installed third-party versions a server preloads, none of them imported: each from
    the name of its one dist-info directory beside the package (what importlib.metadata reads;
    importing that module was 12-19 ms of every client, `-X importtime`), else from
    importlib.metadata (an install laid out otherwise)."""
    return {name: _installed_version(name) for name in ("torch", "triton", "numpy")}


def _installed_version(name: str) -> str:
    spec = importlib.util.find_spec(name)  # a top-level package: found, not imported
    if spec is not None and spec.origin:
        site = os.path.dirname(os.path.dirname(spec.origin))
        prefix, suffix = f"{name}-", ".dist-info"
        with contextlib.suppress(OSError):
            found = [e for e in os.listdir(site) if e.startswith(prefix) and e.endswith(suffix)]
            if len(found) == 1:
                return found[0][len(prefix) : -len(suffix)]
    from importlib import metadata

    return metadata.version(name)


def _fresh_project(root: str) -> None:
    """Forget inherited project modules; import them from `root` from now on."""
    for name in list(sys.modules):
        if name.partition(".")[0] in PROJECT_PACKAGES:
            del sys.modules[name]
    sys.path[:] = [root, *(p for p in sys.path if p not in ("", root))]


def _detach(request: dict, server_pid: int, keep: tuple[int, ...] = ()) -> None:
    """In a forked child: its own session, dying with the server, the client's environment and
    GPU (before anything initializes CUDA), nothing inherited but `keep`."""
    os.setsid()
    lifetime.die_with_parent(server_pid)
    if "env" in request:
        os.environ.clear()
        os.environ.update(request["env"])
    if request.get("gpu") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = request["gpu"]
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    lifetime.close_inherited_fds((0, 1, 2, *keep))
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(message: dict, started: float) -> None:
    """In a detached child: output to the request's log, the project from its root, run."""
    request = message["request"]
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    _fresh_project(message["root"])
    from harness.child import main

    main(request, started)


def _child(message: dict, server_pid: int) -> None:
    """In the forked child: detach, run; never returns."""
    started = time.monotonic()
    try:
        _detach(message["request"], server_pid)
        _run(message, started)
    except BaseException:  # harness.child itself does not import: its log says why
        traceback.print_exc()
    finally:
        os._exit(70)  # only reached if the child's own code broke


def _spare_main(request: dict, server_pid: int, fd: int) -> None:
    """A spare child: detach as `request` would, create the CUDA context, then run the message
    the server writes to `fd` (EOF: not needed after all); never returns."""
    message = None
    try:
        _detach(request, server_pid, keep=(fd,))  # closes the server's end of the pipe
        with contextlib.suppress(Exception):  # a child that cannot init CUDA says so itself
            import torch

            torch.cuda.init()
            torch.cuda.synchronize()  # the primary context; the caching allocator untouched
            _warm_context(torch)
        message = lifetime.wait_for(fd)
        if message is not None:
            _run(message, time.monotonic())
    except BaseException:  # as _child's: its log (if it got that far) says why
        traceback.print_exc()
    finally:
        os._exit(70 if message is not None else 0)


def _group_main(request: dict, server_pid: int, fd: int, ranks: int) -> None:
    """A spare coordinator of `ranks` ranks: detach as `request` would, fork each rank ahead
    (_rank_spare_main: its context made), make none itself (harness.ranks may still fork a rank
    where one died), then run the message the server writes to `fd` with the ranks' pids and
    pipes in its request (RANK_SPARES: harness.ranks hands each its rank's request). EOF: not
    needed; it lets its ranks go and reaps them before it exits (no zombie left to PID 1)."""
    message = None
    try:
        _detach(request, server_pid, keep=(fd,))
        spares = [_fork_rank_spare(rank) for rank in range(ranks)]
        message = lifetime.wait_for(fd)
        if message is None:
            lifetime.let_go(spares, LET_GO_S)
        else:
            message["request"][RANK_SPARES] = spares
            _run(message, time.monotonic())
    except BaseException:  # as _child's: its log (if it got that far) says why
        traceback.print_exc()
    finally:
        os._exit(70 if message is not None else 0)


def _fork_rank_spare(rank: int) -> list[int]:
    """[pid, write end of its pipe] of a new rank spare, a child of this coordinator."""
    read, write = os.pipe()
    pid = _fork(_rank_spare_main, rank, os.getpid(), read)
    os.close(read)
    return [pid, write]


def _rank_spare_main(rank: int, coordinator: int, fd: int) -> None:
    """A rank spare: its CUDA context made on the GPU rank `rank` will use (harness.ranks.join:
    rank mod the GPU count), then the message its coordinator writes to `fd` (harness.ranks
    _hand_over: {"root", "log", "env", "request"}), run as harness.ranks would run a forked rank;
    EOF: not needed. It stays in its coordinator's session: the run's kill reaches it."""
    message, context = None, "not made"
    try:
        lifetime.die_with_parent(coordinator)
        lifetime.close_inherited_fds((0, 1, 2, fd))  # the other ranks' pipes: their EOF
        with contextlib.suppress(Exception):  # a rank that cannot init CUDA says so itself
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
            torch.cuda.synchronize()
            _warm_context(torch)
            context = f"made on GPU {torch.cuda.current_device()}"
        message = lifetime.wait_for(fd)
        if message is not None:
            enter_rank(message["log"], message["env"])  # as a forked rank starts
            print(f"rank {rank}: a rank spare made ahead of its request (CUDA context: {context})")
            _fresh_project(message["root"])
            from harness.child import spawned_rank

            spawned_rank(json.dumps(message["request"]))
    except BaseException:  # as _child's: its log (if it got that far) says why
        traceback.print_exc()
    finally:
        os._exit(70 if message is not None else 0)


def _warm_context(torch) -> None:
    """In a spare, after its context: Triton's device properties, read once per process at
    its first kernel load (0.02-0.1 s of a scenario on an H200), no device memory touched.
    Not torch's stream pool (every stream of every priority, made at the first
    torch.cuda.Stream()): with it made here too, three back-to-back checks of eight scenarios
    measured 2.19 s (median) against 1.68 s without (one H200, one run each), the spares
    likely slower to make again."""
    from triton.compiler import compiler

    shared = getattr(compiler, "max_shared_mem", None)  # cached per process by Triton
    if shared is not None:
        shared(torch.cuda.current_device())


def _fork(run, *args) -> int:
    """fork(); the child calls run(*args), which never returns. Output flushed first, so the
    child does not repeat the server's buffered log."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        run(*args)
    return pid


class _Spare:
    """A spare child waiting for its request on a pipe (a warm cuda server's, per GPU and
    number of ranks): one with its CUDA context made, or a coordinator with its ranks made."""

    def __init__(self, request: dict, server_pid: int, key: tuple[str | None, int]) -> None:
        self.key = key  # (GPU, ranks)
        self.env = request.get("env")  # it serves only requests with this environment
        read, self.fd = os.pipe()
        if key[1] > 1:
            self.pid = _fork(_group_main, request, server_pid, read, key[1])
        else:
            self.pid = _fork(_spare_main, request, server_pid, read)
        os.close(read)
        self.pidfd = os.pidfd_open(self.pid)

    def fits(self, request: dict) -> bool:
        return request.get("env") == self.env

    def hand_over(self, message: dict) -> bool:
        """Write it the message (then it runs it); False when it died meanwhile."""
        fd, self.fd = self.fd, None
        return lifetime.hand_over(fd, message)

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # EOF: a waiting spare exits
        lifetime.kill_group(self.pid)
        os.waitpid(self.pid, 0)
        os.close(self.pidfd)


def _key(request: dict) -> tuple[str | None, int]:
    """The pool a request's spare comes from: its GPU and its number of ranks."""
    ranks = request.get("spec", {}).get("ranks", 1)  # none: the server's own first spares
    return request.get("gpu"), max(ranks, 1)


def _message(line: bytes) -> dict | None:
    """A request or a stop, or None: not one."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    if message.get("stop") is True:
        return message
    request = message.get("request")
    if not (
        isinstance(message.get("id"), int)
        and isinstance(message.get("root"), str)
        and isinstance(request, dict)
        and isinstance(request.get("log"), str)
        and isinstance(request.get("spec"), dict)
        and isinstance(request.get("gpu"), str | None)
        and type(request["spec"].get("ranks", 1)) is int
    ):
        return None
    request.pop(RANK_SPARES, None)  # a spare coordinator's own: never a client's
    return message


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


class _Orphan(int):
    """The pid of a child reaped when its exit comes: one whose connection is gone (killed), or
    a spare coordinator let go (it reaps its ranks first)."""


class _Server:
    """The event loop: connections, their requests, and their children's exits."""

    def __init__(
        self, versions: dict[str, str], listener: socket.socket | None = None, spares: bool = False
    ) -> None:
        self.versions, self.listener, self.pid = versions, listener, os.getpid()
        self.sources = own_sources()
        self.selector = selectors.DefaultSelector()
        self.connections: set[_Connection] = set()
        self.orphans: set[int] = set()  # pidfds of killed children not yet reaped
        # by (GPU, ranks): the spares, and the request they are made like
        self.spares: dict[tuple[str | None, int], list[_Spare]] | None = {} if spares else None
        self.spare_for: dict[tuple[str | None, int], dict] = {}
        self.last_active, self.stopping = time.monotonic(), False
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ, "listener")

    def add(self, sock: socket.socket) -> None:
        conn = _Connection(sock)
        sock.settimeout(SEND_S)  # a peer that does not read cannot stall the server
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        hello = {
            "ready": True,
            "protocol": PROTOCOL,
            "pid": self.pid,
            "versions": self.versions,
            "sources": self.sources,
        }
        if not _send(sock, hello):
            self.drop(conn)

    def _accept(self) -> None:
        """A client of this uid only (SO_PEERCRED): any other gets no hello, only a close."""
        sock = self.listener.accept()[0]
        try:
            mine = peer(sock)[1] == os.getuid()
        except OSError:  # gone already
            mine = False
        if not mine:
            sock.close()
            return
        self.add(sock)

    def drop(self, conn: _Connection) -> None:
        """The connection's client is gone: nothing of its run may outlive it. Each child is
        killed and reaped when its exit comes, not waited for here: a child its client decided
        by its report may still be leaving (the driver tearing its CUDA context down, most of a
        second after a fault), and the next client's requests must not queue behind it."""
        for pidfd, (_, pid) in conn.children.items():
            lifetime.kill_group(pid)
            self.selector.modify(pidfd, selectors.EVENT_READ, _Orphan(pid))
            self.orphans.add(pidfd)
        conn.children.clear()
        self.selector.unregister(conn.sock)
        conn.sock.close()
        self.connections.discard(conn)
        self.last_active = time.monotonic()

    def run(self, idle_s: float | None = None, listening: Callable[[], bool] | None = None) -> None:
        """Serve until stopped; a private server until its client leaves, a warm one until idle
        for idle_s or until `listening()` (its socket file is there) turns false."""
        while not self.stopping:
            for key, _ in self.selector.select(timeout=1.0 if listening else None):
                self._event(key)
            if listening is None and not self.connections:
                return  # a private server: its one client is gone
            if listening is not None and self._should_exit(idle_s, listening):
                return
        for conn in list(self.connections):
            self.drop(conn)
        for pool in list((self.spares or {}).values()):
            for spare in list(pool):
                self._discard_spare(spare)
        for pidfd in list(self.orphans):  # the server leaves last
            self._reap_orphan(pidfd)

    def _event(self, key: selectors.SelectorKey) -> None:
        """One ready descriptor of a round; an event made stale earlier in the round (its
        connection dropped, its spare taken or let go) is passed over."""
        if key.data == "listener":
            self._accept()
        elif isinstance(key.data, _Connection):
            if key.data in self.connections:
                self._read(key.data)
        elif isinstance(key.data, _Spare):  # it exited unused
            if key.data in (self.spares or {}).get(key.data.key, []):
                self._discard_spare(key.data)
        elif isinstance(key.data, _Orphan):
            self._reap_orphan(key.fd)
        elif key.data[1] in key.data[0].children:
            self._reaped(*key.data)

    def _reap_orphan(self, pidfd: int) -> None:
        pid = self.selector.get_key(pidfd).data
        self.selector.unregister(pidfd)
        os.close(pidfd)
        self.orphans.discard(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def _should_exit(self, idle_s: float | None, listening: Callable[[], bool]) -> bool:
        """Idle (no client, so no child) for idle_s, or the socket file was removed."""
        quiet = time.monotonic() - self.last_active
        idle = not self.connections and idle_s is not None and quiet > idle_s
        return idle or not listening()

    def _read(self, conn: _Connection) -> None:
        """The connection's complete requests; a peer that hangs up (even with a reset), sends
        what is not a request or a line longer than MAX_LINE is dropped, nothing else."""
        try:
            chunk = conn.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        *lines, conn.pending = (conn.pending + chunk).split(b"\n")
        if not chunk or len(conn.pending) > MAX_LINE:
            self.drop(conn)
            return
        for line in lines:
            message = _message(line)
            if message is None:
                self.drop(conn)
                return
            if message.get("stop"):
                self.stopping = True
                return
            if conn not in self.connections:
                return
            why = self._refusal(message)
            if why is not None:
                if not _send(conn.sock, {"id": message["id"], "refused": why}):
                    self.drop(conn)
                continue
            self._fork(conn, message)

    def _refusal(self, message: dict) -> str | None:
        """Why this server must not run `message`: its tree holds other copies of the modules
        the server runs from memory (None: it may)."""
        changed = differing(self.sources, message["root"])
        if not changed:
            return None
        return (
            f"the warm server (pid {self.pid}) runs older copies of {', '.join(changed)} "
            f"than {message['root']} holds"
        )

    def _fork(self, conn: _Connection, message: dict) -> None:
        pid, pidfd = self._take_spare(message)
        if pid is None:
            pid = _fork(_child, message, self.pid)
            pidfd = os.pidfd_open(pid)
        conn.children[pidfd] = (message["id"], pid)
        self.selector.register(pidfd, selectors.EVENT_READ, (conn, pidfd))
        self.last_active = time.monotonic()
        if not _send(conn.sock, {"id": message["id"], "pid": pid}):
            self.drop(conn)
            return
        self._make_spare(message["request"])

    # -- spares (a warm cuda server) --------------------------------------------------------------

    def _take_spare(self, message: dict) -> tuple[int | None, int | None]:
        """(pid, pidfd) of the spare that now runs `message`, the oldest (its context the likeliest
        made; for a scenario of ranks, a coordinator whose ranks are made); (None, None) when
        none fits."""
        request = message["request"]
        pool = (self.spares or {}).get(_key(request), [])
        while pool:
            spare = pool.pop(0)
            if spare.fits(request) and spare.hand_over(message):
                self.selector.unregister(spare.pidfd)
                return spare.pid, spare.pidfd
            self._let_go(spare)  # of another environment, or it died meanwhile
        return None, None

    def _make_spare(self, request: dict) -> None:
        """Spares from now on are made like `request` on its GPU, with its number of ranks (the
        newest environment wins)."""
        key = _key(request)
        if self.spares is None or key[1] > MAX_SPARE_RANKS:
            return
        self.spare_for.pop(key, None)  # the newest last
        self.spare_for[key] = request
        ranked = [k for k in self.spare_for if k[1] > 1]
        for old in ranked[: max(0, len(ranked) - RANK_SIZES)]:  # the oldest numbers of ranks
            del self.spare_for[old]
            for spare in list(self.spares.get(old, [])):
                self._discard_spare(spare)
        self._top_up()

    def _top_up(self) -> None:
        """Each pool up to SPARES (RANK_GROUPS for scenarios of ranks)."""
        for key, request in self.spare_for.items():
            pool = self.spares.setdefault(key, [])
            for spare in [s for s in pool if not s.fits(request)]:
                self._discard_spare(spare)
            while len(pool) < (SPARES if key[1] == 1 else RANK_GROUPS):
                spare = _Spare(request, self.pid, key)
                pool.append(spare)
                self.selector.register(spare.pidfd, selectors.EVENT_READ, spare)

    def _discard_spare(self, spare: _Spare) -> None:
        self.spares[spare.key].remove(spare)
        self._let_go(spare)

    def _let_go(self, spare: _Spare) -> None:
        """A spare out of its pool: a coordinator of ranks is told (EOF), lets its ranks go and
        reaps them, and is reaped when its exit comes; any other is killed and reaped now."""
        if spare.key[1] > 1 and spare.fd is not None:
            os.close(spare.fd)
            spare.fd = None
            self.selector.modify(spare.pidfd, selectors.EVENT_READ, _Orphan(spare.pid))
            self.orphans.add(spare.pidfd)
            return
        self.selector.unregister(spare.pidfd)
        spare.discard()

    def _reaped(self, conn: _Connection, pidfd: int) -> None:
        rid, pid = conn.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.last_active = time.monotonic()
        if not _send(conn.sock, {"id": rid, "returncode": os.waitstatus_to_exitcode(status)}):
            self.drop(conn)
        if self.spares is not None:
            self._top_up()


def serve(device: str, fd: int) -> None:
    """A private server for the client at the other end of socket FD."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides; it closes the socket
    sock = socket.socket(fileno=fd)
    server = _Server(_preload(device))
    server.add(sock)
    server.run()


def serve_warm(device: str, directory_fd: int, idle_s: float) -> None:
    """A warm server listening in the user's directory (inherited open, checked again here), as
    the only one for `device` there: it holds the directory's lock file while it runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    directory = UserDirectory.adopt(directory_fd)
    environment = dict(os.environ)  # a client's child_env() from the same shell: the spares'
    name = f"server-{device}.sock"
    lock = directory.open_file(f"server-{device}.lock", os.O_RDWR | os.O_CREAT)
    if not _take_lock(lock, LOCK_WAIT_S):
        print(f"another warm server for {device} runs in {directory.path}: not started", flush=True)
        return
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())  # who holds it: `repro serve --status` says
    versions = _preload(device)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory.unlink(name)
    umask = os.umask(0o177)  # the socket is born 0600
    try:
        listener.bind(directory.address(name))
    finally:
        os.umask(umask)
    listener.listen(64)
    try:
        server = _Server(versions, listener, spares=device == "cuda")
        if device == "cuda":  # the first check finds spares made in the server's environment
            server._make_spare({"env": environment})
        server.run(idle_s, lambda: directory.exists(name))
    finally:
        listener.close()
        directory.unlink(name)


def _take_lock(fd: int, wait_s: float) -> bool:
    """flock(fd) within `wait_s` (a stale server told to stop still holds it for a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
