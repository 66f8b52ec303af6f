"""`repro serve`: a warm fork server per device, so that a check pays neither for importing
torch nor for starting a server.

    repro serve [--device cpu|cuda|auto] [--idle SECONDS]    start one (or say it runs)
    repro serve --status                                     is one running, with what
    repro serve --stop                                       stop it

The server imports torch, Triton and numpy, never initializes CUDA, and listens on a socket in
this user's directory (mode 0700). A cuda server keeps one spare child per GPU with its CUDA
context made (holding that GPU's context memory while it waits) for the next request from the
same environment (harness.forkserver). `run`, `check`, `matrix` and `mutants` use it when it
runs (unless $REPRO_SERVER=off) and start a private server otherwise. Its children import the
project from the caller's tree after the fork, in the caller's environment: a server started
before a `git checkout` runs the new code after it. One whose torch, Triton or numpy version no
longer matches the installed one, or whose protocol is older, is stopped and replaced. It exits
when idle for --idle seconds (default 600), when stopped, or when its socket is removed.
Exit: 0 (running, stopped, or status printed), 125 it could not start, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import time

from harness import device as devices
from harness.fixes import UsageError
from harness.isolate import WARM_IDLE_S, _Server, start_warm, warm_log, warm_socket
from harness.outcome import EXIT_CANNOT_TEST
from repro.commands import device_choice, unavailable

START_S = 180.0  # importing torch on a loaded machine


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="keep a warm fork server (torch imported) for later runs")
    s.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    s.add_argument("--idle", type=float, default=WARM_IDLE_S, metavar="SECONDS")
    action = s.add_mutually_exclusive_group()
    action.add_argument("--stop", action="store_true", help="stop the warm server")
    action.add_argument("--status", action="store_true", help="say whether one runs")


def cmd_serve(args: argparse.Namespace) -> int:
    if args.idle <= 0:
        raise UsageError(f"--idle must be positive, got {args.idle}")
    device = devices.resolve(device_choice(args.device))
    server = _Server.connect(device)
    if args.status:
        print(_describe(device, server))
        return 0
    if args.stop:
        if server is not None:
            server.send({"stop": True})
            _wait_gone(device)
        print(f"{device}: stopped" if server else f"{device}: no warm server")
        return 0
    if server is not None:
        print(_describe(device, server))
        return 0
    why = unavailable(device)
    if why:
        print(f"{device}: cannot start: {why}")
        return EXIT_CANNOT_TEST
    proc = start_warm(device, args.idle)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        server = _Server.connect(device)
        if server is not None:
            print(_describe(device, server))
            return 0
        time.sleep(0.2)
    print(f"{device}: the warm server did not start; its log: {warm_log(device)}")
    return EXIT_CANNOT_TEST


def _describe(device: str, server: _Server | None) -> str:
    if server is None:
        return f"{device}: no warm server"
    versions = json.dumps(server.versions, sort_keys=True)
    return f"{device}: warm server at {warm_socket(device)}, versions {versions}"


def _wait_gone(device: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while warm_socket(device).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
