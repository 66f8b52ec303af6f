"""block_table_wake (vLLM #40648): block-table pointer tensors garbage after sleep/wake.

Model Runner V2 builds its block-table layout tensors (addresses of each group's block table,
strides, block sizes) once, inside the kv_cache memory pool. Sleep releases that pool's
physical memory; wake maps new memory at the same virtual addresses with undefined contents,
so the first kernel that loads a block-table address from the pointer table dereferences
garbage: an illegal memory access. The fix rebuilds them in init_block_table_layout_tensors(),
called from the runner's post_kv_cache_wake_up(), which the worker's wake_up(tags) calls when
tags is None or "kv_cache" in tags. Run alone: `python -m repro.bugs.block_table_wake`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import WAKES, Axes, BugRecord, Expect, Fidelity, Scenario

ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)  # CPU: the interpreter's wild read, SIGSEGV

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "seed 003 (#40648 digest); #40648's thread: dangling layout tensors after a CuMem wake, "
        "an illegal memory access in build_attn_metadata; the fix adds "
        "init_block_table_layout_tensors, called from post_kv_cache_wake_up when tags is None or "
        "holds kv_cache"
    ),
    not_verified="the diff line by line",
)

RECORD = BugRecord(
    id="block_table_wake",
    title="Block-table pointer tensors garbage after sleep/wake",
    upstream="https://github.com/vllm-project/vllm/pull/40648",
    symptom="CUDA illegal memory access after CuMem wake (seen in flashinfer's metadata build)",
    root_cause=(
        "the block-table layout tensors are built once inside the kv_cache pool; wake maps "
        "new memory at the same addresses with undefined contents"
    ),
    trigger="sleep (any level) then wake_up with kv_cache, then any step",
    fix_parts=(Fix.BLOCK_TABLE_REINIT_ON_WAKE,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "generate_sleep_wake_generate",
            (Expect(frozenset({Fix.BLOCK_TABLE_REINIT_ON_WAKE}), ILLEGAL),),
            axes=Axes(graph_modes=("NONE",), sleep_levels=(1, 2), wakes=WAKES),
            cpu_signature='kernels/block_table\\.py", line \\d+ in _gather_block_tables_kernel\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            Fix.BLOCK_TABLE_REINIT_ON_WAKE,
            "vllm/v1/worker/gpu/block_table.py, BlockTables.init_block_table_layout_tensors "
            "(pointer, stride and block-size tensors), called again from "
            "vllm/v1/worker/gpu/model_runner.py post_kv_cache_wake_up, which "
            "vllm/v1/worker/gpu_worker.py wake_up calls when tags is None or has kv_cache",
        ),
    ),
    history=(
        "Review noted that rebuilding (not copying in place) gives the layout tensors new "
        "addresses, which CUDA graphs captured before the sleep would not see; follow-ups "
        "#53197 (registered as block_table_graph_wake) and #53508 refresh them in place (or "
        "keep them out of the kv_cache pool)."
    ),
)
