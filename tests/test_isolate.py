"""Child isolation on real children: every way of ending yields exactly one classified result,
and no process outlives the run (a dead server, a killed child, a killed parent, Ctrl-C)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from harness.fixes import ALL_FIXES
from harness.isolate import CHILD_BOOT, ROOT, Isolator, Job, _Batch
from harness.outcome import Outcome
from tests import procs

# the CPU job runs them (cpu children; those that take the device run on both)
pytestmark = pytest.mark.cpu_job


@pytest.fixture(scope="module", params=["fork", "spawn"])
def isolator(request):
    with Isolator(request.param) as iso:
        yield iso


def job(name: str, timeout_s: float = 60.0) -> Job:
    return Job("test", name, f"tests.children:{name}", ALL_FIXES, "cpu", timeout_s)


@pytest.mark.parametrize(
    ("name", "outcome", "evidence"),
    [
        ("passes", Outcome.PASS, "passed on cpu"),
        ("wrong", Outcome.WRONG_RESULT, "row 3: 5 vs 7"),
        ("segfaults", Outcome.ILLEGAL_ADDRESS, "SIGSEGV"),
        ("aborts", Outcome.CRASH, "SIGABRT"),
        ("cuda_assert_error", Outcome.DEVICE_ASSERT, "device-side assert"),
        ("triton_illegal_address", Outcome.ILLEGAL_ADDRESS, "illegal memory access"),
        ("raises_in_code_under_test", Outcome.EXCEPTION, "raised at harness/runner/lora.py"),
        ("imports_a_missing_module", Outcome.ERROR, "the project does not import"),
        ("plain_bug_in_scenario", Outcome.ERROR, "the scenario or the harness broke: KeyError"),
        ("exits_without_report", Outcome.ERROR, "exit 3 without report"),
        ("skips", Outcome.SKIPPED, "needs a compiler"),
        ("no_such_function", Outcome.ERROR, "AttributeError"),
    ],
)
def test_child_outcome_is_classified(isolator, name: str, outcome: Outcome, evidence: str) -> None:
    result = isolator.run(job(name))
    assert result.outcome == outcome, result.evidence
    assert evidence in result.evidence


def test_a_forked_child_is_decided_by_its_report_not_by_its_exit() -> None:
    """The report is a child's last act (harness.child.main): its result comes while the child
    is still there (a slow exit: the driver tearing a CUDA context down), and the child does
    not outlive the isolator."""
    with Isolator("fork") as iso:
        result = iso.run(job("reports_then_lingers"))
        assert result.outcome == Outcome.PASS, result.evidence
        pid = int(result.evidence.removeprefix("pid "))
        assert procs.alive(pid), "decided only after the child's exit"
    assert procs.wait_until(lambda: not procs.alive(pid), 10.0)


def test_hanging_child_times_out_with_its_stack_as_evidence(isolator) -> None:
    # A spawned child imports torch first: seconds on a loaded GPU machine.
    result = isolator.run(job("hangs", timeout_s=3.0 if isolator.mode == "fork" else 20.0))
    assert result.outcome == Outcome.TIMEOUT, result.evidence
    assert "in hangs" in result.evidence  # faulthandler's dump just before the limit


def test_batch_goes_on_after_crashes_in_order(isolator) -> None:
    names = ["segfaults", "passes", "aborts", "wrong"]
    seen = []
    results = isolator.run_all([job(n) for n in names], workers=2, on_result=seen.append)
    assert [r.job.scenario for r in results] == names
    assert [r.outcome for r in results] == [
        Outcome.ILLEGAL_ADDRESS,
        Outcome.PASS,
        Outcome.CRASH,
        Outcome.WRONG_RESULT,
    ]
    assert sorted(r.job.scenario for r in seen) == sorted(names)


def test_a_follow_up_starts_before_the_waiting_jobs_and_reads_after_them(isolator) -> None:
    names = ["wrong", "passes", "passes", "passes"]
    started = []  # the order results came in, one worker: the order runs started
    follow = lambda r: job("segfaults") if r.job.scenario == "wrong" else None
    results = isolator.run_all(
        [job(n) for n in names], workers=1, on_result=started.append, then=follow
    )
    assert [r.job.scenario for r in results] == [*names, "segfaults"]
    assert [r.job.scenario for r in started][:2] == ["wrong", "segfaults"]
    assert results[-1].outcome == Outcome.ILLEGAL_ADDRESS


def test_until_stops_the_runs_in_flight_and_starts_no_more(isolator) -> None:
    """A check whose verdict is settled: once `until` names a reason, the run in flight is
    killed and the waiting ones never start, each `skipped` with that reason; none outlives."""
    names = ["wrong", "hangs", "passes", "passes"]
    seen: list = []
    why = lambda: "settled" if any(r.job.scenario == "wrong" for r in seen) else ""
    t0 = time.monotonic()
    results = isolator.run_all([job(n) for n in names], workers=2, on_result=seen.append, until=why)
    assert time.monotonic() - t0 < 30, "the hanging run was not stopped"
    assert [r.outcome for r in results] == [Outcome.WRONG_RESULT, *[Outcome.SKIPPED] * 3]
    assert results[1].evidence == "not finished: settled"
    assert [r.evidence for r in results[2:]] == ["not run: settled"] * 2


def test_drop_stops_one_jobs_runs(isolator) -> None:
    """`drop` names a job once its copy passed: its run in flight is killed and its waiting
    copy never starts, each `skipped` with the reason; the other jobs run."""
    names = ["passes", "hangs", "wrong", "hangs"]
    seen: list = []
    once = iter([{job("hangs"): "its copy passed"}])
    drop = lambda: next(once, {}) if any(r.job.scenario == "passes" for r in seen) else {}
    t0 = time.monotonic()
    results = isolator.run_all([job(n) for n in names], workers=2, on_result=seen.append, drop=drop)
    assert time.monotonic() - t0 < 30, "the hanging run was not stopped"
    outcomes = [Outcome.PASS, Outcome.SKIPPED, Outcome.WRONG_RESULT, Outcome.SKIPPED]
    assert [r.outcome for r in results] == outcomes
    assert results[1].evidence == "not finished: its copy passed"
    assert results[3].evidence == "not run: its copy passed"


def test_a_run_of_ranks_takes_a_worker_per_rank() -> None:
    """--jobs counts processes: a run of N ranks holds N workers (each rank on a GPU holds a
    CUDA context), and a run larger than the workers runs alone."""

    class Iso:
        gpus = ()

    class Running:
        def __init__(self, ranks: int) -> None:
            self.job = dataclasses.replace(job("passes"), ranks=ranks)

    batch = _Batch(Iso(), [], 4, None)
    ranks = lambda n: dataclasses.replace(job("passes"), ranks=n)
    assert batch._fits(ranks(8))  # nothing running: it runs alone
    batch.running = {Running(1), Running(1)}
    assert batch._fits(ranks(2)) and not batch._fits(ranks(3))
    batch.running = {Running(4)}
    assert not batch._fits(job("passes"))


def test_unknown_isolation_mode() -> None:
    with pytest.raises(ValueError, match="isolation mode"):
        Isolator("thread")


def test_server_that_cannot_start_fails_its_runs_with_its_output(monkeypatch, tmp_path) -> None:
    broken = tmp_path / "numpy"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('numpy broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with Isolator("fork") as iso:
        results = iso.run_all([job("passes"), job("passes")])
    for r in results:
        assert r.outcome == Outcome.ERROR
        assert "fork server (cpu) exited (exit status 1)" in r.evidence
        assert "numpy broken on purpose" in r.evidence


def _kill_when(condition, sig: int = signal.SIGKILL) -> threading.Thread:
    """In the background: wait for condition() to name a pid, then signal it."""

    def watch() -> None:
        pid = procs.wait_until(condition, 60.0, 0.01)
        if pid:
            os.kill(pid, sig)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _children(tag: str, *not_these: int) -> list[int]:
    return sorted(set(procs.tagged(tag)) - {os.getpid(), *not_these})


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_killed_child_is_a_crash_and_the_others_finish(monkeypatch, mode) -> None:
    tag = procs.new_tag()
    monkeypatch.setenv(procs.TAG, tag)
    with Isolator(mode) as iso:
        iso.warm("cpu")
        server = iso.servers["cpu"].proc.pid if mode == "fork" else -1
        killer = _kill_when(lambda: (_children(tag, server) or [None])[0])
        results = iso.run_all([job("sleeps_then_passes")] * 3, workers=3)
        killer.join()
    outcomes = sorted(r.outcome.value for r in results)
    assert outcomes == ["crash", "pass", "pass"], [r.evidence for r in results]
    assert "killed by SIGKILL" in next(r.evidence for r in results if r.outcome == Outcome.CRASH)


def test_killed_server_is_restarted_once_then_its_runs_fail(monkeypatch) -> None:
    tag = procs.new_tag()
    monkeypatch.setenv(procs.TAG, tag)
    with Isolator("fork") as iso:
        for attempt in range(2):
            iso.warm("cpu")
            server = iso.servers["cpu"].proc.pid
            killer = _kill_when(lambda s=server: _children(tag, s) and s)
            results = iso.run_all([job("sleeps_then_passes")] * 2, workers=2)
            killer.join()
            if attempt == 0:  # the runs in flight ran again on a new server
                assert [r.outcome for r in results] == [Outcome.PASS] * 2
                assert iso.restarted == {"cpu"}
        assert [r.outcome for r in results] == [Outcome.ERROR] * 2
        assert "fork server (cpu) exited (exit status -9)" in results[0].evidence
    assert procs.survivors(tag, exclude=(os.getpid(),)) == []


def test_child_keeps_its_own_time_limit_without_a_parent(tmp_path) -> None:
    request = job("hangs", timeout_s=0.5).request(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", CHILD_BOOT, str(ROOT), json.dumps(request)])
    assert child.wait(timeout=60) == -signal.SIGALRM  # nobody killed it: its own alarm did


PARENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from harness.fixes import ALL_FIXES
from harness.isolate import Interrupted, Isolator, Job
jobs = [Job("t", "hangs", "tests.children:hangs", ALL_FIXES, "cpu", 600)] * 3
with Isolator(sys.argv[2]) as iso:
    try:
        iso.run_all(jobs, workers=2)
    except Interrupted as e:
        print(json.dumps([[r.outcome.value, r.evidence] for r in e.results]), flush=True)
        raise SystemExit(130)
"""


def _parent(mode: str, tag: str) -> subprocess.Popen:
    env = {**os.environ, procs.TAG: tag}
    return subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ROOT), mode], env=env, stdout=subprocess.PIPE, text=True
    )


def _hanging_children(parent: subprocess.Popen, tag: str, mode: str) -> None:
    """Wait until both hanging children run their child code (fork: the server's children;
    spawn: past exec), then a moment more for the parent to have registered them."""
    marker = "harness.forkserver" if mode == "fork" else "spawned("
    want = 3 if mode == "fork" else 2  # the server carries the fork marker too

    def running() -> bool:
        return sum(marker in procs.cmdline(p) for p in procs.tagged(tag)) >= want

    assert procs.wait_until(running, 60.0), [procs.cmdline(p) for p in procs.tagged(tag)]
    time.sleep(0.5)


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_sigint_kills_every_child_and_reports_every_job(mode) -> None:
    tag = procs.new_tag()
    parent = _parent(mode, tag)
    _hanging_children(parent, tag, mode)
    parent.send_signal(signal.SIGINT)
    out, _ = parent.communicate(timeout=30)
    assert parent.returncode == 130
    assert json.loads(out) == [
        ["skipped", "interrupted"],
        ["skipped", "interrupted"],
        ["skipped", "interrupted before it started"],
    ]
    assert procs.survivors(tag) == []


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_killed_parent_takes_server_and_hanging_children_with_it(mode) -> None:
    tag = procs.new_tag()
    parent = _parent(mode, tag)
    _hanging_children(parent, tag, mode)
    left = list(Path(tempfile.gettempdir(), f"repro-{os.getuid()}").glob(f"{parent.pid}-*"))
    assert left, "the parent keeps its files in a directory of its own"
    parent.kill()
    parent.wait()
    assert procs.survivors(tag) == []
    with Isolator(mode):  # (another test's Isolator may have swept it already)
        assert not any(d.exists() for d in left), "the next Isolator sweeps it"


@pytest.mark.parametrize("target", ["harness.child:noop", "harness.child:cuda_context"])
def test_the_bench_children_pass_on_the_device(device, target) -> None:
    """`repro bench` times these two (a child that does nothing; one that only makes its CUDA
    context): a broken one would time a failure."""
    with Isolator("fork") as isolator:
        result = isolator.run(Job("bench", target, target, ALL_FIXES, device, 60.0))
    assert result.outcome == Outcome.PASS, result.evidence
