"""Scenarios of partial_wake_forward (vLLM #44483): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.engine import EngineCore, EngineStep
from harness.runner.model_runner import runner_config
from harness.runner.worker import Worker

PROMPT = (1, 2, 3)
# (label, level, the first wake's tags, the second's): a request arrives between the two
STAGED = (
    ("sleep(1) -> wake_up([weights])", 1, ["weights"], ["kv_cache"]),
    ("sleep(1) -> wake_up([kv_cache])", 1, ["kv_cache"], ["weights"]),
    ("sleep(2) -> wake_up([weights])", 2, ["weights"], ["kv_cache"]),
)


def _engine(ctx: Context, idle_dp_rank: bool = False) -> EngineCore:
    config = runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        max_model_len=8,
    )
    return EngineCore(Worker(config), idle_dp_rank)


def _step(engine: EngineCore) -> EngineStep | None:
    """One iteration; on the GPU a fault of its forward surfaces here, not later."""
    ran = engine.step()
    if engine.worker.model_runner.device == "cuda":
        torch.cuda.synchronize()
    return ran


def _served(engine: EngineCore, ran: EngineStep | None, label: str) -> list[str | None]:
    """The waiting request's prefill ran, its logits as the float64 reference's."""
    if ran is None or not ran.requests:
        return [f"{label}: the request was not served ({'nothing' if ran is None else 'dummy'})"]
    reference = step_reference(engine.worker.model_runner, ran.requests)[1]
    return [close(f"{label}: the request's logits vs reference", ran.output.logits, reference)]


def staged_wake_request(ctx: Context) -> str:
    """A request arrives after a partial wake (sleep, then wake_up of one tag), then the other
    tag wakes: the request must wait (nothing runs, the engine stays paused while a tag
    sleeps) and be served once both are awake, its logits as the float64 reference's.

    Cycles: sleep(1) -> wake_up([weights]) (issue #44395's staged wake: an RL trainer brings
    the weights back to update them while the KV cache stays released); the KV cache first;
    sleep(2) -> wake_up([weights]) (the weights reloaded). Fixed: two loop iterations run
    nothing, the request is served after the second wake. Buggy: EngineCore.wake_up resumes
    the scheduler after any wake, so the next iteration runs the request's step against the
    sleeping pool: its first access (the block tables' update in the kv_cache pool; the
    embedding's read of the weights in the kv_cache-first cycle) is an illegal address on the
    GPU (unmapped CuMem memory) and SIGSEGV on the CPU (a PROT_NONE arena).
    """
    engine, problems = _engine(ctx), []
    for label, level, first, second in STAGED:
        engine.sleep(level)
        engine.wake_up(first)
        engine.add_request(PROMPT)
        early = [_step(engine) for _ in range(2)]
        if any(early) or not engine.paused:
            problems.append(f"{label}: ran {early}, paused {engine.paused} before the 2nd wake")
        engine.wake_up(second)
        problems += _served(engine, _step(engine), f"{label} -> wake_up({second})")
    expect_all(problems)
    return f"{len(STAGED)} staged wakes: the request waited for both tags, then as reference"


def idle_dp_rank_dummy_batch(ctx: Context) -> str:
    """An idle rank of a data-parallel group (its peers serve; it runs a one-token dummy batch
    per loop iteration to stay in step with their collectives) through sleep(1) ->
    wake_up([weights]) -> two iterations -> sleep(0) (paused again while asleep: the pause's
    consensus kicks the idle ranks into one more iteration) -> wake_up([kv_cache]) -> one
    iteration -> a request of its own, served as the float64 reference.

    Fixed: dummy batches run only while awake: before the sleep, at the sleep's own consensus
    (before the memory is released), after the last wake; never while a tag sleeps. Buggy:
    the weights wake resumes the scheduler and the idle rank's next dummy batch runs with the
    KV cache released (issue #44395: no request needed); with only the resume fixed, the
    re-pause's consensus iteration does the same (#44483's second half, its DP repro). The
    dummy run's first access, the slot-mapping fill in the kv_cache pool, is an illegal
    address on the GPU and SIGSEGV on the CPU.
    """
    engine = _engine(ctx, idle_dp_rank=True)
    ran = [_step(engine)]
    engine.sleep(1)
    engine.wake_up(["weights"])
    asleep = [_step(engine) for _ in range(2)]
    engine.sleep(0)
    engine.wake_up(["kv_cache"])
    ran.append(_step(engine))
    engine.add_request(PROMPT)
    served = _step(engine)
    problems = _served(engine, served, "after the last wake")
    if any(asleep):
        problems.append(f"a forward ran while the KV cache slept: {asleep}")
    if not all(r is not None and not r.requests for r in ran):
        problems.append(f"the idle rank's dummy batches did not run while awake: {ran}")
    expect_all(problems)
    return "dummy batches while awake only; the request as reference"
