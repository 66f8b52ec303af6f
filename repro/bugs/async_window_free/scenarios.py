"""Scenarios of async_window_free (vLLM #47728; issue #47282): each function's docstring is its
bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.async_oracle import engine_problems
from harness.oracle import expect_all
from harness.record import Context
from harness.runner.async_engine import AsyncEngine
from harness.runner.async_scheduler import AsyncScheduler
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model_runner import ModelRunner, RunnerConfig, runner_config

PROMPT = (5, 9, 13)
NUM_SPEC_TOKENS = 2
REJECT_STEP = 1  # the second launched step (the first decode) rejects both drafts
# a second run: one draft, rejected by three decodes in a row (launched steps 1-3), 5 tokens
ONE_DRAFT, REJECT_RUN, RUN_TOKENS = 1, (1, 2, 3), 5


def window_config(ctx: Context) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) whose attention sees the last 2 tokens, in blocks
    of 2 tokens (both groups)."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=1,
        max_num_tokens=8,
        max_model_len=12,
        block_sizes=(2, 2),
        num_kv_blocks=8,
        sliding_window=2,
    )


def rejected_drafts_after_window_free(ctx: Context) -> str:
    """A scheduler one step ahead with two speculative tokens and a sliding window of 2 (blocks
    of 2) serves one request, prompt (5, 9, 13), three tokens. Step 1 prefills positions 0-2;
    step 2 (scheduled before step 1's output) decodes positions 3-5: its sampled token and two
    drafts, which its verification rejects. Step 3 is scheduled while step 2 is in flight, on
    the optimistic count 6 (step 2's three tokens included); the device then starts it at
    position 4 (two drafts rejected), and its first query attends positions 3 and 4.

    A second run has one draft per decode, rejected three times in a row (steps 2-4), five
    tokens: each decode is scheduled while the previous one, which will be rolled back, is in
    flight, and the free must follow the count across successive rollbacks. Step 3 is scheduled
    on the optimistic count 5 (step 2's two tokens included) and starts at position 4 (its
    first query attends positions 3 and 4); steps 4 and 5 start one position on each (5, 6).

    Fixed: the blocks out of the window are freed on the processed count, 6 - 3 = 3: block 0
    (positions 0, 1) only (in the second run 5 - 2 = 3 at step 3, and so on: never a block the
    next step's window reaches); every step's logits match the float64 reference.
    Buggy: freed on the optimistic count 6: blocks 0 and 1 (positions 0-3); position 3 is read
    through the null block, which holds NaN (poison): NaN logits at step 3, no error, on both
    devices (in the second run the same at step 3: count 5, blocks 0 and 1 freed).
    """
    runner, engine = _serve(ctx, NUM_SPEC_TOKENS, (REJECT_STEP,), 3)
    assert len(engine.steps) == 3, f"trigger not reached: {len(engine.steps)} steps, not 3"
    expect_all(engine_problems(runner, engine))
    starts = [int(step.positions[0]) for step in engine.steps]
    runner, engine = _serve(ctx, ONE_DRAFT, REJECT_RUN, RUN_TOKENS)
    assert len(engine.steps) == 5, f"trigger not reached: {len(engine.steps)} steps, not 5"
    expect_all(engine_problems(runner, engine))
    run = [int(step.positions[0]) for step in engine.steps]
    return f"steps start at positions {starts}, then {run}: the window read live blocks only"


def _serve(
    ctx: Context, num_spec_tokens: int, reject_steps: tuple[int, ...], max_tokens: int
) -> tuple[ModelRunner, AsyncEngine]:
    """PROMPT served one step ahead for `max_tokens` tokens, the drafts of `reject_steps`
    (launched-step indices) rejected."""
    runner = ModelRunner(window_config(ctx))
    scheduler = AsyncScheduler(runner.kv_cache, ctx.fixes, num_spec_tokens)
    scheduler.add_request("R", PROMPT, max_tokens)
    engine = AsyncEngine(runner, scheduler, reject_steps=reject_steps)
    engine.run(max_steps=8)
    return runner, engine
