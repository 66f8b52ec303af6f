"""The ranks' machinery (harness/ranks.py): the collective-trace oracle on hand-made traces,
the parallel layout, a rank that faults and ranks that hang (a run of ranks killed from
outside: tests/test_dp_zero_token_skip.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness.fixes import ALL_FIXES
from harness.isolate import Isolator, Job
from harness.outcome import Outcome
from harness.ranks import RankTrace, first_divergence, read_trace
from harness.runner.parallel import ParallelConfig
from repro.registry import BUGS
from tests import procs

pytestmark = pytest.mark.distributed


def entry(step: int, op: str = "all_reduce", shape=(1,), group: str = "dp") -> dict:
    return {"step": step, "op": op, "group": group, "shape": list(shape), "dtype": "int32"}


def trace(rank: int, *events: dict, exited: bool = False) -> RankTrace:
    return RankTrace(rank, {"dp": (0, 1), "tp": (rank,)}, list(events), exited)


def end(step: int) -> dict:
    return {"step_end": step}


def test_equal_traces_agree() -> None:
    events = (entry(0), entry(0, shape=(2,)), end(0), entry(1), entry(1, shape=(2,)), end(1))
    assert first_divergence([trace(0, *events), trace(1, *events)]) is None
    assert first_divergence([trace(0, *events, exited=True), trace(1, *events)]) is None


def test_divergence_at_an_index_names_both_entries() -> None:
    a = trace(0, entry(0), entry(0, shape=(2,)), end(0), entry(1), entry(1, shape=(2,)))
    b = trace(1, entry(0), entry(0, shape=(2,)), end(0), entry(1), entry(1, "broadcast", (2,)))
    assert first_divergence([a, b]) == (
        "step 1: rank 0 all_reduce(dp, (2,), int32) vs rank 1 broadcast(dp, (2,), int32)"
    )


def test_a_rank_that_finished_the_step_without_the_entry() -> None:
    busy = trace(0, entry(0), entry(0, shape=(2,)), end(0), entry(1), entry(1, shape=(2,)))
    idle = trace(1, entry(0), entry(0, shape=(2,)), end(0), entry(1), end(1))
    expected = "step 1: rank 0 all_reduce(dp, (2,), int32) vs rank 1 nothing (finished step 1"
    assert first_divergence([busy, idle]).startswith(expected)
    # the idle rank went on to its next step's collective: the same first divergence
    idle.events.append(entry(2))
    assert first_divergence([busy, idle]).startswith(expected)
    assert first_divergence([idle, busy]).startswith(expected)


def test_a_missing_entry_is_pending_until_the_rank_cannot_issue_it() -> None:
    waiting = trace(0, entry(0), entry(0, shape=(2,)))
    behind = trace(1, entry(0))  # still in step 0: it may yet issue the second
    assert first_divergence([waiting, behind]) is None
    behind.exited = True  # ended cleanly without it
    assert first_divergence([waiting, behind]) == (
        "step 0: rank 0 all_reduce(dp, (2,), int32) vs rank 1 nothing (exited)"
    )


def test_groups_compare_their_own_members_only() -> None:
    # tp groups of one rank each: their entries are nobody else's business
    a = trace(0, entry(0, group="tp"), entry(0))
    b = trace(1, entry(0))
    assert first_divergence([a, b]) is None


def test_read_trace_leaves_a_partial_line(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    header = {"rank": 0, "world_size": 2, "groups": {"dp": [0, 1], "tp": [0]}}
    path.write_text(json.dumps(header) + "\n" + json.dumps(entry(0)) + "\n" + '{"step": 0, "op')
    got = read_trace(path, 0)
    assert got.groups == {"dp": (0, 1), "tp": (0,)}
    assert got.events == [entry(0)]


def test_parallel_config_validates_its_layout() -> None:
    p = ParallelConfig(world_size=4, rank=3, data_parallel_size=2, tensor_parallel_size=2)
    assert (p.dp_rank, p.tp_rank) == (1, 1)
    assert p.groups("dp") == [(0, 2), (1, 3)] and p.group("tp") == (2, 3)
    for bad in (
        {"world_size": 2, "rank": 2, "data_parallel_size": 2},
        {"world_size": 2, "data_parallel_size": 1},
        {"world_size": 2, "data_parallel_size": 2, "expert_parallel_size": 3},
        {"world_size": 0},
    ):
        with pytest.raises(ValueError):
            ParallelConfig(**bad)


def _ranks_job(name: str, timeout_s: float) -> Job:
    return Job("test", name, f"tests.children:{name}", ALL_FIXES, "cpu", timeout_s, ranks=2)


def test_a_rank_that_faults_names_the_run() -> None:
    with Isolator() as iso:
        result = iso.run(_ranks_job("rank_one_segfaults", 120))
    assert result.outcome == Outcome.ILLEGAL_ADDRESS, result.evidence
    assert result.evidence.startswith("rank 1: illegal_address: killed by SIGSEGV"), result.evidence


def test_a_lost_peer_waits_for_a_cause_that_leaves_late() -> None:
    """A rank whose collective lost its peer shows an effect: the coordinator waits for the
    other ranks (CAUSE_WAIT_S), and rank 0's fault, four seconds later, names the run."""
    with Isolator() as iso:
        result = iso.run(_ranks_job("rank_zero_faults_late", 120))
    assert result.outcome == Outcome.ILLEGAL_ADDRESS, result.evidence
    assert result.evidence.startswith("rank 0: illegal_address: killed by SIGSEGV"), result.evidence


def test_a_rank_that_fails_otherwise_than_a_lost_peer_decides_at_once() -> None:
    """The cause decides without waiting for the other ranks to exit: rank 0, still running
    when rank 1 raised, is killed by the coordinator, not waited for (CAUSE_WAIT_S is for a
    rank whose collective lost its peer, an effect)."""
    with Isolator() as iso:
        result = iso.run(_ranks_job("rank_one_raises_rank_zero_lingers", 120))
    assert result.outcome == Outcome.ERROR, result.evidence  # raised in the scenario's own file
    assert result.evidence.startswith("rank 1: error"), result.evidence
    assert "rank 0: running (killed by the coordinator)" in result.evidence, result.evidence


def test_ranks_are_decided_by_their_reports_not_by_their_exits() -> None:
    """Each rank's report is its last act: the coordinator decides, and writes its own report,
    while its ranks are still leaving (the driver tearing their CUDA contexts down); the run's
    result comes then, and no rank outlives the isolator."""
    with Isolator() as iso:
        result = iso.run(_ranks_job("reports_then_lingers", 120))
        assert result.outcome == Outcome.PASS, result.evidence
        pids = [int(p.split(";")[0]) for p in result.evidence.split("pid ")[1:]]
        assert len(pids) == 2, result.evidence
        assert all(procs.alive(p) for p in pids), "decided only after the ranks' exits"
    assert procs.wait_until(lambda: not any(procs.alive(p) for p in pids), 10.0)


def test_host_tensors_take_the_gloo_twin_of_an_nccl_group() -> None:
    """Upstream's batch metadata goes over a gloo cpu_group; under NCCL (one GPU per rank)
    Collectives makes those twins. Run here on gloo ranks whose backend claims NCCL."""
    with Isolator() as iso:
        result = iso.run(_ranks_job("host_collectives_on_twins", 120))
    assert result.outcome == Outcome.PASS, result.evidence


def test_a_hang_of_ranks_is_a_timeout_with_every_rank_stack() -> None:
    with Isolator() as iso:
        # ranks forked from the warm coordinator reach the hang in about a second: 12 s is the
        # run's limit (40 s cost .ci/run half a minute)
        result = iso.run(_ranks_job("ranks_hang", 12))
    assert result.outcome == Outcome.TIMEOUT, result.evidence
    for rank in (0, 1):
        assert f"rank {rank}:\n  File " in result.evidence, result.evidence
    assert "in ranks_hang" in result.evidence, result.evidence


SCENARIO = "zero_token_rank_steps"


def test_the_one_process_tools_refuse_a_scenario_of_ranks() -> None:
    """`repro export BUG kernels.launched` and the Ochiai baseline trace a scenario in one
    process: for a scenario of ranks they say so (exit 2), never a ranking of a crash."""
    done = subprocess.run(
        procs.repro_command("export", "dp_zero_token_skip", "kernels.launched"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "runs as 2 ranks" in done.stderr, done.stderr
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "repro.ochiai",
            "--fail",
            "dp_zero_token_skip:zero_token_rank_steps",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "runs as 2 ranks" in done.stderr, done.stderr


OF_RANKS = [(b, s) for b in BUGS for s in b.scenarios if s.ranks > 1]


@pytest.mark.cpu_job
@pytest.mark.parametrize(
    ("bug", "scenario"),
    [pytest.param(b, s, marks=getattr(pytest.mark, b.id), id=b.id) for b, s in OF_RANKS],
)
def test_a_bug_of_ranks_through_the_command(bug, scenario) -> None:
    """`repro run BUG` of each bug between ranks, as a user runs it: buggy, the record's class
    and its signature (the trace comparison's divergence); fixed, a pass that names its ranks
    and backend; the client never imports torch."""
    out = procs.repro_run(bug.id, "buggy")
    expected = scenario.expected(bug.buggy_variant, "cpu")
    assert f"{scenario.name}: {expected.value} (as expected" in out, out
    assert not scenario.signature or re.search(scenario.signature, out), out
    assert "torch imported: False" in out, out
    out = procs.repro_run(bug.id, "fixed")
    assert f"{scenario.name}: pass (as expected" in out, out
    assert f"{scenario.ranks} ranks, torch.distributed gloo on cpu" in out, out
