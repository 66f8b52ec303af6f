"""The custom all-reduce (kernels/custom_allreduce.py, harness/runner/custom_allreduce.py) and
the TP runner over it (harness/runner/tensor_parallel.py).

Two ranks forked from the test, joined over gloo, run the kernel on the CPU (Triton's
interpreter): eager sums; the rank-data rows a capture takes, -1 until registration; a graph
replayed in a row with rank 0 first at each call (allreduce_flag_epoch: with the host's round,
rank 0's second replay sums rank 1's last partial). One rank (a world of one) shows the capture
loop's keys: which dummy run replays a graph inside the window (car_register_before_replay); a
load through an unregistered row faults, so that is left to the scenario, which runs in rank
processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import Graph
from harness.runner.custom_allreduce import UNREGISTERED
from harness.runner.parallel import ParallelConfig
from harness.runner.tensor_parallel import TPSpecRunner
from tests import procs

pytestmark = [pytest.mark.distributed, pytest.mark.cpu_job]
REGISTER = pytest.mark.car_register_before_replay
KEY = Fix.DRAFT_GRAPH_LORA_KEY


def _tp(rank: int) -> ParallelConfig:
    return ParallelConfig(world_size=2, rank=rank, tensor_parallel_size=2)


def _eager_sums(rank: int, directory: str, fixes) -> None:
    runner = TPSpecRunner(_tp(rank), "cpu", directory, fixes)
    comm = runner.comm
    for k, n in enumerate((16, 5, 128)):  # several calls, sizes: each a new round
        inp = torch.arange(n, dtype=torch.float32) * (rank + 1) + k
        out = torch.full((n,), float("nan"))
        comm.all_reduce(inp, out)
        expected = torch.arange(n, dtype=torch.float32) * 3 + 2 * k
        assert torch.equal(out, expected), (k, out, expected)
    assert comm.progress(rank)[0] == 3 and comm.progress(1 - rank)[0] >= 2
    assert comm.expired() == 0


@REGISTER
@pytest.mark.allreduce_flag_epoch
@pytest.mark.parametrize("fixes", [ALL_FIXES, ALL_FIXES - {Fix.ALLREDUCE_DEVICE_ROUND}])
def test_eager_all_reduce_sums_every_rank(tmp_path: Path, fixes) -> None:
    procs.forked_ranks(_eager_sums, tmp_path, fixes)


def _registration(rank: int, directory: str) -> None:
    runner = TPSpecRunner(_tp(rank), "cpu", directory, capture_sizes=(8, 4), lora_cases=(1, 0))
    comm = runner.comm
    assert comm.rank_data[1:].eq(UNREGISTERED).all()  # nothing captured yet
    with comm.capture():
        for n in (8, 4):
            for case in (1, 0):
                runner.dummy_run(n, case, graphs=True)
        assert comm.rank_data[1:].eq(UNREGISTERED).all()  # captured, not registered
        assert len(comm.graph_offsets) == 8 and comm.registered == 0
    assert comm.registered == 8 and not comm.rank_data[9:].ne(UNREGISTERED).any()
    bases = [p.data_ptr() for p in comm.graph_inputs.peers]
    for i, offset in enumerate(comm.graph_offsets):  # every rank's input of call i
        assert comm.rank_data[1 + i].tolist() == [b + 4 * offset for b in bases]
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    target, draft = runner.step(hidden, 1)
    reference = hidden.double() @ runner.weights["target"].double()
    assert torch.allclose(target.double(), reference, atol=1e-4)
    assert torch.allclose(draft.double(), reference @ runner.weights["draft"].double(), atol=1e-3)


@REGISTER
def test_captured_calls_take_rows_registered_at_the_window_end(tmp_path: Path) -> None:
    procs.forked_ranks(_registration, tmp_path)


def _capture_loop(fixes, monkeypatch, tmp_path: Path) -> TPSpecRunner:
    """A world of one's capture loop, replays recorded (not run: an unregistered row faults)."""
    runner = TPSpecRunner(ParallelConfig(), "cpu", str(tmp_path), fixes, lora_cases=(2, 1, 0))
    monkeypatch.setattr(Graph, "replay", lambda self: None)
    runner.capture_model()
    return runner


@REGISTER
def test_fixed_each_lora_case_captures_its_draft_graph(monkeypatch, tmp_path: Path) -> None:
    runner = _capture_loop(ALL_FIXES, monkeypatch, tmp_path)
    assert runner.replayed_in_window == []
    drafts = sorted(k for k in runner.graphs if k[0] == "draft")
    assert drafts == [("draft", n, c) for n in (4, 8) for c in (0, 1, 2)]
    assert runner.comm.registered == len(runner.graphs) == 12


@REGISTER
def test_buggy_later_lora_cases_replay_the_draft_graph_in_the_window(
    monkeypatch, tmp_path: Path
) -> None:
    runner = _capture_loop(ALL_FIXES - {KEY}, monkeypatch, tmp_path)
    assert runner.replayed_in_window == [("draft", 8)] * 2 + [("draft", 4)] * 2
    assert runner.comm.registered == len(runner.graphs) == 8


@REGISTER
def test_a_capture_outside_the_window_is_refused(tmp_path: Path) -> None:
    from harness.runner.cudagraph import capturing

    runner = TPSpecRunner(ParallelConfig(), "cpu", str(tmp_path))
    refused = pytest.raises(RuntimeError, match="outside capture")
    with refused, capturing(runner.launch, "cpu", None):
        runner.dummy_run(4, 0)


EPOCH = pytest.mark.allreduce_flag_epoch
ROUND = Fix.ALLREDUCE_DEVICE_ROUND


def _replayed(rank: int, directory: str, fixes) -> None:
    """Size 4's target graph replayed three times in a row, rank 0 first at each call."""
    from repro.bugs.allreduce_flag_epoch.scenarios import lockstep

    runner = TPSpecRunner(_tp(rank), "cpu", directory, fixes, capture_sizes=(4,), lora_cases=(0,))
    runner.capture_model()
    runner.order = lambda: lockstep(runner, rank, "cpu")
    weight = runner.weights["target"]
    partials = []  # per replay: each rank's partial product
    for k in range(3):
        hidden = torch.randn(4, 16, generator=torch.Generator().manual_seed(50 + k))
        out = runner.step(hidden, 0, draft=False)[0].clone()
        partials.append(
            [hidden[:, r * 8 : (r + 1) * 8] @ weight[r * 8 : (r + 1) * 8] for r in (0, 1)]
        )
        right = partials[k][0] + partials[k][1]
        if ROUND in fixes or rank == 1 or k == 0:  # rank 1 always waits for rank 0's flag
            assert torch.allclose(out, right, atol=1e-5), (rank, k)
        else:  # rank 0's wait passed on the last replay's flag: rank 1's last partial
            assert torch.allclose(out, partials[k][0] + partials[k - 1][1], atol=1e-5), k
    assert runner.comm.expired() == 0
    calls = runner.comm.progress(rank)[0]  # the warm-up's two, the capture's none, 3 replays
    assert calls == 2 + 3 and runner.comm.round == 1 + 2 + 2  # the host's: captured ones once
    assert int(runner.comm.counter.item()) == (calls if ROUND in fixes else 0)


@EPOCH
def test_fixed_every_replay_waits_for_the_peers_new_flag(tmp_path: Path) -> None:
    procs.forked_ranks(_replayed, tmp_path, ALL_FIXES)


@EPOCH
def test_buggy_a_second_replay_reads_the_peers_last_partial(tmp_path: Path) -> None:
    procs.forked_ranks(_replayed, tmp_path, ALL_FIXES - {ROUND})


@REGISTER
@EPOCH
@pytest.mark.parametrize("device_round", [True, False])
def test_a_wait_for_a_peer_that_never_comes_is_bounded(device_round) -> None:
    """A peer that never writes its flags: each wait gives up after max_spin loads and counts
    itself in EXPIRED (the caller's check), so no variant can hang in the kernel."""
    from kernels.custom_allreduce import EXPIRED, SIGNAL_WORDS, START, custom_allreduce

    words = [torch.zeros(SIGNAL_WORDS, dtype=torch.int32) for _ in range(2)]
    inputs = [torch.full((4,), 1.0 + r) for r in range(2)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
    out = torch.zeros(4)
    counter = torch.zeros(1, dtype=torch.int32)
    custom_allreduce(table(inputs), table(words), counter, out, 1, 0, device_round, max_spin=50)
    assert words[0][EXPIRED] == 2  # the start and the end wait for rank 1
    assert words[1][START] == 1  # rank 0's flag, written into its peer's words
    assert out.tolist() == [3.0] * 4


@EPOCH
@pytest.mark.parametrize("peer", ["done", "end_spin", "neither"])
def test_a_lagging_rank_counts_a_peer_that_left_before_its_reads(peer) -> None:
    """Rank 1 lags (the scenario's forced order): it reads only once rank 0 completed the call
    or spins at its end barrier, and counts in BREACHES a call rank 0 completed before rank 1
    read its input (an end barrier that let rank 0 through early). Rank 0 is played by its
    words: both its flags of round 1 written, and DONE = 1, END_SPIN = 1 or neither (the hold
    then runs out of spins and counts itself in EXPIRED)."""
    from kernels.custom_allreduce import (
        BREACHES,
        DONE,
        END,
        END_SPIN,
        EXPIRED,
        SIGNAL_WORDS,
        START,
        custom_allreduce,
    )

    words = [torch.zeros(SIGNAL_WORDS, dtype=torch.int32) for _ in range(2)]
    words[1][START + 0] = words[1][END + 0] = 1  # rank 0's flags in rank 1's words
    if peer != "neither":
        words[0][DONE if peer == "done" else END_SPIN] = 1
    inputs = [torch.full((4,), 1.0 + r) for r in range(2)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
    out = torch.zeros(4)
    counter = torch.zeros(1, dtype=torch.int32)
    custom_allreduce(table(inputs), table(words), counter, out, 1, 1, max_spin=50, lag=True)
    assert words[1][EXPIRED] == (1 if peer == "neither" else 0)  # the hold's bound
    assert words[1][BREACHES] == (1 if peer == "done" else 0)
    assert out.tolist() == [3.0] * 4
