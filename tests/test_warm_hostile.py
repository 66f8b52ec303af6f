"""A warm server (`repro serve`) against what can happen to it, on the run's device (the CPU job
runs them on cpu, .ci/gpu with a cuda server): stopped or hung, it is named by `--status`, ended
by `--stop` and replaced by the next run within seconds; a peer that hangs up, resets, sends
garbage or half a message, or never reads does not kill it; it never serves a tree whose copies
of its own modules differ from the ones it runs from memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys

import pytest

from harness.userdir import ENV_SERVER_DIR
from tests import procs
from tests.test_bisect import Repo

WARM = {"REPRO_SERVER": "auto"}  # conftest turns warm servers off for the tests themselves
SCENARIOS = {"cpu": "last_slot_rows", "cuda": "last_slot_rows"}


def repro(*argv: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real entry point (`python -m repro`), in `cwd` (default: this tree)."""
    return subprocess.run(
        [sys.executable, "-m", "repro", *argv],
        cwd=cwd or procs.ROOT,
        env={**os.environ, **WARM},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def warm(tmp_path, monkeypatch, device):
    """A warm server of the run's device in a directory of this test's; (pid, socket path). No
    process of the test outlives it."""
    monkeypatch.setenv(ENV_SERVER_DIR, str(tmp_path / "servers"))
    monkeypatch.setenv(procs.TAG, procs.new_tag())
    started = repro("serve", "--device", device, "--idle", "300")
    assert started.returncode == 0, started.stdout + started.stderr
    directory = tmp_path / "servers" / f"repro-{os.getuid()}"
    yield server_pid(device), directory / f"server-{device}.sock"
    for pid in procs.tagged(os.environ[procs.TAG]):
        os.kill(pid, signal.SIGCONT)
    repro("serve", "--device", device, "--stop")
    assert procs.survivors(os.environ[procs.TAG], timeout_s=30.0) == []


def server_pid(device: str) -> int:
    status = repro("serve", "--device", device, "--status").stdout
    assert "warm server at" in status, status
    return int(status.split(", pid ")[1].split(",")[0])


def check(device: str, cwd=None) -> subprocess.CompletedProcess:
    return repro(
        "check", "moe_align_grid", "--device", device, "--scenario", SCENARIOS[device], cwd=cwd
    )


# -- 3. stopped or hung -------------------------------------------------------------------------


def test_a_stopped_server_is_named_stopped_and_replaced(warm, device) -> None:
    pid, _ = warm
    os.kill(pid, signal.SIGSTOP)
    status = repro("serve", "--device", device, "--status")
    assert status.returncode == 0
    assert f"does not answer (pid {pid}, state T (stopped), running since " in status.stdout
    first = check(device)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"the warm {device} server did not answer (pid {pid}" in first.stderr
    assert procs.wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10.0)
    fresh = procs.wait_until(
        lambda: "warm server at" in repro("serve", "--device", device, "--status").stdout, 120.0
    )
    assert fresh, "no fresh warm server after the stopped one was killed"
    second = check(device)  # served warm: no warning, no replacement
    assert second.returncode == 0 and second.stderr == "", second.stdout + second.stderr


def test_stop_ends_a_stopped_server(warm, device) -> None:
    pid, sock = warm
    os.kill(pid, signal.SIGSTOP)
    stopped = repro("serve", "--device", device, "--stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert (
        f"killed the warm {device} server that holds its lock does not answer (pid {pid}"
        in stopped.stdout
    )
    assert procs.wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10.0)
    assert not sock.exists()
    assert "no warm server" in repro("serve", "--device", device, "--status").stdout


def test_serve_replaces_a_hung_server(warm, device) -> None:
    pid, _ = warm
    os.kill(pid, signal.SIGSTOP)
    again = repro("serve", "--device", device, "--idle", "300")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"killed the warm {device} server" in again.stdout
    assert server_pid(device) != pid


# -- 3b. what a peer does on the socket -----------------------------------------------------------


def hello_of(sock: socket.socket) -> dict:
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed the connection before its hello"
        data += chunk
    return json.loads(data.split(b"\n")[0])


def peer(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


def reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client's kernel may."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


PEERS = {
    "closes without reading its hello": lambda s: s.close(),
    "resets": reset,
    "reads its hello, then resets": lambda s: (hello_of(s), reset(s)),
    "sends garbage": lambda s: (s.sendall(b"\x00\xffnot json\n"), s.close()),
    "sends a list": lambda s: (s.sendall(b"[1, 2]\n"), s.close()),
    "sends a request without its fields": lambda s: (s.sendall(b'{"id": 1}\n'), s.close()),
    "sends half a message": lambda s: (s.sendall(b'{"id": 1, "root": "/'), s.close()),
    "sends an endless line": lambda s: (s.sendall(b"x" * (2 << 20)), s.close()),
}


@pytest.mark.parametrize("what", list(PEERS))
def test_a_peer_cannot_kill_the_server(warm, device, what) -> None:
    pid, sock_path = warm
    for _ in range(3):
        with contextlib.suppress(OSError):  # dropped first (an endless line): its right
            PEERS[what](peer(sock_path))
    idle = peer(sock_path)  # a peer that never reads nor writes, while a check runs
    try:
        done = check(device)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stderr == "", done.stderr  # served warm: no replacement, no warning
        assert os.path.exists(f"/proc/{pid}") and server_pid(device) == pid
    finally:
        idle.close()


# -- 4. the server's own code ----------------------------------------------------------------------


def test_a_server_never_runs_its_own_stale_code(tmp_path, monkeypatch, device) -> None:
    """Started in a checkout whose forkserver then changes: the next check there does not run on
    the old copy held in memory (which would say absent); it runs the new one (which breaks)."""
    monkeypatch.setenv(ENV_SERVER_DIR, str(tmp_path / "servers"))
    monkeypatch.setenv(procs.TAG, procs.new_tag())
    repo = Repo(tmp_path / "tree")
    try:
        assert repro("serve", "--device", device, "--idle", "300", cwd=repo.path).returncode == 0
        same = check(device, cwd=repo.path)
        assert same.returncode == 0 and same.stderr == "", same.stdout + same.stderr
        repo.edit(
            "harness/forkserver.py",
            '    """Forget inherited project modules; import them from `root` from now on."""\n',
            '    """Forget inherited project modules; import them from `root` from now on."""\n'
            '    raise RuntimeError("the new _fresh_project")\n',
        )
        changed = check(device, cwd=repo.path)
        assert changed.returncode == 125, changed.stdout + changed.stderr
        assert "absent" not in changed.stdout
    finally:
        repro("serve", "--device", device, "--stop", cwd=repo.path)
        assert procs.survivors(os.environ[procs.TAG], timeout_s=30.0) == []


def test_the_server_refuses_a_tree_whose_copies_differ(warm, device, tmp_path) -> None:
    """Asked directly (a client that does not look at the hello's sources): refused, one line."""
    _, sock_path = warm
    other = Repo(tmp_path / "other")
    (other.path / "harness" / "lifetime.py").write_text("# another copy\n")
    sock = peer(sock_path)
    hello = hello_of(sock)
    assert "harness/forkserver.py" in hello["sources"]
    request = {"log": str(tmp_path / "log"), "report": str(tmp_path / "report"), "spec": {}}
    sock.sendall(
        (json.dumps({"id": 7, "root": str(other.path), "request": request}) + "\n").encode()
    )
    data = b""
    while b"\n" not in data:
        data += sock.recv(1 << 16)
    answer = json.loads(data.split(b"\n")[0])
    sock.close()
    assert answer["id"] == 7 and "harness/lifetime.py" in answer["refused"], answer
