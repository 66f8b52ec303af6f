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
# active-LoRA counts each size is captured for (0: no LoRA), the scenario's two runners: three
# cases, then the runner's default two; and each one's steps (tokens, LoRA case, through
# graphs): padded to 4 and to 8, each case, exact sizes, an eager one (the registered buffer)
RUNNERS = (
    ("car", (2, 1, 0), ((3, 0, True), (8, 2, True), (5, 1, True), (4, 2, True), (2, 1, True),
                        (6, 0, False))),
    ("car-two", (1, 0), ((4, 1, True), (7, 0, True), (3, 1, False))),
)  # fmt: skip


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
    per size (8, then 4) and per LoRA case (graphs specialised per case), an eager warm-up and
    then a dummy run through graphs, the target's then the drafter's (upstream: _dummy_run runs
    drafter.dummy_run). Each captured all-reduce takes a rank-data row, -1 until the window's
    end registers every rank's input addresses. Two runners, one after the other: three LoRA
    cases (2, 1, 0 active adapters), then the default two (1, 0). Each then runs steps padded
    to each size, each LoRA case, exact sizes and an eager one (the registered buffer's path):
    each rank's outputs against the float64 reference, and each step through graphs replays
    two captured graphs, the target's and the drafter's (a drafter run eagerly after the window
    lost its graphs).

    Fixed: the drafter's dummy run takes the target's descriptor, LoRA case included (vLLM
    #28318); each case captures its own draft graph, nothing replays inside the window, and
    every replay after it reads registered rows. Buggy: the drafter's key has no LoRA case;
    size 8's second case finds the draft graph the first captured and replays it inside the
    window, its all-reduce loading every rank's input through the unregistered row: a load at
    address -1 on both ranks, illegal_address (upstream: "illegal memory access" during
    capture, with LoRA graph specialisation and EAGLE, #28334).
    """
    problems, report = [], []
    for name, cases, steps in RUNNERS:
        runner = tp_runner(ctx, capture_sizes=SIZES, lora_cases=cases, name=name)
        runner.capture_model()
        if runner.replayed_in_window:
            problems.append(
                f"{cases}: replayed inside the capture window: {runner.replayed_in_window}"
            )
        captured = len(runner.graphs)
        if runner.comm.registered != captured:
            problems.append(
                f"{cases}: {runner.comm.registered} all-reduces registered for {captured} graphs"
            )
        problems += walk(ctx, runner, steps, f"LoRA cases {cases}")
        if runner.comm.expired():
            problems.append(f"rank {ctx.rank}: {runner.comm.expired()} waits ran out of spins")
        report.append(f"{cases}: {captured} graphs captured, none replayed in the window")
    expect_all(problems)
    return f"{'; '.join(report)}; every step as the reference, every graph step two replays"


def walk(ctx: Context, runner: TPSpecRunner, steps, label: str) -> list[str | None]:
    """Run `steps`; each rank's outputs against the reference, and each step through graphs
    replaying two graphs (the target's and the drafter's)."""
    problems: list[str | None] = []
    hidden_size = runner.hidden.shape[1]
    for i, (n, case, graphs) in enumerate(steps):
        hidden = step_inputs(i, n, hidden_size).to(ctx.device)
        before = len(runner.replayed)
        target, draft = runner.step(hidden, case, use_graph=graphs)
        replayed = runner.replayed[before:]
        expected_target, expected_draft = references(runner, hidden.cpu())
        where = (
            f"{label}, step {i} ({n} tokens, LoRA case {case}, {'graphs' if graphs else 'eager'})"
        )
        mine = f"{where}: rank {ctx.rank}"
        problems.append(close(f"{mine} target vs reference", target, expected_target))
        problems.append(close(f"{mine} drafter vs reference", draft, expected_draft))
        if len(replayed) != (2 if graphs else 0):
            problems.append(
                f"{mine}: graphs replayed {replayed}, want the target's and the drafter's"
            )
    return problems
