"""block_table_graph_wake (the hazard of vLLM #53197): graphs read stale layout tensors after wake.

The fix of block_table_wake (#40648) rebuilds the block-table layout tensors (the tables'
addresses, strides, block sizes) as new tensors on wake. A CUDA graph that runs the block-table
gather or the slot mappings holds the old tensors' addresses; after the rebuild it reads memory
that wake left as garbage (or that the allocator has since handed to the new tensors), and
dereferences a wild table address: an illegal memory access at the first replay after wake.
Fix part: build the layout tensors once and refresh them in place on wake.
Run alone: `python -m repro.bugs.block_table_graph_wake`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Fold, Scenario

REFRESH = Fix.BLOCK_TABLE_REFRESH_IN_PLACE
REINIT = Fix.BLOCK_TABLE_REINIT_ON_WAKE  # block_table_wake's part: this one refines it
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)  # CPU: the interpreter's wild read, SIGSEGV


def _replay_after_wake(name: str, mode: str) -> Scenario:
    """A scenario that replays graphs of `mode` gathering the tables, across sleep and wake."""
    return Scenario(
        name,
        (
            Expect(
                frozenset({REINIT}),
                ILLEGAL,
                why="nothing refreshes the layout tensors: block_table_wake itself",
            ),
            Expect(frozenset({REFRESH}), ILLEGAL),
        ),
        timeout_s=240.0,
        axes=Axes(
            graph_modes=(mode,),
            capture_sizes=(4, 16),
            steps_per_size=2,
            sleep_levels=(1, 2),
            wakes=("all at once", "staged"),
        ),
        cpu_signature=r'kernels/block_table\.py", line \d+ in _gather_block_tables_kernel\b',
    )


# where the switches travel as names (repro checkout folds them; repro/fold.py)
FOLD_FILES = (
    "harness/runner/block_table.py",
    "harness/runner/model_runner.py",
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "a gather of the tables inside the target's graphs (tables_in_graph) stands for "
        "upstream's fused draft decode graph (#46849); the fix modelled (copy_ in place) is "
        "closed #53197's, not merged #53508's (which isolates the sleep-mode KV allocations)"
    ),
    evidence=(
        "#53197's description (rebuilt tensors, graphs keep the old addresses, "
        "CUDA_ERROR_ILLEGAL_ADDRESS after wake, fix allocates once and copies in place); #53508's"
        " thread; #40648's review"
    ),
    not_verified="#53508's diff",
)

RECORD = BugRecord(
    id="block_table_graph_wake",
    title="CUDA graphs read the old block-table layout tensors after sleep/wake",
    upstream="https://github.com/vllm-project/vllm/pull/53197",
    symptom=(
        "CUDA_ERROR_ILLEGAL_ADDRESS on the first request after wake, in a graph replay "
        "(upstream: the fused draft decode graph of an MTP/EAGLE speculator)"
    ),
    root_cause=(
        "post_kv_cache_wake_up rebuilds the layout tensors as new tensors; a graph captured "
        "before the sleep keeps reading the old addresses, whose contents wake discarded"
    ),
    trigger=(
        "a graph that runs the block-table gather or slot mappings (tables in the graph), "
        "sleep, wake_up with kv_cache, then a replay"
    ),
    fix_parts=(REFRESH,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        _replay_after_wake("graph_replay_after_wake", "FULL_AND_PIECEWISE"),
        _replay_after_wake("piecewise_replay_after_wake", "PIECEWISE"),
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(Fold(REFRESH, ("in_place",), FOLD_FILES),),
    anchors=(
        (
            REFRESH,
            "vllm/v1/worker/gpu/block_table.py, BlockTables.init_block_table_layout_tensors "
            "(as proposed in #53197): allocate the layout tensors once, and on the wake path "
            "(model_runner.py post_kv_cache_wake_up) copy_ the values into them",
        ),
    ),
    history=(
        "A regression of #46849 (the autoregressive speculator's multi-step draft decode fused "
        "back into one FULL graph, which reads the layout tensors at captured addresses) "
        "against #40648's rebuild. #53197 (refresh in place) was closed without merge; #53508 "
        "fixed it instead by narrowing the kv_cache pool to the KV cache's own allocation, so "
        "persistent metadata keeps its contents across sleep (vllm-ascend #16096 notes that "
        "upstream then stopped calling post_kv_cache_wake_up). "
        "Open upstream in the same family: #55013 (EAGLE3, sleep level 2, FULL_AND_PIECEWISE, "
        "illegal address replaying the draft graph after wake). Upstream's main-model graphs "
        "gather outside the graph; here `tables_in_graph` puts the gather in the target's "
        "graphs to stand for the fused draft graph."
    ),
)
