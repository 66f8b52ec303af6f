"""The warm server (`repro serve`) and the spread of cuda children over the caller's GPUs."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness import device as devices
from harness import forkserver, isolate, lifetime, ranks, servers
from harness.fixes import ALL_FIXES
from harness.isolate import Isolator, Job
from harness.outcome import Outcome
from harness.userdir import ENV_SERVER_DIR, UserDirectory
from tests import procs
from tests.test_bisect import CHECK_GRID, GRID_FIX, Repo


@pytest.fixture
def server_dir(tmp_path, monkeypatch):
    """Warm servers of this test only: their own socket directory."""
    monkeypatch.setenv(ENV_SERVER_DIR, str(tmp_path / "servers"))
    monkeypatch.setenv(servers.ENV_SERVER, "auto")  # conftest turns warm servers off
    monkeypatch.setenv(procs.TAG, procs.new_tag())
    yield tmp_path / "servers"
    subprocess.run(procs.repro_command("serve", "--device", "cpu", "--stop"), check=False)
    # a rank spare still making its CUDA context reads its coordinator's EOF only once done;
    # one not gone within LET_GO_S is killed (on a loaded H200, 10 s was once too short)
    assert procs.survivors(os.environ[procs.TAG], forkserver.LET_GO_S + 10.0) == []


def repro_in(repo: Repo, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "repro", *argv],
        cwd=repo.path,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_warm_server_runs_the_new_code_after_a_checkout(server_dir, tmp_path) -> None:
    repo = Repo(tmp_path / "repo")
    started = repro_in(repo, "serve", "--device", "cpu", "--idle", "120")
    assert started.returncode == 0 and "warm server at" in started.stdout, started.stdout
    # Only the warm server can serve from here on: a private one would import a broken numpy.
    (tmp_path / "broken" / "numpy").mkdir(parents=True)
    (tmp_path / "broken" / "numpy" / "__init__.py").write_text("raise ImportError('no')\n")
    env = {"PYTHONPATH": str(tmp_path / "broken")}
    before = repro_in(repo, "check", *CHECK_GRID, env=env)
    assert before.returncode == 0, before.stdout + before.stderr
    repo.edit("kernels/moe_lora_align.py", GRID_FIX, "num_slots = max_loras")
    repo.commit("the align grid one slot short again")  # as a checkout of that commit would
    after = repro_in(repo, "check", *CHECK_GRID, env=env)
    assert after.returncode == 1, after.stdout + after.stderr
    assert "moe_align_grid [fixed, cpu]: PRESENT" in after.stdout


def test_a_warm_server_exits_when_idle_and_when_its_socket_goes(server_dir) -> None:
    socket_path = server_dir / f"repro-{os.getuid()}" / "server-cpu.sock"
    for how in ("idle", "socket removed"):
        idle = "1" if how == "idle" else "600"
        done = subprocess.run(
            procs.repro_command("serve", "--device", "cpu", "--idle", idle), capture_output=True
        )
        assert done.returncode == 0 and socket_path.exists()
        if how == "socket removed":
            socket_path.unlink()
        gone = procs.wait_until(lambda: not procs.tagged(os.environ[procs.TAG]), 30.0)
        assert gone, f"the warm server outlived its {how}"


def connect(device: str) -> servers.Server | None:
    with UserDirectory.open() as directory:
        return servers.Server.connect(device, directory)


def test_a_stale_warm_server_is_replaced(server_dir, monkeypatch) -> None:
    assert subprocess.run(procs.repro_command("serve", "--device", "cpu")).returncode == 0
    first = connect("cpu")
    first.sock.close()
    with monkeypatch.context() as patch:  # the installation changed under the warm server
        patch.setattr(servers, "installed_versions", lambda: {"torch": "0.0.0"})
        with Isolator("fork") as isolator:
            assert isolator._warm_server("cpu") is None
    assert procs.wait_until(lambda: not isolate._alive(first.pid), 30.0), "the stale one stays"
    fresh = procs.wait_until(lambda: connect("cpu"), 120.0, 0.2)
    assert fresh is not None and fresh.pid != first.pid, "no fresh warm server replaced it"
    fresh.sock.close()


def test_installed_versions_are_the_package_metadatas_without_importing_it() -> None:
    """What a server and its client compare (a server preloaded other versions: stale), read
    from the dist-info names; importlib.metadata agrees, and the client never imports it."""
    from importlib import metadata

    versions = forkserver.installed_versions()
    assert versions == {name: metadata.version(name) for name in versions}
    code = "import sys, repro.commands; print('importlib.metadata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


def test_cuda_children_are_spread_over_the_callers_gpus(monkeypatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: ["3", "5"])
    jobs = [Job("test", "passes", "tests.children:passes", ALL_FIXES, "cuda", 60)] * 4
    with Isolator("fork") as isolator:
        results = isolator.run_all(jobs, workers=4)
    assert sorted(r.gpu for r in results) == ["3", "3", "5", "5"]
    for r in results:  # here no GPU answers: each child says which one it was given
        assert r.outcome == Outcome.SKIPPED and f"CUDA_VISIBLE_DEVICES={r.gpu}" in r.evidence


def _children(pid: int) -> set[int]:
    """The live children of `pid` (a warm server's spares, when none of its runs is left)."""
    found = {int(p.name) for p in procs.Path("/proc").iterdir() if p.name.isdigit()}
    return {child for child in found if procs.parent_of(child) == pid}


def _warm_cuda_client() -> servers.Server:
    with UserDirectory.open() as directory:
        servers.start_warm("cuda", 120.0, directory)
    client = procs.wait_until(lambda: connect("cuda"), 120.0, 0.2)
    assert client is not None, "the warm cuda server did not start"
    return client


def _request(
    client: servers.Server,
    directory,
    rid: int,
    env: dict,
    ranks: int = 1,
    target: str = "passes",
    device: str = "cuda",
):
    """(pid, report) of one request of a tests.children scenario (of `ranks` ranks on `device`)
    in `directory`."""
    job = Job("test", target, f"tests.children:{target}", ALL_FIXES, device, 60, ranks=ranks)
    directory.mkdir()
    request = {**job.request(directory), "env": env, "gpu": None}
    assert client.send({"id": rid, "root": str(procs.ROOT), "request": request})
    pid, returncode = None, None
    while returncode is None:
        for message in client.receive() or pytest.fail("the server went away"):
            pid = message.get("pid", pid)
            returncode = message.get("returncode", returncode)
    assert returncode == 0
    return pid, isolate._read_report(directory / "report.json")


def test_a_warm_cuda_server_runs_the_next_like_request_in_a_spare(server_dir, tmp_path) -> None:
    """A warm cuda server keeps SPARES spares (CUDA context made, no project imported), made in
    its own environment from its start; a request with the same environment and
    GPU runs in one, any other gets a fresh fork and the pool is made again in its environment;
    a scenario of ranks gets no such spare (it forks its ranks: no CUDA context may exist). Here
    without a GPU the children say so (skipped)."""
    client = _warm_cuda_client()
    env = servers.child_env()

    def pool() -> set[int] | None:
        """The server's children when they are a full pool of spares (no run in flight)."""
        found = _children(client.pid)
        return found if len(found) == forkserver.SPARES else None

    try:
        spares = procs.wait_until(pool, 60.0)
        assert spares, f"no pool of {forkserver.SPARES} spares at start: {_children(client.pid)}"
        first_pid, first = _request(client, tmp_path / "1", 1, env)
        assert first_pid in spares, "a request of the server's environment did not use a spare"
        assert first["status"] in ("pass", "skipped")
        again = procs.wait_until(lambda: (found := pool()) and first_pid not in found and found)
        assert again, "the pool was not topped up"
        second_pid, second = _request(client, tmp_path / "2", 2, {**env, "REPRO_TEST_OTHER": "1"})
        assert second_pid not in again, "a spare ran a request of another environment"
        assert second["status"] == first["status"]
        renewed = procs.wait_until(lambda: (found := pool()) and not found & again and found)
        assert renewed, "the spares of the old environment stay, or none of the new are made"
        ranked_pid, ranked = _request(
            client, tmp_path / "3", 3, {**env, "REPRO_TEST_OTHER": "1"}, 2
        )
        assert ranked_pid not in renewed, "a scenario of ranks ran in a spare (a CUDA context)"
        # its coordinator reports the ranks' verdict as {"status": "ranks", "outcome": ...}
        assert ranked.get("outcome", ranked["status"]) == first["status"], ranked
    finally:
        client.send({"stop": True})
        client.sock.close()


def _rank_logs(directory) -> str:
    return "".join(p.read_text() for p in sorted((directory / "ranks").glob("rank-*.log")))


def _gone(pids: set[int]) -> bool:
    """None of `pids` is left, not even as a zombie."""
    return not any(procs.Path(f"/proc/{pid}").exists() for pid in pids)


def _dead(pids: set[int]) -> bool:
    """Each of `pids` has exited (a zombie, or gone)."""
    entries = [procs.Path(f"/proc/{pid}") for pid in pids]
    return all(not e.exists() or procs._zombie(e) for e in entries)


def test_a_warm_cuda_server_keeps_coordinators_with_their_ranks_made(server_dir, tmp_path) -> None:
    """Once a scenario of N ranks came, a warm cuda server keeps RANK_GROUPS spare coordinators
    of N ranks, each with its N ranks forked ahead (their CUDA contexts made, no project
    imported): the next scenario of N ranks in that environment runs in one, each rank handed
    its request, with a fresh coordinator's verdict (a pass; a rank's crash). A rank spare that
    died is replaced by a forked rank. A coordinator let go (another environment) reaps its
    ranks: none is left, not even a zombie. A scenario of another number of ranks gets a fresh
    coordinator. The ranks here are the CPU's (gloo): real verdicts, GPU or not."""
    client = _warm_cuda_client()
    env = servers.child_env()

    def groups(pid: int) -> set[int] | None:
        """The server's spare coordinators, once RANK_GROUPS have their two ranks each and
        `pid` (the last run) is gone."""
        found = {p for p in _children(client.pid) if len(_children(p)) == 2}
        ok = len(found) == forkserver.RANK_GROUPS and pid not in _children(client.pid)
        return found if ok else None

    def run(rid: int, target: str = "passes", ranks: int = 2, environment: dict = env):
        return _request(client, tmp_path / str(rid), rid, environment, ranks, target, "cpu")

    try:
        first_pid, first = run(1)
        assert first["status"] == "pass", first
        assert "a rank spare" not in _rank_logs(tmp_path / "1"), "no coordinator was made yet"
        made = procs.wait_until(lambda: groups(first_pid), 60.0)
        assert made, f"no {forkserver.RANK_GROUPS} coordinators of 2 ranks: {_children(client.pid)}"
        second_pid, second = run(2, "rank_one_segfaults")
        assert second_pid in made, "a scenario of 2 ranks did not run in a spare coordinator"
        logs = _rank_logs(tmp_path / "2")
        assert logs.count("a rank spare made ahead of its request") == 2, logs
        assert second.get("outcome") == "illegal_address", second
        assert second["detail"].startswith("rank 1: illegal_address: killed by SIGSEGV"), second
        made = procs.wait_until(lambda: groups(second_pid), 60.0)
        assert made, f"the coordinators were not made again: {_children(client.pid)}"
        spares = {r for g in made for r in _children(g)}
        for rank in spares:  # every rank spare dies
            os.kill(rank, signal.SIGKILL)
        assert procs.wait_until(lambda: _dead(spares), 30.0), "a killed rank spare lives on"
        third_pid, third = run(3)
        assert third_pid in made and third["status"] == "pass", third
        assert "a rank spare" not in _rank_logs(tmp_path / "3"), "a dead rank spare was used"
        made = procs.wait_until(lambda: groups(third_pid), 60.0)
        assert made, f"the coordinators were not made again: {_children(client.pid)}"
        spares = {r for g in made for r in _children(g)}
        fourth_pid, fourth = run(4, environment={**env, "REPRO_TEST_OTHER": "1"})
        assert fourth_pid not in made and fourth["status"] == "pass", fourth
        assert procs.wait_until(lambda: _gone(spares | made), 30.0), "ranks of a coordinator let go"
        fifth_pid, fifth = run(5, ranks=3)
        assert fifth_pid not in made and fifth["status"] == "pass", fifth
        assert "a rank spare" not in _rank_logs(tmp_path / "5"), "3 ranks ran in spares of 2"
        # coordinators for the newest RANK_SIZES numbers of ranks only: 4 ranks drop those of 2
        assert forkserver.RANK_SIZES == 2
        _, sixth = run(6, ranks=4, environment={**env, "REPRO_TEST_OTHER": "1"})
        assert sixth["status"] == "pass", sixth

        def sizes() -> list[int]:
            return sorted(len(_children(p)) for p in _children(client.pid) if _children(p))

        want = [3] * forkserver.RANK_GROUPS + [4] * forkserver.RANK_GROUPS
        assert procs.wait_until(lambda: sizes() == want, 60.0), sizes()
    finally:
        client.send({"stop": True})
        client.sock.close()


def test_the_server_refuses_what_is_no_request_and_strips_a_clients_rank_spares() -> None:
    """A request needs a dict spec, a GPU that is a string or none, a whole number of ranks;
    the rank spares a spare coordinator adds to its own request are never a client's (their
    pids would be killed, their descriptors written)."""
    spec = {"target": "tests.children:passes", "fixes": [], "device": "cuda", "seed": 0}

    def message(**request) -> bytes:
        request = {"log": "/dev/null", "spec": spec, **request}
        return json.dumps({"id": 1, "root": str(procs.ROOT), "request": request}).encode()

    assert forkserver._message(message()) is not None
    assert forkserver._message(message(gpu="1", spec={**spec, "ranks": 2})) is not None
    for bad in ({"spec": "x"}, {"gpu": 1}, {"spec": {**spec, "ranks": "2"}}):
        assert forkserver._message(message(**bad)) is None, bad
    for bad in (2.0, True):
        assert forkserver._message(message(spec={**spec, "ranks": bad})) is None, bad
    stripped = forkserver._message(message(rank_spares=[[1, 2]]))
    assert ranks.RANK_SPARES not in stripped["request"]


def test_a_spares_event_made_stale_in_its_round_is_passed_over() -> None:
    """A spare that exits while a request of the same round takes it or lets it go: its exit
    event, already read, must not be handled as an unused spare's (it was, and the server
    died of the ValueError). Here the server's own spares, made without a GPU, stand in."""
    server = forkserver._Server(forkserver.installed_versions(), spares=True)
    try:
        server._make_spare({"env": dict(os.environ)})
        spare = server.spares[(None, 1)][0]
        stale = server.selector.get_key(spare.pidfd)
        server._discard_spare(spare)  # earlier in the round: let go
        server._event(stale)  # then its exit's event, read before
        assert spare not in server.spares[(None, 1)]
    finally:
        server.spare_for.clear()
        for pool in server.spares.values():
            for other in list(pool):
                server._discard_spare(other)


def test_the_server_runs_the_writer_of_its_rank_spares_message() -> None:
    """harness.ranks writes the message a rank spare of the server reads (_rank_spare_main):
    the server imports that module, so it is among the sources a client compares with its
    tree, and a tree whose writer differs replaces the server rather than talk past it."""
    code = "from harness import forkserver; print(*sorted(forkserver.own_sources()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=procs.ROOT, capture_output=True, text=True, check=True
    )
    assert "harness/ranks.py" in done.stdout.split(), done.stdout


def test_rank_spares_let_go_exit_and_are_reaped() -> None:
    """Rank spares handed no request (a coordinator let go, or a run that broke before its
    ranks): EOF on each pipe; one that exits on it is reaped, one that does not is killed once
    the wait is over. Here two stand-ins wait on their pipes as rank spares do."""

    def spare(ignores_eof: bool) -> list[int]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            lifetime.close_inherited_fds((0, 1, 2, read))  # as a rank spare: no other's pipe
            os.read(read, 1)  # EOF
            while ignores_eof:
                time.sleep(0.05)
            os._exit(0)
        os.close(read)
        return [pid, write]

    polite, stubborn = spare(False), spare(True)
    started = time.monotonic()
    lifetime.let_go([polite, stubborn], 1.0)
    assert time.monotonic() - started >= 1.0, "the stubborn spare was not waited for"
    with pytest.raises(ChildProcessError):  # reaped already
        os.waitpid(polite[0], os.WNOHANG)
    _, status = os.waitpid(stubborn[0], 0)  # killed: its coordinator's exit would reap it
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_gone_clients_leaving_child_does_not_hold_the_server_up() -> None:
    """A client decides a child by its report and may leave while the child still exits (the
    driver tearing its CUDA context down). The server kills and reaps that child as its exit
    comes, never waiting for it: the next client is served at once. Here the child is one the
    kill cannot reach (not the leader of a group), as one stuck in the driver would be."""
    server = forkserver._Server(forkserver.installed_versions())
    ours, theirs = socket.socketpair()
    server.add(theirs)
    conn = next(iter(server.connections))
    pid = os.fork()
    if pid == 0:  # in this process's group: killpg(pid) finds no such group
        time.sleep(60)
        os._exit(0)
    pidfd = os.pidfd_open(pid)
    conn.children[pidfd] = (1, pid)
    server.selector.register(pidfd, selectors.EVENT_READ, (conn, pidfd))
    try:
        server.drop(conn)  # waiting here for the child would take its whole minute
        assert procs.alive(pid), "the child was reaped: dropped only after its exit"
        assert server.orphans == {pidfd}
    finally:
        os.kill(pid, 9)
    server._reap_orphan(pidfd)  # its exit came: reaped
    assert server.orphans == set()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    ours.close()
