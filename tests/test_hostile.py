"""Verdicts that hold on a hostile machine, on the real `repro` command (CPU): a server directory
squatted by another user, a warm server killed or stopped mid-run, long temp paths, a tree that
does not import, another checkout as the working directory, a killed matrix, malformed result
files, a closed pipe, racing `repro serve`s, a shortened time limit. Exit 1 must mean only that
the code under test failed twice the same way."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import forkserver
from harness.userdir import ENV_SERVER_DIR, UserDirectory
from repro import registry
from repro.results import problem
from tests import procs
from tests.test_bisect import CHECK_GRID, GRID_FIX, Repo, first_bad
from tests.test_faults import DUMMY, child_of_server, first_progress_line, server_of, start

# every command here runs with --device cpu: on a GPU run it would repeat the CPU job
pytestmark = pytest.mark.cpu_job

NOBODY = 65534
WARM = {"REPRO_SERVER": "auto"}  # conftest turns warm servers off for the tests themselves
DUMMY_RUNS = 2 * len(registry.get("lora_dummy_run").scenarios)  # fixed and buggy
# a light matrix for the tests that kill or stop its server: one scenario of about 2 s
LIGHT, LIGHT_RUNS = "block_table_wake", 2 * len(registry.get("block_table_wake").scenarios)


def run(*argv: str, env: dict | None = None, cwd=None, timeout: float = 300):
    return subprocess.run(
        procs.repro_command(*argv),
        env={**os.environ, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def installed(*argv: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [procs.installed_repro(), *argv],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def server_dir(tmp_path, monkeypatch) -> Path:
    """Warm servers of this test only; whatever they are, none outlives it."""
    monkeypatch.setenv(ENV_SERVER_DIR, str(tmp_path / "servers"))
    monkeypatch.setenv(procs.TAG, procs.new_tag())
    yield tmp_path / "servers" / f"repro-{os.getuid()}"
    subprocess.run(procs.repro_command("serve", "--device", "cpu", "--stop"), check=False)
    assert procs.survivors(os.environ[procs.TAG]) == []


def warm_server(tag: str) -> int | None:
    found = [p for p in procs.tagged(tag) if "serve_warm" in procs.cmdline(p)]
    return found[0] if len(found) == 1 else None


# -- 1. a server directory someone else made ------------------------------------------------------

LISTENER = r"""
import os, socket, sys
directory, target = sys.argv[1], sys.argv[2]
os.mkdir(directory)
os.chmod(directory, 0o777)
listener = socket.socket(socket.AF_UNIX)
listener.bind(os.path.join(directory, "server-cpu.sock"))
os.chmod(os.path.join(directory, "server-cpu.sock"), 0o777)
listener.listen(8)
os.symlink(target, os.path.join(directory, "server-cpu.log"))
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    print("connected", flush=True)
    conn.close()
"""


def as_nobody(*command: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]


def nobody_python() -> str:
    """A Python interpreter the second user can run, or a visible skip."""
    if os.getuid() != 0:
        pytest.skip("needs a second user: run as root to act as nobody (setpriv)")
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux) to act as a second user")
    for python in (sys.executable, "/usr/bin/python3"):
        done = subprocess.run(as_nobody(python, "-c", "pass"), capture_output=True, check=False)
        if done.returncode == 0:
            return python
    pytest.skip("no Python interpreter that the user nobody may run")


@pytest.fixture
def squatted(tmp_path, monkeypatch):
    """A temp dir (mode 1777, like /tmp) where nobody made repro-<uid> first (mode 0777), listens
    on its server socket and planted the log as a symlink to a root-only file."""
    python = nobody_python()
    base = Path(tempfile.mkdtemp(prefix="repro-squat-", dir="/tmp"))
    base.chmod(0o1777)
    secret = tmp_path / "root-only"
    secret.write_text("secret\n")
    secret.chmod(0o600)
    directory = base / f"repro-{os.getuid()}"
    fake = subprocess.Popen(
        as_nobody(python, "-c", LISTENER, str(directory), str(secret)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout.readline().strip() == "listening"
        for name in (ENV_SERVER_DIR, "XDG_RUNTIME_DIR"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("TMPDIR", str(base))
        monkeypatch.setenv(procs.TAG, procs.new_tag())
        yield directory, secret, fake
    finally:
        fake.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_a_squatted_directory_is_never_used(squatted) -> None:
    directory, secret, fake = squatted
    before = sorted(os.listdir(directory))
    done = run("check", *DUMMY, env=WARM)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lora_dummy_run [fixed, cpu]: absent" in done.stdout
    assert f"owned by uid {NOBODY}" in done.stderr and "private server" in done.stderr
    served = run("serve", "--device", "cpu")
    assert served.returncode == 125, served.stdout + served.stderr
    assert f"cannot start: {directory}: owned by uid {NOBODY}" in served.stdout
    status = run("serve", "--device", "cpu", "--status")
    assert status.returncode == 0 and "no warm server" in status.stdout
    assert sorted(os.listdir(directory)) == before, "this user wrote into the squatted directory"
    assert secret.read_text() == "secret\n"
    fake.kill()
    assert "connected" not in fake.communicate()[0], "a connection reached the squatter's socket"
    assert procs.survivors(os.environ[procs.TAG]) == []


def test_a_socket_of_another_user_in_our_directory_is_not_used(server_dir) -> None:
    """Only root could put it there, but the kernel's word (SO_PEERCRED) decides, not the path."""
    python = nobody_python()
    with UserDirectory.open() as directory:
        bound = socket.socket(socket.AF_UNIX)
        bound.bind(directory.address("server-cpu.sock"))
    script = (  # listen() as nobody: the socket's peer credentials are nobody's
        "import socket, sys; s = socket.socket(fileno=int(sys.argv[1])); s.listen(); "
        "print('up', flush=True); s.accept(); print('connected', flush=True)"
    )
    fake = subprocess.Popen(
        as_nobody(python, "-c", script, str(bound.fileno())),
        pass_fds=(bound.fileno(),),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout.readline().strip() == "up"
        done = run("check", *DUMMY, env=WARM)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"is served by uid {NOBODY}, not by this user: not used" in done.stderr
    finally:
        fake.kill()
        bound.close()


def test_a_warm_server_serves_only_its_own_uid(tmp_path) -> None:
    python = nobody_python()
    base = Path(tempfile.mkdtemp(prefix="repro-peer-", dir="/tmp"))
    try:
        base.chmod(0o1777)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(base / "s.sock"))
        (base / "s.sock").chmod(0o777)
        listener.listen(4)
        server = forkserver._Server({}, listener)
        script = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "print(repr(s.recv(100)), flush=True)"
        )
        client = subprocess.Popen(
            as_nobody(python, "-c", script, str(base / "s.sock")), stdout=subprocess.PIPE, text=True
        )
        server._accept()
        assert client.communicate(timeout=30)[0].strip() == "b''", "another uid got a hello"
        assert not server.connections
        mine = socket.socket(socket.AF_UNIX)
        mine.connect(str(base / "s.sock"))
        server._accept()
        assert json.loads(mine.makefile().readline())["ready"] is True
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- 2, 11. a warm server killed, a private one stopped --------------------------------------------


def test_a_warm_server_killed_mid_check_runs_again_on_a_private_one(server_dir) -> None:
    tag = os.environ[procs.TAG]
    assert run("serve", "--device", "cpu", "--idle", "120").returncode == 0
    server = warm_server(tag)
    proc = start(tag, "check", *DUMMY, env=WARM)
    children = lambda: [p for p in procs.tagged(tag) if procs.parent_of(p) == server]
    assert procs.wait_until(children, 60.0, 0.005), "no child of the warm server appeared"
    os.kill(server, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "lora_dummy_run [fixed, cpu]: absent" in out


def test_a_matrix_survives_its_warm_server_and_writes_its_files(server_dir, tmp_path) -> None:
    tag = os.environ[procs.TAG]
    assert run("serve", "--device", "cpu", "--idle", "120").returncode == 0
    server = warm_server(tag)
    argv = ("matrix", "--bug", "lora_dummy_run", "--device", "cpu")
    files = ("--json", str(tmp_path / "m.json"), "--junit", str(tmp_path / "m.xml"))
    proc = start(tag, *argv, *files, env=WARM)
    first_progress_line(proc)
    os.kill(server, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    runs = DUMMY_RUNS
    assert proc.returncode == 0, out
    assert f"{runs}/{runs} runs as expected" in out
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["complete"] is True and len(doc["results"]) == runs and problem(doc) is None


def test_a_stopped_server_is_replaced_and_every_run_counts_once() -> None:
    """SIGSTOP the private server: its children finish unreported; the client notices, kills it,
    runs them again on a fresh one; no run is a timeout, none is counted twice."""
    tag = procs.new_tag()
    argv = ("matrix", "--bug", LIGHT, "--device", "cpu", "--repeat", "2")
    proc = start(tag, *argv)
    victim = procs.wait_until(lambda: child_of_server(proc.pid, tag) and server_of(proc.pid, tag))
    assert victim, "no server with a child appeared"
    os.kill(victim, signal.SIGSTOP)
    out, _ = proc.communicate(timeout=240)
    runs = 2 * LIGHT_RUNS
    progress = re.findall(r"^\[\s*(\d+)/(\d+)\]", out, re.MULTILINE)
    assert [int(done) for done, _ in progress] == list(range(1, runs + 1)), out
    assert {int(total) for _, total in progress} == {runs}
    assert "timeout" not in out and proc.returncode == 0, out
    assert f"{runs}/{runs} runs as expected" in out
    assert procs.survivors(tag) == []


# -- 3, 4. a server directory that cannot be made; trees that do not import ------------------------


def test_a_server_directory_that_cannot_be_made_means_a_private_server(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    env = {**WARM, ENV_SERVER_DIR: str(tmp_path / "file" / "below")}
    done = run("check", *DUMMY, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not using warm servers" in done.stderr and "cannot create it" in done.stderr
    served = run("serve", "--device", "cpu", env=env)
    assert served.returncode == 125 and "cannot start" in served.stdout, served.stdout


def test_a_junk_harness_on_pythonpath_is_not_the_tree_under_test(tmp_path) -> None:
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "__init__.py").write_text("raise RuntimeError('junk harness')\n")
    done = installed("check", *DUMMY, cwd="/", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "junk" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("file", "line", "shown"),
    [
        ("harness/runner/model.py", "undefined_name_at_import\n", "NameError"),
        ("harness/runner/lora.py", "raise RuntimeError('half-done commit')\n", "RuntimeError"),
    ],
)
def test_an_import_time_error_in_the_runner_cannot_test(tmp_path, file, line, shown) -> None:
    repo = Repo(tmp_path)
    (repo.path / file).write_text((repo.path / file).read_text() + line)
    done = run("check", *DUMMY, cwd=repo.path)
    assert done.returncode == 125, done.stdout + done.stderr
    assert f"the project does not import: {shown}" in done.stdout
    assert f"raised at {file}:" in done.stdout


def test_a_broken_command_is_125_with_one_line_and_its_traceback_in_a_log(tmp_path) -> None:
    repo = Repo(tmp_path)
    repo.edit("repro/check.py", "    p = plan(args)\n", "    p = plan(args)\n    1 / 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "repro", "run", *DUMMY],
        cwd=repo.path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 125, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("repro: cannot test: the repro command broke: ZeroDivisionError")
    log = Path(re.search(r"\(traceback: (\S+)\)$", line).group(1))
    assert "1 / 0" in log.read_text()
    log.unlink()


# -- 5. the tree under test is the working directory's --------------------------------------------


@pytest.mark.moe_align_grid
def test_the_installed_command_tests_the_checkout_it_runs_in(tmp_path) -> None:
    """Installed from this tree, run in a second clone that holds a regression: the clone."""
    clone = Repo(tmp_path)
    good = clone.git("rev-parse", "HEAD").strip()
    clone.edit("kernels/moe_lora_align.py", GRID_FIX, "num_slots = max_loras")
    bad = clone.commit("the align grid one slot short again")
    done = installed("check", *CHECK_GRID, cwd=clone.path / "tests")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"repro: testing {clone.path}" in done.stderr
    # The README's recipe in the clone, with nothing but the installed command.
    script = procs.installed_repro()
    clone.git("bisect", "start", bad, good)
    log = clone.git("bisect", "run", script, "check", *CHECK_GRID)
    clone.git("bisect", "reset")
    assert first_bad(log) == bad, log


def test_a_checkout_whose_command_does_not_start_cannot_test(tmp_path) -> None:
    clone = Repo(tmp_path)
    (clone.path / "repro" / "cli.py").write_text("def main(:\n")
    done = installed("check", *DUMMY, cwd=clone.path)
    assert done.returncode == 125, done.stdout + done.stderr
    assert f"the project in {clone.path} does not import: SyntaxError" in done.stderr


def test_a_handover_that_lands_elsewhere_is_refused(tmp_path) -> None:
    clone = Repo(tmp_path)
    done = installed("check", *DUMMY, cwd=clone.path, env={"REPRO_RUN_FROM": "/elsewhere"})
    assert done.returncode == 125, done.stdout + done.stderr
    assert f"the working directory is in {clone.path}, but this command runs" in done.stderr


# -- 6. temp paths longer than a socket address ---------------------------------------------------


def test_a_200_character_temp_dir_serves_and_checks(tmp_path, monkeypatch) -> None:
    deep = tmp_path / ("t" * 60) / ("m" * 60) / ("p" * 60)
    deep = Path(str(deep) + "x" * max(0, 200 - len(str(deep))))
    deep.mkdir(parents=True)
    assert len(str(deep)) >= 200
    for name in (ENV_SERVER_DIR, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setenv(procs.TAG, procs.new_tag())
    try:
        served = run("serve", "--device", "cpu", "--idle", "120")
        assert served.returncode == 0 and "warm server at" in served.stdout, served.stdout
        assert (deep / f"repro-{os.getuid()}" / "server-cpu.sock").is_socket()
        done = run("check", *DUMMY, env=WARM)
        assert done.returncode == 0 and done.stderr.count("\n") <= 1, done.stdout + done.stderr
    finally:
        run("serve", "--device", "cpu", "--stop")
    assert procs.survivors(os.environ[procs.TAG]) == []


# -- 7, 11. files of a killed or interrupted matrix -----------------------------------------------


def test_a_killed_matrix_leaves_valid_files_with_every_finished_run(tmp_path) -> None:
    tag = procs.new_tag()
    files = ("--json", str(tmp_path / "m.json"), "--junit", str(tmp_path / "m.xml"))
    proc = start(
        tag, "matrix", "--bug", "lora_dummy_run", "--device", "cpu", "--repeat", "20", *files
    )
    shown = [first_progress_line(proc), proc.stdout.readline(), proc.stdout.readline()]
    proc.kill()
    proc.wait()
    doc = json.loads((tmp_path / "m.json").read_text())
    assert problem(doc) is None and doc["complete"] is False
    assert len(doc["results"]) >= len(shown)
    assert all(r["outcome"] == r["expected"] for r in doc["results"])
    suite = ET.parse(tmp_path / "m.xml").getroot()
    assert suite.find("properties/property[@name='complete']").get("value") == "false"
    assert int(suite.get("tests")) == len(suite.findall("testcase")) >= len(shown)
    assert procs.survivors(tag) == []


def test_junit_counts_interrupted_runs_as_skipped_not_failed(tmp_path) -> None:
    tag = procs.new_tag()
    argv = ("matrix", "--bug", "lora_dummy_run", "--device", "cpu", "--repeat", "20")
    proc = start(tag, *argv, "--junit", str(tmp_path / "m.xml"))
    first_progress_line(proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    suite = ET.parse(tmp_path / "m.xml").getroot()
    assert int(suite.get("failures")) == len(suite.findall("testcase/failure")) == 0
    assert int(suite.get("skipped")) == len(suite.findall("testcase/skipped")) > 0
    assert suite.find("properties/property[@name='complete']").get("value") == "true"


# -- 8. malformed result files --------------------------------------------------------------------

ROW = {
    "bug": "lora_dummy_run",
    "scenario": "dummy_run_before_mapping",
    "variant": "fixed",
    "fixes_off": [],
    "device": "cpu",
    "gpu": None,
    "outcome": "pass",
    "expected": "pass",
    "seed": 0,
    "seconds": 1.0,
    "scenario_seconds": None,
    "evidence": "",
}


def valid_document() -> dict:
    from repro.results import document

    return document([dict(ROW)])


@pytest.mark.parametrize(
    ("damage", "shown"),
    [
        (lambda d: d["results"][0].pop("outcome"), "document.results[0]: 'outcome' is missing"),
        (lambda d: d["results"][0].update(seed="0"), "document.results[0].seed: '0' is not of"),
        (lambda d: d["results"][0].update(outcome="fine"), "results[0].outcome: 'fine' is not one"),
        (lambda d: d.update(results={}), "document.results: {} is not of type array"),
        (lambda d: d["provenance"].pop("host"), "document.provenance: 'host' is missing"),
        (lambda d: d["results"].append(3), "document.results[1]: 3 is not of type object"),
    ],
)
def test_malformed_results_are_a_usage_error(tmp_path, damage, shown) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    doc = valid_document()
    good.write_text(json.dumps(doc))
    damage(doc)
    bad.write_text(json.dumps(doc))
    for argv in (
        ("report", str(bad)),
        ("diff", str(good), str(bad)),
        ("diff", str(bad), str(good)),
    ):
        done = run(*argv)
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert lines[0].startswith(f"repro: error: {bad}: not a valid repro-results/1 document")
        assert shown in lines[0] and len(lines) == 2  # and the probe's torch line
    assert run("report", str(good)).returncode == 0


# -- 9, 10. a closed pipe; serve's flags --------------------------------------------------------


@pytest.mark.lora_dummy_run
@pytest.mark.parametrize("unbuffered", ["0", "1"])
def test_a_closed_pipe_keeps_the_verdict(unbuffered) -> None:
    proc = subprocess.Popen(
        procs.repro_command("check", *DUMMY, "--variant", "buggy"),
        env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader is gone before the first line (`| head -0`, `| true`)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err


@pytest.mark.lora_dummy_run
def test_check_piped_into_head_exits_1() -> None:
    command = " ".join(f"'{a}'" for a in procs.repro_command("check", *DUMMY, "--variant", "buggy"))
    script = f'{command} 2>/dev/null | head -1; echo "exit ${{PIPESTATUS[0]}}"'
    done = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    first, code = done.stdout.strip().splitlines()
    assert first.startswith("lora_dummy_run [buggy, cpu]: PRESENT") and code == "exit 1", (
        done.stdout
    )


FAKE_STALE = r"""
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from harness.userdir import UserDirectory
directory = UserDirectory.open()
listener = socket.socket(socket.AF_UNIX)
listener.bind(directory.address("server-cpu.sock"))
listener.listen(8)
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    hello = {"ready": True, "protocol": 0, "pid": os.getpid(), "versions": {}}
    conn.sendall((json.dumps(hello) + "\n").encode())
    if json.loads(conn.makefile().readline() or "{}").get("stop"):
        directory.unlink("server-cpu.sock")
        print("stopped", flush=True)
        break
"""


def test_status_and_stop_never_start_a_server(server_dir) -> None:
    tag = os.environ[procs.TAG]
    for flag in ("--status", "--stop"):
        done = run("serve", "--device", "cpu", flag)
        assert done.returncode == 0 and "no warm server" in done.stdout, done.stdout
    assert not server_dir.exists(), "--status/--stop made the server directory"
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_STALE, str(procs.ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert fake.stdout.readline().strip() == "listening"
        status = run("serve", "--device", "cpu", "--status")
        assert status.returncode == 0 and "(stale" in status.stdout, status.stdout
        assert procs.tagged(tag, exclude=(fake.pid,)) == [], "--status started something"
        stop = run("serve", "--device", "cpu", "--stop")
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout
        assert fake.communicate(timeout=30)[0].strip() == "stopped"
        assert procs.tagged(tag) == [], "--stop started something"
    finally:
        fake.kill()


def test_two_serves_at_once_give_one_server(server_dir) -> None:
    tag = os.environ[procs.TAG]
    both = [
        subprocess.Popen(
            procs.repro_command("serve", "--device", "cpu", "--idle", "120"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    pids = {re.search(r"pid (\d+)", out).group(1) for out in outs}
    assert len(pids) == 1, f"two servers answered: {outs}"
    one = procs.wait_until(lambda: warm_server(tag), 30.0)
    assert one is not None and str(one) in pids, "not exactly one warm server runs"


# -- 12. a shorter time limit ---------------------------------------------------------------------


def test_timeout_shortens_a_real_hang(tmp_path) -> None:
    """A regression that hangs: caught as a timeout confirmed twice (exit 1), in seconds."""
    repo = Repo(tmp_path)
    head = "def dummy_run_before_mapping(ctx: Context) -> str:\n"  # the scenario's name: stable
    repo.edit(
        "repro/bugs/lora_dummy_run/scenarios.py", head, head + "    __import__('time').sleep(600)\n"
    )
    started = time.monotonic()
    done = run("check", *DUMMY, "--timeout", "3", cwd=repo.path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "timeout, confirmed by a second run" in done.stdout
    assert "no exit within the time limit" in done.stdout
    env_run = run("run", *DUMMY, cwd=repo.path, env={"REPRO_TIMEOUT": "3"})
    assert env_run.returncode == 1 and "timeout" in env_run.stdout, env_run.stdout
    assert time.monotonic() - started < 60


# -- the directory's own rules ----------------------------------------------------------------


def test_the_directory_is_runtime_dir_only_when_that_is_this_users(tmp_path, monkeypatch) -> None:
    from harness.userdir import location

    uid = os.getuid()
    monkeypatch.delenv(ENV_SERVER_DIR, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert location() == tmp_path / f"repro-{uid}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert location() == tmp_path / "tmp" / f"repro-{uid}"
    monkeypatch.setenv(ENV_SERVER_DIR, str(tmp_path / "mine"))
    assert location() == tmp_path / "mine" / f"repro-{uid}"


@pytest.mark.parametrize("how", ["mode 0755", "symlink", "log symlink"])
def test_a_directory_of_ours_that_is_not_safe_is_refused(server_dir, tmp_path, how) -> None:
    target = tmp_path / "precious"
    target.write_text("keep\n")
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        server_dir.parent.mkdir()
        server_dir.symlink_to(tmp_path / "elsewhere")
    else:
        server_dir.mkdir(parents=True, mode=0o700)
        server_dir.chmod(0o755 if how == "mode 0755" else 0o700)
    if how == "log symlink":
        (server_dir / "server-cpu.log").symlink_to(target)
    served = run("serve", "--device", "cpu")
    assert served.returncode == 125, served.stdout + served.stderr
    shown = {"mode 0755": "mode 0755, not 0700", "symlink": "a symlink", "log symlink": "its log"}
    assert shown[how] in served.stdout
    assert target.read_text() == "keep\n"
    if how != "log symlink":
        done = run("check", *DUMMY, env=WARM)
        assert done.returncode == 0 and "not using warm servers" in done.stderr, done.stderr
