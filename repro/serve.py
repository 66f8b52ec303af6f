"""`repro serve`: a warm fork server per device, so that a check pays neither for importing
torch nor for starting a server.

    repro serve [--device cpu|cuda|auto] [--idle SECONDS]    start one (or say it runs)
    repro serve --status                                     is one running, with what
    repro serve --stop                                       stop it

The server imports torch, Triton and numpy, never initializes CUDA, and listens on a socket in
this user's directory (harness.userdir: owned by this user, mode 0700, checked at every use;
elsewhere nothing starts), for clients of its own uid only; one server per socket (a lock).
`--status` and `--stop` never start one. A server that holds the lock but does not answer (stopped,
hung, still importing torch) is named by `--status` (pid, state, since when) and killed by `--stop`
(it is this user's: same uid, our lock); `repro serve` and any run replace one that took a
connection and said nothing, or is stopped. A cuda server keeps one spare child per GPU with its
CUDA context made (holding that GPU's context memory while it waits) for the next request from the
same environment (harness.forkserver). `run`, `check`, `matrix` and `mutants` use it when it runs
(unless $REPRO_SERVER=off) and start a private server otherwise. Its children import the project
from the caller's tree after the fork, in the caller's environment: a server started before a `git
checkout` runs the new code after it; its own modules (the server's code, held in memory) are
hashed, and a tree whose copies differ is not served by it. One whose torch, Triton or numpy
version no longer matches the installed one, whose protocol is older, or whose own modules differ
from the caller's tree, is stopped and replaced. It exits when idle for --idle seconds (default
600), when stopped, or when its socket is removed.
Exit: 0 (running, stopped, or status printed), 125 it could not start, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from harness import device as devices
from harness.fixes import UsageError
from harness.outcome import EXIT_CANNOT_TEST
from harness.servers import (
    WARM_IDLE_S,
    Holder,
    Server,
    Unresponsive,
    end_holder,
    lock_holder,
    log_name,
    socket_name,
    start_warm,
)
from harness.userdir import UnsafeDirectory, UserDirectory
from repro.common import device_choice, unavailable

START_S = 180.0  # importing torch on a loaded machine


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="keep a warm fork server (torch imported) for later runs")
    s.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    s.add_argument("--idle", type=float, default=WARM_IDLE_S, metavar="SECONDS")
    action = s.add_mutually_exclusive_group()
    action.add_argument("--stop", action="store_true", help="stop the warm server")
    action.add_argument("--status", action="store_true", help="say whether one runs")
    s.set_defaults(run=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.idle) and args.idle > 0):
        raise UsageError(f"--idle must be a finite number of seconds above 0, got {args.idle}")
    device = devices.resolve(device_choice(args.device))
    asking = args.status or args.stop  # never starts a server, never makes the directory
    try:
        directory = UserDirectory.open(create=not asking)
    except UnsafeDirectory as e:
        if asking:
            print(f"{device}: no warm server ({e})")
            return 0
        print(f"{device}: cannot start: {e}")
        return EXIT_CANNOT_TEST
    with directory:
        return _serve(args, device, directory)


def _serve(args: argparse.Namespace, device: str, directory: UserDirectory) -> int:
    try:
        server = Server.connect(device, directory)
        silent = None if server is not None else lock_holder(device, directory)
        hung = silent is not None and silent.stopped
    except Unresponsive as e:
        server, silent, hung = None, e.holder, True
    if args.status:
        print(_describe(device, server, directory) if silent is None else _silent(device, silent))
        return 0
    if silent is not None and (args.stop or hung):  # ours, and of no use to anyone: it goes
        ended = end_holder(silent, device, directory)
        print(f"{device}: {'killed' if ended else 'could not kill'} {_silent(device, silent)}")
        if args.stop or not ended:
            return 0 if ended else EXIT_CANNOT_TEST
    if server is not None and (args.stop or server.stale):
        server.send({"stop": True})
        server.sock.close()
        _wait_gone(device, directory)
    if args.stop:
        print(f"{device}: stopped" if server else f"{device}: no warm server")
        return 0
    if server is not None and not server.stale:
        print(_describe(device, server, directory))
        return 0
    why = unavailable(device)
    if why:
        print(f"{device}: cannot start: {why}")
        return EXIT_CANNOT_TEST
    return _start(device, args.idle, directory)


def _start(device: str, idle_s: float, directory: UserDirectory) -> int:
    """Start one and wait for it to answer. A `repro serve` started at the same moment may win
    the server's lock: then this one's server exits at once and that one answers."""
    log = directory.path / log_name(device)
    try:
        proc = start_warm(device, idle_s, directory)
    except OSError as e:
        print(f"{device}: cannot start: its log {log}: {e.strerror}")
        return EXIT_CANNOT_TEST
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() in (None, 0):
        try:
            server = Server.connect(device, directory)
        except Unresponsive:
            server = None
        if server is not None and not server.stale:
            print(_describe(device, server, directory))
            return 0
        time.sleep(0.2)
    print(f"{device}: the warm server did not start; its log: {log}")
    return EXIT_CANNOT_TEST


def _describe(device: str, server: Server | None, directory: UserDirectory) -> str:
    if server is None:
        return f"{device}: no warm server"
    where = directory.path / socket_name(device)
    versions = json.dumps(server.versions, sort_keys=True)
    stale = " (stale: another installation; the next run replaces it)" if server.stale else ""
    return f"{device}: warm server at {where}, pid {server.pid}, versions {versions}{stale}"


def _silent(device: str, holder: Holder) -> str:
    return (
        f"the warm {device} server that holds its lock does not answer ({holder.describe()}): "
        "stopped, hung or starting"
    )


def _wait_gone(device: str, directory: UserDirectory, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while directory.exists(socket_name(device)) and time.monotonic() < deadline:
        time.sleep(0.05)
