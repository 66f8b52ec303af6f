"""Child isolation on real children: every way of ending yields exactly one classified result."""

from __future__ import annotations

import pytest

from harness.fixes import ALL_FIXES
from harness.isolate import Isolator, Job
from harness.outcome import Outcome


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
        ("plain_bug_in_scenario", Outcome.ERROR, "KeyError"),
        ("exits_without_report", Outcome.ERROR, "exit 3 without report"),
        ("skips", Outcome.SKIPPED, "needs a compiler"),
        ("no_such_function", Outcome.ERROR, "AttributeError"),
    ],
)
def test_child_outcome_is_classified(isolator, name: str, outcome: Outcome, evidence: str) -> None:
    result = isolator.run(job(name))
    assert result.outcome == outcome, result.evidence
    assert evidence in result.evidence


def test_hanging_child_times_out_and_is_killed(isolator) -> None:
    result = isolator.run(job("hangs", timeout_s=5.0))
    assert result.outcome == Outcome.TIMEOUT, result.evidence
    assert result.seconds < 30, f"kill took {result.seconds:.1f}s"


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


def test_dead_fork_server_is_an_error_not_a_hang() -> None:
    with Isolator("fork") as iso:
        iso.warm("cpu")
        server = iso.servers["cpu"]
        server.proc.kill()
        server.proc.wait()
        result = iso.run(job("passes"))
    assert result.outcome == Outcome.ERROR
    assert "fork server is down" in result.evidence


def test_unknown_isolation_mode() -> None:
    with pytest.raises(ValueError, match="isolation mode"):
        Isolator("thread")


@pytest.mark.gpu
def test_real_device_assert_is_classified_through_later_errors(isolator) -> None:
    cuda_job = Job(
        "test", "assert", "tests.children:cuda_assert_then_cublas", ALL_FIXES, "cuda", 60
    )
    result = isolator.run(cuda_job)
    assert result.outcome == Outcome.DEVICE_ASSERT, result.evidence
