"""Exit codes at the edges, on the real `repro` command (CPU): a checkout into a path that cannot
be written, a result file whose directory goes away mid-matrix, a results document nested too
deeply to parse, a matrix of all devices on a machine without a GPU. A usage error is 2 with one
line, a lost result file is 125 with one line, and neither leaves a traceback on the terminal."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from harness.device import ENV_DEVICE
from repro import registry
from tests import procs
from tests.test_faults import first_progress_line, start

# every command here runs the cpu only: on a GPU run it would repeat the CPU job
pytestmark = pytest.mark.cpu_job

LIGHT = "block_table_wake"  # a matrix of one scenario of about 2 s a run
LIGHT_RUNS = 2 * len(registry.get(LIGHT).scenarios)  # fixed and buggy


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        procs.repro_command(*argv),
        env=os.environ if env is None else env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The stderr of a usage error: one `repro: error:` line (the probe's torch line aside)."""
    lines = [line for line in done.stderr.splitlines() if not line.startswith("torch imported")]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert lines[0].startswith("repro: error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_checkout_into_an_unwritable_path_is_a_usage_error(tmp_path, where) -> None:
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "sub" if where == "under_a_file" else "/proc/nope"
    done = run("checkout", "moe_align_grid", "--variant", "buggy", str(target))
    line = one_error_line(done)
    assert str(target) in line and "cannot write" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    assert not os.path.lexists("/proc/nope")


def test_a_lost_result_file_is_named_and_the_matrix_finishes(tmp_path) -> None:
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    gone.mkdir()
    kept.mkdir()
    tag = procs.new_tag()
    argv = ("matrix", "--device", "cpu", "--bug", LIGHT)
    files = ("--json", str(gone / "m.json"), "--junit", str(kept / "m.xml"))
    proc = start(tag, *argv, *files, stderr=subprocess.PIPE)
    first_progress_line(proc)
    # NOTE: the json file is rewritten after every finished run, so every later write fails
    shutil.rmtree(gone)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 125, (out, err)
    assert f"{LIGHT_RUNS}/{LIGHT_RUNS} runs as expected" in out, out
    lost = [line for line in err.splitlines() if "m.json" in line]
    assert len(lost) == 1 and str(gone / "m.json") in lost[0], err
    assert "Traceback" not in err, err
    suite = ET.parse(kept / "m.xml").getroot()
    assert suite.get("tests") == str(LIGHT_RUNS), ET.tostring(suite)
    assert suite.find("properties/property[@name='complete']").get("value") == "true"
    assert procs.survivors(tag) == []


@pytest.mark.parametrize("command", ["report", "diff"])
def test_a_deeply_nested_document_is_a_usage_error(tmp_path, command) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    done = run(command, *[str(deep)] * (2 if command == "diff" else 1))
    line = one_error_line(done)
    assert str(deep) in line and "nested too deeply" in line, line


def test_a_matrix_of_all_devices_says_cuda_did_not_run() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_DEVICE}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU visible, whatever the machine holds
    done = run("matrix", "--bug", LIGHT, env=env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "cuda: skipped: no CUDA device is available" in done.stderr, done.stderr
    quiet = run("matrix", "--bug", LIGHT, "--device", "cpu", env=env)
    assert quiet.returncode == 0 and "cuda" not in quiet.stderr, quiet.stderr


# -- a time limit too tight to tell a hang (issue 39, item 2) --------------------------------------

TIGHT = ("check", "lora_graph_capture", "--device", "cpu", "--scenario", "full_graphs")


@pytest.mark.lora_graph_capture
@pytest.mark.parametrize("variant", ["fixed", "buggy"])
def test_a_timeout_under_the_usual_time_cannot_test(variant) -> None:
    """`--timeout` far under the scenario's usual seconds (its record ships them): a timeout
    is no verdict, fixed or buggy: 125, said up front in one line and again in the verdict."""
    bug = registry.get("lora_graph_capture")
    usual = bug.usual_s("full_graphs", "cpu")
    assert usual is not None and usual > 0.5, "the record ships full_graphs' usual cpu seconds"
    done = run(*TIGHT, "--variant", variant, "--timeout", "0.1")
    assert done.returncode == 125, done.stdout + done.stderr
    warning = [line for line in done.stderr.splitlines() if line.startswith("repro: ")]
    assert warning == [
        f"repro: a time limit of 0.1s is under 5x the usual time of full_graphs (usually "
        f"{usual:.1f}s on cpu): a timeout there cannot test (125), it is no verdict"
    ], done.stderr
    assert (
        "full_graphs: timeout, stopped at a limit of 0.1s, too tight to tell a hang" in done.stdout
    )
    assert "PRESENT" not in done.stdout and "absent" not in done.stdout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_scenario_ships_its_usual_seconds(device) -> None:
    """`repro bench --usual --write` measured them on each device; a scenario without them
    would make every shortened limit unable to tell a hang, and would start last in a matrix
    (the longest start first): on a GPU, the twelve bugs without them started last, and part
    2's matrix ran 2-10 of its 16 runs at once for its last 12 s (one H200, 2026-11-29)."""
    missing = [
        f"{bug.id}:{s.name}"
        for bug in registry.BUGS
        for s in bug.scenarios
        if not (bug.usual_s(s.name, device) or 0) > 0
    ]
    assert missing == [], (
        f"no usual {device} seconds for {missing}: run repro bench --usual --write "
        f"--device {device}"
    )


# -- a full disk (issue 39, item 5) ----------------------------------------------------------------


@pytest.fixture
def full_directory(tmp_path):
    """A tiny tmpfs filled to the last page (root only: mount), as the user's directory."""
    if os.getuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], check=False
    )
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mount / f"repro-{os.getuid()}").mkdir(mode=0o700)
        with contextlib.suppress(OSError), open(mount / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_server_directory_says_so(full_directory) -> None:
    env = {**os.environ, "REPRO_SERVER_DIR": str(full_directory)}
    done = run(
        "check", "moe_align_grid", "--device", "cpu", "--scenario", "last_slot_rows", env=env
    )
    assert done.returncode == 125, done.stdout + done.stderr
    assert "No space left on device" in done.stdout + done.stderr, done.stdout + done.stderr
    assert str(full_directory) in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
