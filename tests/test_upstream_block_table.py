"""Upstream's block-table cases as regression tests of the gather and slot-mapping launchers (the
cases are vLLM's; the tests are written here). Each case writes request rows into one table per
KV-cache group, gathers the batch's rows through the pointer tables (identity batch, as upstream)
and maps each token to block * block_size + position % block_size; both checked against the ids
the case wrote (not against the launchers' own path) and upstream's hand-computed slots. The
request tables hold a stale id past each row's blocks (upstream's start zeroed; stale tails are
the hazard of vLLM #39589): the gather must write zeros there.

From tests/v1/worker/test_gpu_block_table.py (Model Runner V2's BlockTables, on main): the rows
its staged-write tests leave in three groups of block sizes 16, 32 and 8 (one row empty), and in
one group of 16; the real request of its padding test (block size 4, blocks 7 and 8, positions
1-3: slots 29-31); the enabled group of its custom-slot-mapping test (block size 262144, block
12, positions 153797 and 165757); the unsharded group of its DCP test (block size 128, blocks
10-17, positions 0-1023: position + 1280, the same for each of its 4 ranks). Not expressible:
the staged-write (append) kernel itself (rows are written here directly), the PAD_SLOT_ID of a
batch row mapped to -1, of a group without slot mapping and of the padded tail (the launchers
write no padding: the tail keeps its sentinel), DCP sharding, zeroed dummy tables, the v1
BlockTable's move_row (host-side).

From tests/v1/worker/test_block_table_slot_mapping.py (vLLM PR #51017, open in the stored copy;
the v1 BlockTable's slot mapping): block size 16, 8 request rows of 32 blocks, 2048 tokens; its
two hand-computed cases, its six boundary and ragged cases, and 1030 tokens across its 1024-token
tile (positions 1023-1029 at slots 1039-1045). Not expressible: its hybrid kernel blocks, DCP
ranks and slot-mapping mode NONE. Every case runs on the CPU and on a GPU. The groups of a case
are equally wide: upstream's cases cannot see a gather that writes the widest group's width.
The v1 BlockTable tests (test_block_table.py, test_gpu_input_batch.py) are host-side only; the
fused gather of test_block_table_kernels.py (PR #34660, closed) compares two kernels."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.block_table import compute_slot_mappings, gather_block_tables

pytestmark = pytest.mark.block_table_wake  # the pointer tables of vLLM #40648

SENTINEL = -7  # gathered rows past the batch and slots past its tokens keep it
STALE = 999  # request-table entries past a row's blocks: a longer earlier occupant's (#39589)


def _case(block_sizes, max_reqs, max_blocks, rows, positions=None, slots=None, tokens=0):
    """A case: rows[r][g] = request row r's block ids in group g; positions[r] = the tokens
    request r schedules; slots = upstream's expected slots of group 0 (a list, or {token: slot});
    tokens = the slot-mapping buffer (upstream's max_num_batched_tokens)."""
    return (block_sizes, max_reqs, max_blocks, rows, positions, slots, tokens)


GPU_BLOCK_TABLE = {
    "staged_writes_three_groups": _case(
        (16, 32, 8), 4, (8, 8, 8), [([1, 2], [10, 11], []), ([3], [12], [5, 6])]
    ),
    "staged_writes_three_groups_appended": _case(
        (16, 32, 8), 4, (8, 8, 8), [([1, 2, 7], [10, 11, 13], [8]), ([3], [12], [5, 6])]
    ),
    "staged_writes_single_group": _case((16,), 2, (4,), [([1, 2],)]),
    "dummy_tables_real_step": _case((16,), 4, (8,), [([1, 2],)]),
    "dummy_request_real_half": _case((4,), 2, (4,), [([7, 8],)], [[1, 2, 3]], [29, 30, 31], 16),
    "custom_slot_mapping_group": _case(
        (262144,),
        1,
        (1,),
        [([12],)],
        [[153797, 165757]],
        [12 * 262144 + 153797, 12 * 262144 + 165757],
        4,
    ),
    "dcp_unsharded_group": _case(
        (128,),
        1,
        (8,),
        [(list(range(10, 18)),)],
        [list(range(1024))],
        list(range(1280, 2304)),
        1024,
    ),
}
RAGGED = [[1, 2, 3, 4], [10, 11], [20, 21, 22], [30], [40, 41]]
SLOT_MAPPING_PR = {
    "hand_block_boundaries": ([[5, 6, 7]], [[0, 15, 16, 47]], [80, 95, 96, 127]),
    "hand_two_rows": ([[9, 2], [7, 4]], [[3], [20]], [147, 68]),
    "single_token": ([[9]], [[0]], None),
    "first_and_last_position_in_block": ([[8, 2, 5]], [[0, 15, 16, 31, 32]], None),
    "spans_many_blocks": ([[3, 7, 1, 5]], [list(range(64))], None),
    "non_contiguous_blocks": ([[100, 3, 57, 12, 88, 1]], [list(range(96))], None),
    "ragged_multi_request": (RAGGED, [list(range(n)) for n in (60, 20, 33, 1, 17)], None),
    "prefix_offset": ([[5, 6, 7, 8, 9, 10]], [list(range(70, 90))], None),
}
CASES = {
    **GPU_BLOCK_TABLE,
    **{
        name: _case((16,), 8, (32,), [(ids,) for ids in rows], positions, slots, 2048)
        for name, (rows, positions, slots) in SLOT_MAPPING_PR.items()
    },
    "beyond_a_1024_tile": _case(
        (16,),
        8,
        (65,),
        [(list(range(1, 66)),)],
        [list(range(1030))],
        dict(zip(range(1023, 1030), range(1039, 1046), strict=True)),
        2100,
    ),
}


def _gather_and_map(device, block_sizes, max_reqs, max_blocks, rows, positions, tokens):
    """The launchers on tables holding `rows`: (gathered tables, slot mappings or None)."""
    i32 = dict(dtype=torch.int32, device=device)
    tables = [torch.full((max_reqs, n), STALE, **i32) for n in max_blocks]
    num_blocks = torch.zeros(len(block_sizes), max_reqs, **i32)
    for r, groups in enumerate(rows):
        for g, ids in enumerate(groups):
            tables[g][r, : len(ids)] = torch.tensor(ids, **i32)
            num_blocks[g, r] = len(ids)
    gathered = [torch.full((max_reqs, n), SENTINEL, **i32) for n in max_blocks]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)
    strides = torch.tensor(max_blocks, dtype=torch.int64, device=device)
    idx = torch.arange(len(rows), **i32)
    gather_block_tables(idx, ptrs(tables), ptrs(gathered), strides, num_blocks, max(max_blocks))
    if positions is None:
        return [t.cpu() for t in gathered], None
    starts = torch.tensor([0, *itertools.accumulate(map(len, positions))], **i32)
    flat = torch.tensor([p for request in positions for p in request], device=device)
    slots = torch.full((len(block_sizes), tokens), SENTINEL, dtype=torch.int64, device=device)
    sizes = torch.tensor(block_sizes, **i32)
    compute_slot_mappings(starts, flat, ptrs(gathered), strides, sizes, slots, tokens)
    return [t.cpu() for t in gathered], slots.cpu()


@pytest.mark.parametrize("case", CASES)
def test_upstream_block_table_cases(device, case) -> None:
    block_sizes, max_reqs, max_blocks, rows, positions, slots, tokens = CASES[case]
    gathered, got = _gather_and_map(
        device, block_sizes, max_reqs, max_blocks, rows, positions, tokens
    )
    for g, n in enumerate(max_blocks):
        for r, groups in enumerate(rows):
            ids = groups[g]
            assert gathered[g][r].tolist() == ids + [0] * (n - len(ids)), (g, r)
        assert (gathered[g][len(rows) :] == SENTINEL).all(), f"group {g}: a row past the batch"
    if positions is None:
        return
    flat = [(r, p) for r, request in enumerate(positions) for p in request]
    for g, size in enumerate(block_sizes):
        want = [rows[r][g][p // size] * size + p % size for r, p in flat]
        assert got[g, : len(flat)].tolist() == want, f"group {g}"
        assert (got[g, len(flat) :] == SENTINEL).all(), f"group {g}: a slot past the tokens"
    anchors = slots if isinstance(slots, dict) else dict(enumerate(slots or ()))
    assert {t: int(got[0, t]) for t in anchors} == anchors, "upstream's hand-computed slots"
