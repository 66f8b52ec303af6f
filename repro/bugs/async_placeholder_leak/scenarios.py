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
from harness.runner.model_runner import ModelRunner, RunnerConfig

PROMPTS = {"A": (5, 9, 13), "B": (2, 7, 11)}
MAX_TOKENS = 4


def async_config(ctx: Context) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) with three blocks of four tokens per group: two
    three-token prompts fit, their fifth tokens do not both."""
    return RunnerConfig(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=2,
        max_num_tokens=8,
        max_model_len=8,
        block_sizes=(4, 4),
        num_kv_blocks=3,
    )


def resumed_after_preemption(ctx: Context) -> str:
    """A scheduler one step ahead serves A and B (three-token prompts, four tokens each) on
    three KV blocks per group. Step 1 prefills both; step 2 decodes both, their inputs
    placeholders (-1) that the device fills from step 1's sampled tokens. Scheduling step 3
    (step 2 in flight), A's fifth token needs the last free block and B's none is left: B, the
    last running request, is preempted (blocks freed). When A finishes, B resumes: it prefills
    its five host tokens again (prompt and the two outputs the host has processed by then), in
    a step whose previous one did not hold B.

    Fixed: the worker takes B's tokens from the host (its own row holds -1 where each sampled
    token went); every step's logits match the float64 reference of the host tokens.
    Buggy: B's row keeps its placeholders and no previous-step row fills them: -1 reaches the
    embedding's gather (a device-side assert on the GPU, "index out of range in self" on the
    CPU).
    """
    runner = ModelRunner(async_config(ctx))
    scheduler = AsyncScheduler(runner.kv_cache, ctx.fixes)
    for req_id, prompt in PROMPTS.items():
        scheduler.add_request(req_id, prompt, MAX_TOKENS)
    engine = AsyncEngine(runner, scheduler)
    engine.run(max_steps=12)
    preempted = {q.req_id: q.num_preemptions for q in scheduler.finished}
    assert preempted == {"A": 0, "B": 1}, f"trigger not reached: preemptions {preempted}"
    expect_all(engine_problems(runner, engine))
    return f"{len(engine.steps)} steps, B resumed after one preemption: logits as the reference"
