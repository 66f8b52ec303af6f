"""Fault injection on the real `repro` command (CPU): Ctrl-C, killed parent, server and child,
stray output, a foreign working directory, a server that cannot start. Each case asserts the
verdict and that no process of the run survives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

from repro import registry
from tests import procs

# every command here runs with --device cpu: on a GPU run it would repeat the CPU job
pytestmark = pytest.mark.cpu_job

DUMMY = ("lora_dummy_run", "--device", "cpu", "--scenario", "dummy_run_before_mapping")
DUMMY_SCENARIOS = len(registry.get("lora_dummy_run").scenarios)


def start(tag: str, *argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, procs.TAG: tag, **kw.pop("env", {})}
    return subprocess.Popen(
        procs.repro_command(*argv), env=env, stdout=subprocess.PIPE, text=True, **kw
    )


def first_progress_line(proc: subprocess.Popen) -> str:
    """Read until the matrix reports its first finished run."""
    for line in proc.stdout:
        if line.startswith("[  1/"):
            return line
    raise AssertionError("the matrix ended before reporting a run")


def server_of(parent: int, tag: str) -> int | None:
    found = [p for p in procs.tagged(tag) if procs.parent_of(p) == parent]
    return next((p for p in found if "harness.forkserver" in procs.cmdline(p)), None)


def child_of_server(parent: int, tag: str) -> int | None:
    server = server_of(parent, tag)
    found = [p for p in procs.tagged(tag) if server and procs.parent_of(p) == server]
    return found[0] if found else None


def long_matrix(tmp_path) -> tuple[str, ...]:
    return (
        "matrix",
        "--bug",
        "lora_dummy_run",
        "--device",
        "cpu",
        "--repeat",
        "20",
        "--json",
        str(tmp_path / "m.json"),
        "--junit",
        str(tmp_path / "m.xml"),
    )


@pytest.mark.parametrize("target", ["parent", "group", "sigterm"])
def test_sigint_stops_the_matrix_keeps_what_finished_and_leaves_nothing(tmp_path, target) -> None:
    tag = procs.new_tag()
    proc = start(tag, *long_matrix(tmp_path), start_new_session=True)
    first_progress_line(proc)
    sent = time.monotonic()
    if target == "group":  # Ctrl-C in a terminal: the whole foreground group
        os.killpg(proc.pid, signal.SIGINT)
    else:  # kill -INT, or a runner's cleanup (SIGTERM)
        proc.send_signal(signal.SIGINT if target == "parent" else signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    stopped_s = time.monotonic() - sent
    assert proc.returncode == 130, out
    assert "runs as expected" in out, out
    rows = json.loads((tmp_path / "m.json").read_text())["results"]
    assert len(rows) == 2 * 20 * DUMMY_SCENARIOS
    finished = [r for r in rows if not r["evidence"].startswith("interrupted")]
    assert finished and all(r["outcome"] == r["expected"] for r in finished)
    assert any(r["outcome"] == "skipped" for r in rows)
    assert ET.parse(tmp_path / "m.xml").getroot().get("tests") == str(len(rows))
    assert procs.survivors(tag) == [], f"left alive after SIGINT ({stopped_s:.1f}s to stop)"


def test_interrupted_check_cannot_test() -> None:
    tag = procs.new_tag()
    proc = start(tag, "check", "moe_align_grid", "--device", "cpu")
    assert procs.wait_until(lambda: child_of_server(proc.pid, tag)), "no child appeared"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 125, out
    assert "moe_align_grid [fixed, cpu]: cannot test: interrupted" in out
    assert procs.survivors(tag) == []


def test_killed_parent_takes_the_server_and_every_child_with_it(tmp_path) -> None:
    tag = procs.new_tag()
    proc = start(tag, *long_matrix(tmp_path))
    first_progress_line(proc)
    proc.kill()
    proc.wait()
    assert procs.survivors(tag) == []


def test_killed_server_is_replaced_and_the_matrix_completes() -> None:
    tag = procs.new_tag()
    # a light matrix (one scenario of about 2 s), long enough to kill its server mid-way
    proc = start(tag, "matrix", "--bug", "block_table_wake", "--device", "cpu", "--repeat", "4")
    victim = procs.wait_until(lambda: child_of_server(proc.pid, tag) and server_of(proc.pid, tag))
    assert victim, "no server with a child appeared"
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    runs = 2 * 4 * len(registry.get("block_table_wake").scenarios)
    assert f"{runs}/{runs} runs as expected" in out
    assert procs.survivors(tag) == []


def test_a_child_killed_from_outside_is_not_a_verdict() -> None:
    """SIGKILL of the first child: crash, then a confirming run passes: flaky, exit 125."""
    tag = procs.new_tag()
    proc = start(tag, "check", *DUMMY)
    victim = procs.wait_until(lambda: child_of_server(proc.pid, tag), 60.0, 0.005)
    assert victim, "no child appeared"
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 125, out
    assert "cannot test: flaky" in out
    assert "crash, then pass on a second run" in out
    assert procs.survivors(tag) == []


def test_stray_output_at_interpreter_start_breaks_nothing(tmp_path) -> None:
    (tmp_path / "sitecustomize.py").write_text("print('a banner on stdout')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = start(procs.new_tag(), "check", *DUMMY, env=env)
    out, _ = proc.communicate(timeout=120)
    assert "a banner on stdout" in out  # it really ran, in this parent too
    assert proc.returncode == 0, out
    assert "lora_dummy_run [fixed, cpu]: absent" in out


def test_an_unrelated_harness_in_the_working_directory_is_never_imported(tmp_path) -> None:
    for package in ("harness", "kernels", "repro"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise SystemExit('foreign {package}')\n")
    done = subprocess.run(
        [procs.installed_repro(), "check", *DUMMY],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "foreign" not in done.stdout + done.stderr


def test_a_server_that_cannot_start_is_cannot_test_with_its_output(tmp_path) -> None:
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("raise ImportError('numpy broken')\n")
    tag = procs.new_tag()
    proc = start(tag, "check", *DUMMY, env={"PYTHONPATH": str(tmp_path)})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 125, out
    assert "fork server (cpu) exited (exit status 1)" in out
    assert "ImportError: numpy broken" in out
    assert procs.survivors(tag) == []
