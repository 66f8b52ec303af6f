"""Scenarios of car_register_before_replay (vLLM #28334, #28318): each function's docstring is
its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.runner.parallel import Collectives, ParallelConfig
from harness.runner.tensor_parallel import TPSpecRunner

SIZES = (8, 4)  # captured sizes, largest first
LORA_CASES = (2, 1, 0)  # active-LoRA counts a size is captured for (0: no LoRA)
# (tokens, LoRA case, through graphs): padded to 4 and to 8, each case, exact sizes, eager
STEPS = ((3, 0, True), (8, 2, True), (5, 1, True), (4, 2, True), (2, 1, True), (6, 0, False))


def tp_runner(ctx: Context, **settings) -> TPSpecRunner:
    """This rank's TP runner of two tensor-parallel ranks (the run's trace gets its header)."""
    if ctx.world_size != 2:
        raise RuntimeError(f"runs as 2 ranks (Scenario.ranks), got world size {ctx.world_size}")
    parallel = ParallelConfig(world_size=2, rank=ctx.rank, tensor_parallel_size=2)
    Collectives(parallel, ctx.device, ctx.trace)
    return TPSpecRunner(parallel, ctx.device, str(Path(ctx.trace).parent), ctx.fixes, **settings)


def step_inputs(step: int, n: int, hidden_size: int) -> torch.Tensor:
    """Step `step`'s hidden states (every rank's alike, different every step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, hidden_size, generator=g)


def references(runner: TPSpecRunner, hidden: torch.Tensor):
    """The target's and the drafter's outputs in float64: hidden @ W, then that @ W'."""
    target = hidden.double() @ runner.weights["target"].double()
    return target, target @ runner.weights["draft"].double()


def capture_window_replay(ctx: Context) -> str:
    """Two tensor-parallel ranks, a target and a drafter of one row-parallel projection each,
    their partial sums reduced by the custom all-reduce (a Triton kernel reading every rank's
    input through the rank-data table). Capture runs inside the all-reduce's capture window:
    per size (8, then 4) and per LoRA case (2, 1, 0 active adapters: graphs specialised per
    case), an eager warm-up and then a dummy run through graphs, the target's then the
    drafter's (upstream: _dummy_run runs drafter.dummy_run). Each captured all-reduce takes a
    rank-data row, -1 until the window's end registers every rank's input addresses. Then six
    steps: padded to each size, each LoRA case, exact sizes and an eager one (the registered
    buffer's path), each rank's outputs against the float64 reference.

    Fixed: the drafter's dummy run takes the target's descriptor, LoRA case included (vLLM
    #28318); each case captures its own draft graph, nothing replays inside the window, and
    every replay after it reads registered rows. Buggy: the drafter's key has no LoRA case;
    size 8's second case finds the draft graph the first captured and replays it inside the
    window, its all-reduce loading every rank's input through the unregistered row: a load at
    address -1 on both ranks, illegal_address (upstream: "illegal memory access" during
    capture, with LoRA graph specialisation and EAGLE, #28334).
    """
    runner = tp_runner(ctx, capture_sizes=SIZES, lora_cases=LORA_CASES)
    runner.capture_model()
    problems = []
    if runner.replayed_in_window:
        problems.append(f"replayed inside the capture window: {runner.replayed_in_window}")
    captured = len(runner.graphs)
    if runner.comm.registered != captured:
        problems.append(f"{runner.comm.registered} all-reduces registered for {captured} graphs")
    hidden_size = runner.hidden.shape[1]
    for i, (n, case, graphs) in enumerate(STEPS):
        hidden = step_inputs(i, n, hidden_size).to(ctx.device)
        target, draft = runner.step(hidden, case, use_graph=graphs)
        expected_target, expected_draft = references(runner, hidden.cpu())
        where = f"step {i} ({n} tokens, LoRA case {case}, {'graphs' if graphs else 'eager'})"
        mine = f"{where}: rank {ctx.rank}"
        problems.append(close(f"{mine} target vs reference", target, expected_target))
        problems.append(close(f"{mine} drafter vs reference", draft, expected_draft))
    if runner.comm.expired():
        problems.append(f"rank {ctx.rank}: {runner.comm.expired()} waits ran out of spins")
    expect_all(problems)
    return f"{captured} graphs captured in the window, none replayed in it; {len(STEPS)} steps ok"
