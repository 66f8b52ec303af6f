"""Block tables through pointer tables: kernels vs references, and layout tensors after wake."""

from __future__ import annotations

import pytest
import torch

from harness.runner.block_table import BlockTables
from harness.runner.sleep_mode import make_pools
from kernels.block_table import gather_block_tables_reference, slot_mappings_reference

pytestmark = pytest.mark.block_table_wake  # the layout tensors of vLLM #40648

BLOCK_SIZES = (4, 16)  # two KV-cache groups


def _tables(device: str) -> tuple[BlockTables, object]:
    pools = make_pools(device)
    tables = BlockTables(
        BLOCK_SIZES, max_num_reqs=5, max_num_tokens=32, max_model_len=61, pools=pools
    )
    gen = torch.Generator().manual_seed(5)
    for req, length in enumerate((9, 61, 1, 30, 17)):
        ids = [
            torch.randperm(200, generator=gen)[: -(-length // size)].tolist()
            for size in BLOCK_SIZES
        ]
        tables.set_row(req, ids)
    return tables, pools


def _batch(device: str):
    idx_mapping = torch.tensor([3, 0, 4], dtype=torch.int32)  # batch rows -> request rows
    query_start_loc = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    positions = torch.tensor([25, 26, 27, 28, 29, 8, 10, 11, 12, 13, 14, 15, 16])
    return idx_mapping.to(device), query_start_loc.to(device), positions.to(device)


def _check(tables: BlockTables, device: str) -> None:
    idx_mapping, query_start_loc, positions = _batch(device)
    got = tables.gather_block_tables(idx_mapping)
    expected = gather_block_tables_reference(
        tables.block_tables, idx_mapping.cpu(), tables.num_blocks.cpu()
    )
    for g in range(len(BLOCK_SIZES)):
        assert torch.equal(got[g].cpu(), expected[g]), f"group {g} input block table"
    slots = tables.compute_slot_mappings(query_start_loc, positions).cpu()
    assert torch.equal(
        slots,
        slot_mappings_reference(expected, BLOCK_SIZES, query_start_loc.cpu(), positions.cpu()),
    )


def test_kernels_read_through_pointer_tables(device) -> None:
    tables, _ = _tables(device)
    _check(tables, device)


def test_layout_tensors_are_garbage_after_wake_until_rebuilt(device) -> None:
    tables, pools = _tables(device)
    addresses = [t.data_ptr() for t in tables.block_tables]
    saved = [t.clone() for t in tables.block_tables]
    saved_counts = tables.num_blocks.clone()
    pools.sleep(offload_tags=("weights",))
    pools.wake_up()
    assert [t.data_ptr() for t in tables.block_tables] == addresses
    assert (tables.block_table_ptrs.cpu() == -1).all(), "stale pointers read 0xFFFF..."
    for table, copy in zip(tables.block_tables, saved, strict=True):
        table.copy_(copy)  # the scheduler re-sends block ids for live requests
    tables.num_blocks.copy_(saved_counts)
    tables.init_block_table_layout_tensors()  # what post_kv_cache_wake_up does
    _check(tables, device)


LAYOUT = ("block_table_ptrs", "input_block_table_ptrs", "block_table_strides", "block_sizes_tensor")


@pytest.mark.block_table_graph_wake
@pytest.mark.parametrize("in_place", [False, True])
def test_layout_tensors_rebuilt_or_refreshed_in_place(device, in_place) -> None:
    """Rebuilt: new tensors (what a captured graph no longer sees); in place: the same tensors,
    whose values are the live ones again after wake."""
    tables, pools = _tables(device)
    before = {name: getattr(tables, name) for name in LAYOUT}
    values = {name: t.clone() for name, t in before.items()}
    pools.sleep()
    pools.wake_up()
    tables.init_block_table_layout_tensors(in_place=in_place)
    for name, old in before.items():
        now = getattr(tables, name)
        assert (now is old) == in_place, name
        assert torch.equal(now.cpu(), values[name].cpu()), name
        if not in_place:  # the old tensor still holds what wake left: 0xFF bytes
            assert (old.cpu().view(torch.uint8) == 0xFF).all(), name
