"""Scenarios of block_table_wake (vLLM #40648): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.worker import Worker

PROMPTS = ([1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 60, 61])
NEW_TOKENS = 3
# Before any request (an RL trainer's order: load, sleep, wake, then serve), then after each
# generation: (label, level, the wake_up calls' tags).
FIRST = ("before serving: sleep(1) -> wake_up()", 1, (None,))
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(1) -> wake_up([weights]) -> wake_up([kv_cache])", 1, (["weights"], ["kv_cache"])),
    ("sleep(1) -> wake_up([kv_cache]) -> wake_up([weights])", 1, (["kv_cache"], ["weights"])),
    ("sleep(2) -> wake_up()", 2, (None,)),
)


def _generate(runner: ModelRunner, label: str) -> tuple[list[list[int]], list[str | None]]:
    """Greedy tokens, and each step's logits vs the dense float64 reference (every position
    recomputed: the requests have finished, their blocks are freed)."""
    tokens, steps = runner.generate([list(p) for p in PROMPTS], NEW_TOKENS)
    problems = [
        close(
            f"{label}: step {i} logits vs reference",
            logits,
            recomputed_logits(runner, [[*p, *t[:i]] for p, t in zip(PROMPTS, tokens, strict=True)]),
        )
        for i, (_, logits) in enumerate(steps)
    ]
    return tokens, problems


def generate_sleep_wake_generate(ctx: Context) -> str:
    """Sleep and wake before serving anything, generate, then for each cycle: sleep, wake,
    generate again; every step's logits must match the dense float64 reference and the tokens
    must not change.

    Cycles: sleep(1) -> wake_up(); sleep(1) -> wake_up(["weights"]) -> wake_up(["kv_cache"]);
    the same staged the other way (the KV cache first); sleep(2) -> wake_up() (weights
    reloaded). Block-table data_ptr()s must be unchanged across every wake. Fixed: identical
    generations, every step as the reference. Buggy: the block-table gather loads a discarded
    pointer (0xFFFF...): illegal address on the GPU; on the CPU the interpreter's wild read
    kills the child with SIGSEGV (already at the first step, after the wake before serving).
    """
    worker = Worker(
        runner_config(ctx.device, ctx.fixes, dtype=ctx.dtype, enable_lora=False, max_model_len=32)
    )
    runner = worker.model_runner
    tables = runner.kv_cache.block_tables.block_tables
    addresses = [t.data_ptr() for t in tables]
    _sleep_and_wake(worker, *FIRST[1:])
    expected, problems = _generate(runner, FIRST[0])
    for label, level, wakes in CYCLES:
        _sleep_and_wake(worker, level, wakes)
        if [t.data_ptr() for t in tables] != addresses:
            problems.append(
                f"{label}: block tables moved: {addresses} -> {[t.data_ptr() for t in tables]}"
            )
        got, found = _generate(runner, label)
        problems += found
        if got != expected:
            problems.append(f"{label}: generated {got}, before sleeping {expected}")
    expect_all(problems)
    cycles = len(CYCLES) + 1
    return f"{cycles} sleep/wake cycles: identical tokens {expected}, logits as reference"


def _sleep_and_wake(worker: Worker, level: int, wakes) -> None:
    worker.sleep(level)
    for tags in wakes:
        worker.wake_up(tags)
