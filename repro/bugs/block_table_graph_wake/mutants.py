"""Fix-site mutants of block_table_graph_wake: the in-place refresh partial, short or empty."""

from __future__ import annotations

from harness.record import Mutant
from repro.bugs.block_table_graph_wake import REFRESH

TABLES = "harness/runner/block_table.py"
REFRESH_LINE = "getattr(self, name).copy_(torch.tensor(values, dtype=dtype))"
IN_PLACE_TEST = "if in_place and hasattr(self, name):"

MUTANTS = (
    Mutant(
        "refresh_pointers_only",
        REFRESH,
        "partial",
        TABLES,
        IN_PLACE_TEST,
        'if in_place and hasattr(self, name) and name.endswith("ptrs"):',
        "the pointer tensors are refreshed in place, strides and block sizes rebuilt as new",
    ),
    Mutant(
        "refresh_first_group_only",
        REFRESH,
        "boundary",
        TABLES,
        REFRESH_LINE,
        "getattr(self, name)[:1].copy_(torch.tensor(values[:1], dtype=dtype))",
        "the refresh writes the first KV-cache group's entries only",
    ),
    Mutant(
        "refresh_keeps_tensors_unwritten",
        REFRESH,
        "unused_state",
        TABLES,
        REFRESH_LINE,
        "pass",
        "the existing tensors are kept (same addresses) but their values are not rewritten",
    ),
    Mutant(
        "refresh_skips_input_table_pointers",
        REFRESH,
        "partial",
        TABLES,
        IN_PLACE_TEST,
        'if in_place and hasattr(self, name) and name != "input_block_table_ptrs":',
        "the input tables' pointer tensor is rebuilt as new, the others refreshed in place",
    ),
    Mutant(
        "refresh_shifted_one_row",
        REFRESH,
        "wrong_row",
        TABLES,
        REFRESH_LINE,
        "getattr(self, name)[1:].copy_(torch.tensor(values, dtype=dtype)[:-1])",
        "each value is written one entry further down (the first keeps its stale value)",
    ),
    Mutant(
        "refresh_rebinds_storage",
        REFRESH,
        "partial",
        TABLES,
        REFRESH_LINE,
        "getattr(self, name).data = self.pools.tensor(TAG, values, dtype)",
        "the same tensor objects get new storages (`.data =`): graphs keep the old addresses",
    ),
    Mutant(
        "piecewise_rebuilds_layout",
        REFRESH,
        "partial",
        "harness/runner/model_runner.py",
        "                in_place=Fix.BLOCK_TABLE_REFRESH_IN_PLACE in self.fixes\n",
        "                in_place=Fix.BLOCK_TABLE_REFRESH_IN_PLACE in self.fixes\n"
        "                and self.config.graphs.cudagraph_mode != CUDAGraphMode.PIECEWISE\n",
        "a PIECEWISE runner is taken as graph-free (attention is eager) and rebuilds the layout "
        "tensors, but its pieces gather the tables (found by an independent regression)",
    ),
)
