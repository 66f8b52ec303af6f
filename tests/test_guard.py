"""The guard around the real `repro` command (repro.cli): an exit that is not the command's
verdict (SystemExit, KeyboardInterrupt or os._exit at import, a signal) is 125 with one line
naming how and where, never 0 or 1; signals to the guard reach the command; a bisect skips a
commit whose tree exits at import."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests import procs
from tests.test_bisect import CHECK_GRID, GRID_FIX, Repo, first_bad
from tests.test_faults import first_progress_line

pytestmark = pytest.mark.cpu_job  # the CPU job runs them; a GPU run would repeat them

CHECK = ("check", "moe_align_grid", "--device", "cpu", "--scenario", "last_slot_rows")


def module_run(*argv: str, cwd, env: dict | None = None, timeout: float = 240):
    """`python -m repro ...` in `cwd`: the real entry point, guard included."""
    return subprocess.run(
        [sys.executable, "-m", "repro", *argv],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def injected(repo: Repo, file: str, code: str) -> int:
    """Append `code` to `file` of the repository; the line number it lands on."""
    path = repo.path / file
    text = path.read_text()
    path.write_text(text + code + "\n")
    return text.count("\n") + 1


EXITS = [
    ("harness/outcome.py", "import sys; sys.exit(0)", "SystemExit(0) raised at {at}"),
    ("repro/registry.py", "import sys; sys.exit(1)", "SystemExit(1) raised at {at}"),
    ("repro/registry.py", "raise KeyboardInterrupt", "KeyboardInterrupt() raised at {at}"),
    ("harness/outcome.py", "import os; os._exit(0)", "os._exit(0) called at {at}"),
    ("repro/registry.py", "import os; os._exit(1)", "os._exit(1) called at {at}"),
    (
        "harness/record.py",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "killed by SIGKILL (the last project module it began to import: ",
    ),
]


@pytest.mark.parametrize(("file", "code", "shown"), EXITS, ids=[c for _, c, _ in EXITS])
@pytest.mark.parametrize("variant", ["fixed", "buggy"])
def test_an_exit_at_import_is_125_with_one_line(tmp_path, file, code, shown, variant) -> None:
    repo = Repo(tmp_path)
    line = injected(repo, file, code)
    done = module_run(*CHECK, "--variant", variant, cwd=repo.path)
    assert done.returncode == 125, done.stdout + done.stderr
    (said,) = done.stderr.strip().splitlines()
    assert said.startswith("repro: cannot test: the command ended without its verdict: ")
    assert shown.format(at=f"{file}:{line}") in said, said
    assert "Traceback" not in done.stdout + done.stderr


def test_a_matrix_whose_tree_exits_at_import_is_125_and_says_so(tmp_path) -> None:
    repo = Repo(tmp_path)
    line = injected(repo, "harness/outcome.py", "import sys; sys.exit(0)")
    out = tmp_path / "m.json"
    argv = ("matrix", "--bug", "moe_align_grid", "--device", "cpu", "--json", str(out))
    # the installed command, run in the clone: it hands over to the clone under its guard
    done = subprocess.run(
        [procs.installed_repro(), *argv],
        cwd=repo.path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 125, done.stdout + done.stderr
    assert f"SystemExit(0) raised at harness/outcome.py:{line}" in done.stderr
    assert not out.exists()


def test_bisect_skips_a_commit_that_exits_at_import(tmp_path) -> None:
    """A good, B brings the bug back, C exits 0 at import, D undoes that: B is the first bad
    commit, and C was skipped (125), never called good."""
    repo = Repo(tmp_path)
    good = repo.git("rev-parse", "HEAD").strip()
    repo.edit("kernels/moe_lora_align.py", GRID_FIX, "num_slots = max_loras")
    bad = repo.commit("B: the align grid one slot short again")
    injected(repo, "harness/outcome.py", "import sys; sys.exit(0)")
    exits = repo.commit("C: an exit at import")
    repo.edit("harness/outcome.py", "import sys; sys.exit(0)\n", "")
    last = repo.commit("D: the exit removed")
    repo.git("bisect", "start", last, good)
    try:
        log = repo.git("bisect", "run", procs.installed_repro(), "check", *CHECK_GRID)
        history = repo.git("bisect", "log")
    finally:
        repo.git("bisect", "reset")
    assert first_bad(log) == bad, log
    assert f"# skip: [{exits}]" in history, history
    assert f"# good: [{exits}]" not in history, history


def long_matrix(tag: str, *files: str) -> subprocess.Popen:
    """`python -m repro matrix` of many short runs, its processes tagged."""
    argv = ("matrix", "--bug", "lora_dummy_run", "--device", "cpu", "--repeat", "20", *files)
    return subprocess.Popen(
        [sys.executable, "-m", "repro", *argv],
        cwd=procs.ROOT,
        env={**os.environ, procs.TAG: tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_to_the_guard_interrupts_the_command(tmp_path) -> None:
    """A runner's cleanup signals the process it started (the guard): the matrix stops, prints
    its summary, exits 130, and leaves no process behind."""
    tag = procs.new_tag()
    proc = long_matrix(tag, "--json", str(tmp_path / "m.json"))
    first_progress_line(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "runs as expected" in out and "interrupted" in err
    assert "Traceback" not in out + err
    assert procs.survivors(tag) == []


def test_a_killed_guard_takes_the_command_with_it(tmp_path) -> None:
    """SIGKILL to the guard: its child is told (parent-death signal) and cleans up."""
    tag = procs.new_tag()
    proc = long_matrix(tag)
    first_progress_line(proc)
    proc.kill()
    proc.wait(timeout=30)
    assert procs.survivors(tag, timeout_s=30.0) == []


@pytest.mark.moe_align_grid
def test_a_closed_stdout_keeps_the_verdict() -> None:
    """`repro check BUG >&-`: the verdict's exit code, no traceback (the interpreter's 120)."""
    command = " ".join([sys.executable, "-m", "repro", *CHECK, "--variant", "buggy", ">&-"])
    done = subprocess.run(
        ["bash", "-c", command], cwd=procs.ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stderr == "", done.stderr


def test_a_crash_log_goes_to_the_user_directory_and_old_ones_go(tmp_path) -> None:
    repo = Repo(tmp_path)
    repo.edit("repro/check.py", "    p = plan(args)\n", "    p = plan(args)\n    1 / 0\n")
    servers = tmp_path / "servers"
    env = {"REPRO_SERVER_DIR": str(servers)}
    crashes = servers / f"repro-{os.getuid()}" / "crashes"
    logs = []
    for _ in range(3):
        done = module_run("run", "moe_align_grid", "--device", "cpu", cwd=repo.path, env=env)
        assert done.returncode == 125, done.stderr
        logs.append(re.search(r"\(traceback: (\S+)\)$", done.stderr.strip()).group(1))
    assert all(log.startswith(str(crashes)) for log in logs), logs
    for i in range(40):  # a pile of old logs: the next crash trims it to the bound
        (crashes / f"repro-crash-old{i}.log").write_text("old\n")
    module_run("run", "moe_align_grid", "--device", "cpu", cwd=repo.path, env=env)
    from repro.cli import CRASH_LOGS

    assert len(list(crashes.iterdir())) == CRASH_LOGS
