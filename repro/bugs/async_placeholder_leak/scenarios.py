"""Scenarios of async_placeholder_leak (vLLM #40768, closed; issue #37159): each function's
docstring is its bug report.

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

PROMPTS = {"A": (5, 9, 13), "B": (2, 7, 11)}
MAX_TOKENS = 4
# a second run: A runs on (seven tokens) while B finishes and C, preempted, resumes beside it
ALONGSIDE = {"A": ((5,), 7), "B": ((2, 7, 11), MAX_TOKENS), "C": ((3, 8, 12), MAX_TOKENS)}
# a third run: two drafts per decode and a budget of four tokens a step: B, whose decode needs
# three while A's takes three, is skipped for a step and scheduled again at position 2
SKIPPED = {"A": ((5, 9), MAX_TOKENS), "B": ((2, 7), 2)}
NUM_SPEC_TOKENS, BUDGET = 2, 4
# a fourth: B alone, a budget of two tokens: its first decode (three tokens, its prefill in
# flight) does not fit, so that step schedules nothing; the next one decodes at position 2
ALONE, ALONE_BUDGET = {"B": ((2, 7), 3)}, 2


def async_config(ctx: Context, num_reqs: int = 2, num_kv_blocks: int = 3) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) with three blocks of four tokens per group: two
    three-token prompts fit, their fifth tokens do not both. (The second run: three requests
    on four blocks.)"""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=num_reqs,
        max_num_tokens=8,
        max_model_len=8,
        block_sizes=(4, 4),
        num_kv_blocks=num_kv_blocks,
    )


def _serve(
    ctx: Context,
    requests: dict[str, tuple[tuple[int, ...], int]],
    num_kv_blocks: int,
    num_spec_tokens: int = 0,
    budget: int = 0,
) -> tuple[ModelRunner, AsyncEngine, dict[str, int]]:
    """Serve `requests` (prompt, max tokens) one step ahead, with `num_spec_tokens` drafts per
    decode and a token budget per step (0: none); the preemptions per request."""
    runner = ModelRunner(async_config(ctx, len(requests), num_kv_blocks))
    scheduler = AsyncScheduler(runner.kv_cache, ctx.fixes, num_spec_tokens, budget)
    for req_id, (prompt, max_tokens) in requests.items():
        scheduler.add_request(req_id, prompt, max_tokens)
    engine = AsyncEngine(runner, scheduler)
    engine.run(max_steps=12)
    return runner, engine, {q.req_id: q.num_preemptions for q in scheduler.finished}


def resumed_after_preemption(ctx: Context) -> str:
    """A scheduler one step ahead serves A and B (three-token prompts, four tokens each) on
    three KV blocks per group. Step 1 prefills both; step 2 decodes both, their inputs
    placeholders (-1) that the device fills from step 1's sampled tokens. Scheduling step 3
    (step 2 in flight), A's fifth token needs the last free block and B's none is left: B, the
    last running request, is preempted (blocks freed). When A finishes, B resumes: it prefills
    its five host tokens again (prompt and the two outputs the host has processed by then), in
    a step whose previous one did not hold B. (That previous step launched nothing: A's last
    token was in flight.)

    A second run resumes a request beside one that keeps running, so the step before the
    resume holds another request's row: A (a one-token prompt, seven tokens), B and C
    (three-token prompts, four tokens each) on four blocks per group. Scheduling step 3, B
    takes the last free block and C, the last running request, is preempted with its step 2 in
    flight; B finishes, its two blocks come free, and C prefills its five host tokens again in
    step 6, beside A's decode, after a step 5 that held A alone; A and C then decode once more
    together.

    A third run skips a request for a step and schedules it again past position 0 (upstream:
    the token budget, max_num_scheduled_tokens, with speculative decoding): two drafts per
    decode, a budget of four tokens a step, A and B (two-token prompts; four tokens, two) on
    four blocks per group. Step 1 prefills both; step 2 decodes A (its sampled token and two
    drafts: three tokens) and skips B, whose decode would take three more; step 3, step 2 in
    flight, decodes A (three tokens) and B at position 2 (one token: its sampled token, on the
    host by then), in a step whose previous one did not hold B.

    A fourth run serves B alone under a budget of two tokens: step 1 prefills it; step 2
    schedules nothing (B's decode, three tokens with its prefill in flight, does not fit) and
    launches nothing; step 3 decodes B at position 2 (one token: nothing in flight), after a
    step that held no request at all.

    Fixed: the worker takes B's (and C's) tokens from the host (its own row holds -1 where
    each sampled token went); every step's logits match the float64 reference of the host
    tokens.
    Buggy: B's row (in the second run C's) keeps its placeholders and no previous-step row
    fills them: -1 reaches the embedding's gather (a device-side assert on the GPU, "index out
    of range in self" on the CPU); in the third run, B's token at position 2.
    """
    runner, engine, preempted = _serve(
        ctx, {r: (p, MAX_TOKENS) for r, p in PROMPTS.items()}, num_kv_blocks=3
    )
    assert preempted == {"A": 0, "B": 1}, f"trigger not reached: preemptions {preempted}"
    expect_all(engine_problems(runner, engine))
    steps = len(engine.steps)
    runner, engine, preempted = _serve(ctx, ALONGSIDE, num_kv_blocks=4)
    assert preempted == {"A": 0, "B": 0, "C": 1}, f"trigger not reached: preemptions {preempted}"
    expect_all(engine_problems(runner, engine))
    alongside = len(engine.steps)
    runner, engine, preempted = _serve(ctx, SKIPPED, 4, NUM_SPEC_TOKENS, BUDGET)
    held = [[(q.req_id, q.num_computed_tokens) for q in step.requests] for step in engine.steps]
    skipped = [[("A", 0), ("B", 0)], [("A", 2)], [("A", 5), ("B", 2)]]
    assert held == skipped, f"trigger not reached: steps {held}, not {skipped}"
    expect_all(engine_problems(runner, engine))
    runner, engine, _ = _serve(ctx, ALONE, 4, NUM_SPEC_TOKENS, ALONE_BUDGET)
    held = [[(q.req_id, q.num_computed_tokens) for q in step.requests] for step in engine.steps]
    # after the empty step nothing is in flight: B's decode at 2 is one token, no drafts
    alone = [[("B", 0)], [("B", 2)], [("B", 3)]]
    if held != alone or len(engine.steps[1].positions) != 1:
        raise AssertionError(f"trigger not reached: steps {held}, not {alone} after an empty one")
    expect_all(engine_problems(runner, engine))
    return (
        f"{steps} steps, B resumed after one preemption; {alongside} steps, C resumed beside A; "
        "B skipped once; B alone after an empty step: logits as the reference"
    )
