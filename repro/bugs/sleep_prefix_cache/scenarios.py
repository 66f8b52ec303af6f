"""Scenarios of sleep_prefix_cache (vLLM #22726): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.worker import Worker

# 5 and 6 tokens over blocks of 2 and 4: a repeat hits their first 4 (whole blocks of both)
PROMPTS = ([3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8])
NEW_TOKENS = 1
# (label, level, the wake_up calls' tags)
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])", 2, (["weights"], ["kv_cache"])),
)
# a sliding window reserves the null block (block 0 of each group, never on a free list)
WINDOW = 6


def _generate(runner: ModelRunner, label: str) -> tuple[list[list[int]], list[int], list]:
    """Greedy tokens, the tokens each prompt found in the prefix cache, and each step's logits
    vs the float64 reference that recomputes every position (it reads no cached block)."""
    tokens, steps = runner.generate([list(p) for p in PROMPTS], NEW_TOKENS)
    hits = [q.num_computed_tokens for q in steps[0][0]]
    problems = [
        close(
            f"{label} (cached tokens {hits}): step {i} logits vs recomputed reference",
            logits,
            recomputed_logits(runner, [[*p, *t[:i]] for p, t in zip(PROMPTS, tokens, strict=True)]),
        )
        for i, (_, logits) in enumerate(steps)
    ]
    return tokens, hits, problems


def repeat_prompts_after_wake(ctx: Context) -> str:
    """Prefix caching on (blocks of 2 and 4 tokens): serve two prompts, serve them again (each
    hits its first 4 tokens in the prefix cache: the cache works), then for each cycle sleep,
    wake and serve them again. Cycles: sleep(1) -> wake_up(); sleep(2) -> wake_up(["weights"])
    -> wake_up(["kv_cache"]). Every step's logits must match a reference that recomputes every
    position, and the tokens must not change.

    Fixed: the sleep resets the prefix cache (no request holds blocks: the reset is not refused),
    so the first serve after a wake computes every token again. Buggy: the hashes survive the
    sleep, the repeat hits blocks whose contents the sleep discarded (0xFF after the wake, NaN
    K/V): NaN logits from the first step after the first wake (wrong result, both devices).

    Then the same with a sliding window of 6 tokens (a second runner, the first cycle only):
    the window reserves the null block of each group, which is never on a free list and is
    always in use (upstream's BlockPool counts it so). Fixed: the reset is not refused for it,
    the serve after the wake computes every token again. A reset that counts every block
    missing from a free list as held is always refused under a window: the hashes survive
    that sleep and the repeat reads discarded memory the same way.
    """
    problems = []
    for window, cycles in ((0, CYCLES), (WINDOW, CYCLES[:1])):
        worker = Worker(
            runner_config(
                ctx.device,
                ctx.fixes,
                dtype=ctx.dtype,
                enable_lora=False,
                cudagraph_mode=CUDAGraphMode.NONE,
                block_sizes=(2, 4),
                max_model_len=8,
                enable_prefix_caching=True,
                sliding_window=window,
            )
        )
        runner, tag = worker.model_runner, f"window {window}: " if window else ""
        expected, _, found = _generate(runner, f"{tag}first serve")
        again, hits, more = _generate(runner, f"{tag}repeat before sleeping")
        assert hits == [4, 4] and again == expected, f"the prefix cache did not serve: hits {hits}"
        problems += found + more
        for label, level, wakes in cycles:
            worker.sleep(level)
            for tags in wakes:
                worker.wake_up(tags)
            got, _, found = _generate(runner, f"{tag}after {label}")
            problems += found
            if got != expected:
                problems.append(f"{tag}after {label}: generated {got}, before sleeping {expected}")
    expect_all(problems)
    return (
        f"{len(CYCLES)} sleep/wake cycles, one more under a window of {WINDOW}: identical "
        "tokens, as the reference"
    )
