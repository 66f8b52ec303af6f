"""block_table_wake (vLLM #40648): block-table pointer tensors garbage after sleep/wake.

Model Runner V2 builds its block-table layout tensors (addresses of each group's block table,
strides, block sizes) once, inside the kv_cache memory pool. Sleep releases that pool's
physical memory; wake maps new memory at the same virtual addresses with undefined contents,
so the first kernel that loads a block-table address from the pointer table dereferences
garbage: an illegal memory access. The fix rebuilds them in init_block_table_layout_tensors(),
called from the runner's post_kv_cache_wake_up(), which the worker's wake_up(tags) calls when
tags is None or "kv_cache" in tags. Run alone: `python -m repro.block_table_wake`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.oracle import expect_all
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Context, Expect, Scenario
from harness.runner.model_runner import RunnerConfig
from harness.runner.worker import Worker

PROMPTS = ([1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 60, 61])
NEW_TOKENS = 3
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(1) -> wake_up([weights]) -> wake_up([kv_cache])", 1, (["weights"], ["kv_cache"])),
    ("sleep(2) -> wake_up()", 2, (None,)),
)


def generate_sleep_wake_generate(ctx: Context) -> str:
    """Generate, then for each cycle: sleep, wake, generate again; tokens must not change.

    Cycles: sleep(1) -> wake_up(); sleep(1) -> wake_up(["weights"]) -> wake_up(["kv_cache"]);
    sleep(2) -> wake_up() (weights reloaded). Block-table data_ptr()s must be unchanged across
    every wake. Fixed: identical generations. Buggy: the block-table gather loads a discarded
    pointer (0xFFFF...): illegal address on the GPU; on the CPU the interpreter's wild read
    kills the child with SIGSEGV.
    """
    worker = Worker(RunnerConfig(ctx.device, ctx.fixes, enable_lora=False, max_model_len=32))
    runner = worker.model_runner
    expected = runner.generate([list(p) for p in PROMPTS], NEW_TOKENS)
    tables = runner.kv_cache.block_tables.block_tables
    addresses = [t.data_ptr() for t in tables]
    problems = []
    for label, level, wakes in CYCLES:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)
        if [t.data_ptr() for t in tables] != addresses:
            problems.append(
                f"{label}: block tables moved: {addresses} -> {[t.data_ptr() for t in tables]}"
            )
        got = runner.generate([list(p) for p in PROMPTS], NEW_TOKENS)
        if got != expected:
            problems.append(f"{label}: generated {got}, before sleeping {expected}")
    expect_all(problems)
    return f"{len(CYCLES)} sleep/wake cycles: identical tokens {expected}, tables in place"


ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)  # CPU: the interpreter's wild read, SIGSEGV

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
            generate_sleep_wake_generate,
            (Expect(frozenset({Fix.BLOCK_TABLE_REINIT_ON_WAKE}), ILLEGAL),),
        ),
    ),
    history=(
        "Review noted that rebuilding (not copying in place) gives the layout tensors new "
        "addresses, which CUDA graphs captured before the sleep would not see."
    ),
)


if __name__ == "__main__":
    from harness.cli import run_alone

    run_alone(RECORD.id)
