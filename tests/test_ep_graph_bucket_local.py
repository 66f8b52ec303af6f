"""ep_graph_bucket_local (SGLang #30450, issue #30242): expert-parallel ranks must replay the
decode graph bucket of the agreed token count. The kernels (kernels/ep_dispatch.py) on buffers
of two "ranks" in one process (an address table of two local tensors), the layer's bucket
choice, and one rank's layer against the float64 MoE. The fault itself (a receiver reading rows
no sender wrote) is left to the scenario, which runs in rank processes: here, the state that
leads to it (the rows stay poisoned)."""

from __future__ import annotations

import types

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.expert_parallel import ExpertParallelMoE
from harness.runner.parallel import Collectives, ParallelConfig
from kernels.ep_dispatch import POISON_IDX, SKIP, ep_dispatch, ep_expert_combine

pytestmark = [pytest.mark.ep_graph_bucket_local, pytest.mark.distributed]

PART = Fix.EP_GRAPH_BUCKET_AGREED
HIDDEN, EXPERTS_PER_RANK, MAX_ROWS = 16, 2, 8


class Ranks:
    """Two ranks' receive and out buffers in one process (poisoned), and their tables."""

    def __init__(self, device: str) -> None:
        rows = 2 * MAX_ROWS
        poison = lambda: torch.full((rows,), POISON_IDX, dtype=torch.int32, device=device)
        self.idx = [poison() for _ in range(2)]
        self.x = [torch.full((rows, HIDDEN), float("nan"), device=device) for _ in range(2)]
        self.out = [torch.full((MAX_ROWS, HIDDEN), float("nan"), device=device) for _ in range(2)]
        table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64).to(device)
        self.idx_table, self.x_table, self.out_table = map(table, (self.idx, self.x, self.out))

    def dispatch(self, x, experts, num_tokens, rows, src) -> None:
        n = torch.tensor([num_tokens], dtype=torch.int32, device=x.device)
        ep_dispatch(x, experts, n, self.idx_table, self.x_table, rows, src, EXPERTS_PER_RANK)


def _tokens(device: str, rows: int, experts: list[int]):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(MAX_ROWS, HIDDEN, generator=gen).to(device)
    e = torch.zeros(MAX_ROWS, dtype=torch.int32)
    e[: len(experts)] = torch.tensor(experts, dtype=torch.int32)
    return x, e.to(device)


def test_dispatch_writes_every_slot_of_the_senders_rows(device) -> None:
    """Rank 1 sends 3 live tokens in a bucket of 4: its rows 4-7 of each rank are written (the
    local expert where the rank owns the token's expert, SKIP elsewhere and for the padding
    slot); every other row keeps its poison."""
    ranks = Ranks(device)
    x, experts = _tokens(device, 4, [0, 3, 2])  # experts 0, 1 on rank 0; 2, 3 on rank 1
    ranks.dispatch(x, experts, 3, rows=4, src=1)
    poison = [POISON_IDX] * 4
    assert ranks.idx[0].tolist()[:12] == [*poison, 0, SKIP, SKIP, SKIP, *poison]
    assert ranks.idx[1].tolist()[:12] == [*poison, SKIP, 1, 0, SKIP, *poison]
    assert torch.equal(ranks.x[0][4], x[0]) and torch.equal(ranks.x[1][5], x[1])
    assert torch.equal(ranks.x[1][6], x[2])
    assert ranks.x[0][5:8].isnan().all() and ranks.x[1][4].isnan().all()  # not theirs


def test_combine_runs_the_named_experts_into_the_sources_out_rows(device) -> None:
    """Both ranks send in one geometry (2 rows each); each rank's experts, read by the same
    geometry, write x @ W[expert] into the source's out row: the float64 product."""
    ranks = Ranks(device)
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(2, EXPERTS_PER_RANK, HIDDEN, HIDDEN, generator=gen)
    sent = {0: ([1, 2], 2), 1: ([3, 0], 1)}  # per source: experts, live tokens
    xs = {}
    for src, (experts, live) in sent.items():
        xs[src], e = _tokens(device, 2 + src, experts)
        ranks.dispatch(xs[src], e, live, rows=2, src=src)
    for rank in range(2):
        w = weights[rank].to(device)
        ep_expert_combine(w, ranks.idx_table, ranks.x_table, ranks.out_table, 2, rank)
    for src, (experts, live) in sent.items():
        for t in range(live):
            owner, local = divmod(experts[t], EXPERTS_PER_RANK)
            want = xs[src][t].double().cpu() @ weights[owner, local].double()
            torch.testing.assert_close(ranks.out[src][t].double().cpu(), want, rtol=1e-5, atol=1e-5)
        assert ranks.out[src][live:].isnan().all()  # nobody's token: never written


def test_a_larger_receiver_bucket_finds_rows_nobody_wrote(device) -> None:
    """The buggy step's state: rank 1 sends by a bucket of 2 (rows 2-3), rank 0 reads source
    1's rows by its bucket of 4 (rows 4-7): poisoned expert indices, which the expert kernel
    would load at (the scenario's fault). By one geometry they are written."""
    ranks = Ranks(device)
    x, e = _tokens(device, 2, [0, 1])
    ranks.dispatch(x, e, 1, rows=2, src=1)
    assert ranks.idx[0][2:4].tolist() == [0, SKIP]
    assert ranks.idx[0][4:8].tolist() == [POISON_IDX] * 4


def test_warm_up_launches_write_nothing(device) -> None:
    ranks = Ranks(device)
    x, e = _tokens(device, 2, [0, 1])
    ranks.dispatch(x, e, 2, rows=0, src=0)
    w = torch.zeros(EXPERTS_PER_RANK, HIDDEN, HIDDEN, device=device)
    ep_expert_combine(w, ranks.idx_table, ranks.x_table, ranks.out_table, 0, 0)
    assert all((t == POISON_IDX).all() for t in ranks.idx)
    assert all(t.isnan().all() for t in ranks.out)


@pytest.mark.parametrize(
    ("local", "agreed", "fixed", "buggy"),
    [(3, 3, 4, 4), (1, 3, 4, 2), (3, 5, 8, 4), (0, 5, 8, 2), (0, 0, 2, 2), (2, 2, 2, 2)],
)
def test_bucket_of_the_agreed_count_fixed_of_the_local_one_buggy(local, agreed, fixed, buggy):
    layer = types.SimpleNamespace(capture_sizes=(2, 4, 8))
    for fixes, want in ((ALL_FIXES, fixed), (ALL_FIXES - {PART}, buggy)):
        layer.fixes = fixes
        assert ExpertParallelMoE.bucket(layer, local, agreed) == want


def test_a_count_past_the_largest_bucket_is_refused() -> None:
    layer = types.SimpleNamespace(capture_sizes=(2, 4, 8), fixes=ALL_FIXES)
    with pytest.raises(ValueError, match="past the largest capture size"):
        ExpertParallelMoE.bucket(layer, 3, 9)


def test_one_rank_layer_replays_its_buckets_as_the_float64_moe(device, tmp_path) -> None:
    """One EP rank (every expert its own): each bucket's graphs replayed, padding slots and an
    idle step included; the output is the float64 MoE in either variant (one rank agrees with
    itself)."""
    parallel = ParallelConfig(world_size=1, rank=0)
    for fixes in (ALL_FIXES, ALL_FIXES - {PART}):
        layer = ExpertParallelMoE(parallel, Collectives(parallel, device), device, tmp_path, fixes)
        gen = torch.Generator().manual_seed(3)
        for n, bucket in ((2, 2), (3, 4), (0, 2), (8, 8), (5, 8)):
            x = torch.randn(n, layer.hidden, generator=gen)
            y = layer.step(x.to(device))
            assert layer.rows == bucket and layer.counts_across_ep == [n]
            want = layer.reference(x)
            torch.testing.assert_close(y.double().cpu(), want, rtol=1e-5, atol=1e-5)
        assert set(layer.graphs) == {2, 4, 8}
