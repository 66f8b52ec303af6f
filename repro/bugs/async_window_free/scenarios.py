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
# a second run: one draft, rejected by four decodes in a row (launched steps 1-4), 6 tokens,
# a window of 3 tokens (no multiple of the blocks' 2)
ONE_DRAFT, REJECT_RUN, RUN_TOKENS, RUN_WINDOW = 1, (1, 2, 3, 4), 6, 3
# a third: two requests, five blocks; A's first decode preempts B, which resumes once A has
# finished, and its first decode after the resume (launched step 3) is rejected
RESUMED = {"A": ((5, 6, 7), 2), "B": ((20, 21, 22), 4)}
RESUMED_BLOCKS, RESUMED_REJECT = 5, (3,)
# a fourth: blocks of 4 tokens (larger than the window's remainder), one draft, none rejected:
# only the blocks wholly before the window may go
WIDE_TOKENS = 5


def window_config(
    ctx: Context, window: int = 2, num_reqs: int = 1, num_kv_blocks: int = 8, block: int = 2
) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) whose attention sees the last `window` tokens, in
    blocks of `block` tokens (both groups)."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=num_reqs,
        max_num_tokens=8,
        max_model_len=12,
        block_sizes=(block, block),
        num_kv_blocks=num_kv_blocks,
        sliding_window=window,
    )


def rejected_drafts_after_window_free(ctx: Context) -> str:
    """A scheduler one step ahead with two speculative tokens and a sliding window of 2 (blocks
    of 2) serves one request, prompt (5, 9, 13), three tokens. Step 1 prefills positions 0-2;
    step 2 (scheduled before step 1's output) decodes positions 3-5: its sampled token and two
    drafts, which its verification rejects. Step 3 is scheduled while step 2 is in flight, on
    the optimistic count 6 (step 2's three tokens included); the device then starts it at
    position 4 (two drafts rejected), and its first query attends positions 3 and 4.

    A second run has one draft per decode, rejected four times in a row (steps 2-5), six
    tokens, and a window of 3, which is no multiple of the blocks' 2: each decode is scheduled
    while the previous one, which will be rolled back, is in flight, and the free must follow
    the count across successive rollbacks. Step 3 is scheduled on the optimistic count 5 and
    starts at position 4 (its first query attends positions 2-4); step 4 on the optimistic
    count 6 (step 3's two tokens included, one of them rejected) starts at position 5 (it
    attends positions 3-5); steps 5 and 6 start one position on each (6, 7).

    A third run serves two requests, A (5, 6, 7) for two tokens and B (20, 21, 22) for four,
    one draft, a window of 3, five blocks: step 1, A's first decode, needs a third block and
    preempts B (its blocks freed, its count back to 0); A finishes, and B resumes at step 2 by
    prefilling positions 0-3 (its prompt and its first token). Step 3, B's first decode after
    the resume (positions 4-5), is rejected; step 4 is scheduled on the optimistic count 6 and
    starts at position 5. The free must follow the in-flight tokens of a resumed request too.
    A fourth run has blocks of 4 tokens, a window of 3 and one draft, none rejected, five
    tokens: a block the window has partly left (its first position out of the window, the
    rest still read) must stay.

    Fixed: the blocks out of the window are freed on the processed count, 6 - 3 = 3: block 0
    (positions 0, 1) only (in the second run 6 - 2 = 4 at step 4, whose window starts at
    position 2: block 0 again; never a block the next step's window reaches); every step's
    logits match the float64 reference.
    Buggy: freed on the optimistic count 6: blocks 0 and 1 (positions 0-3); position 3 is read
    through the null block, which holds NaN (poison): NaN logits at step 3, no error, on both
    devices (in the second run at step 4: count 6, window start 4, blocks 0 and 1 freed; in
    the third at step 4, B's blocks 0 and 1 freed on its count 6).
    """
    runner, engine = _serve(ctx, NUM_SPEC_TOKENS, (REJECT_STEP,), {"R": (PROMPT, 3)})
    assert len(engine.steps) == 3, f"trigger not reached: {len(engine.steps)} steps, not 3"
    expect_all(engine_problems(runner, engine))
    starts = [int(step.positions[0]) for step in engine.steps]
    runner, engine = _serve(ctx, ONE_DRAFT, REJECT_RUN, {"R": (PROMPT, RUN_TOKENS)}, RUN_WINDOW)
    assert len(engine.steps) == 6, f"trigger not reached: {len(engine.steps)} steps, not 6"
    expect_all(engine_problems(runner, engine))
    run = [int(step.positions[0]) for step in engine.steps]
    runner, engine = _serve(ctx, ONE_DRAFT, RESUMED_REJECT, RESUMED, RUN_WINDOW, RESUMED_BLOCKS)
    resumed = {q.req_id: q.num_preemptions for q in engine.scheduler.finished}
    b_starts = [int(s.positions[0]) for s in engine.steps if s.requests[0].req_id == "B"]
    # B: prefilled beside A, again after its preemption, then decodes from 4 and 5
    if resumed != {"A": 0, "B": 1} or b_starts[-3:] != [0, 4, 5]:
        raise AssertionError(f"trigger not reached: preemptions {resumed}, B at {b_starts}")
    expect_all(engine_problems(runner, engine))
    runner, engine = _serve(ctx, ONE_DRAFT, (), {"R": (PROMPT, WIDE_TOKENS)}, RUN_WINDOW, block=4)
    expect_all(engine_problems(runner, engine))
    return (
        f"steps start at positions {starts}, then {run}; B resumed after a preemption starts "
        f"at {b_starts}; blocks of 4 too: the window read live blocks only"
    )


def _serve(
    ctx: Context,
    num_spec_tokens: int,
    reject_steps: tuple[int, ...],
    requests: dict[str, tuple[tuple[int, ...], int]],
    window: int = 2,
    num_kv_blocks: int = 8,
    block: int = 2,
) -> tuple[ModelRunner, AsyncEngine]:
    """`requests` (id: prompt, tokens) served one step ahead, the drafts of `reject_steps`
    (launched-step indices) rejected, under a sliding window of `window` tokens."""
    runner = ModelRunner(window_config(ctx, window, len(requests), num_kv_blocks, block))
    scheduler = AsyncScheduler(runner.kv_cache, ctx.fixes, num_spec_tokens)
    for req_id, (prompt, max_tokens) in requests.items():
        scheduler.add_request(req_id, prompt, max_tokens)
    engine = AsyncEngine(runner, scheduler, reject_steps=reject_steps)
    engine.run(max_steps=8)
    return runner, engine
