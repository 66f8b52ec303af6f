"""Scenarios of allreduce_flag_epoch (vLLM #46913, ROCm/aiter #3928, SGLang #29508): each
function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import time

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.runner.tensor_parallel import TPSpecRunner
from repro.bugs.car_register_before_replay.scenarios import references, step_inputs, tp_runner

# (tokens, through graphs, with the drafter): eager (before the capture: the communicator's
# first call); size 8's target graph three times in a row (its all-reduce the sole writer of
# the flags between them); size 4's twice; the target's and the drafter's graphs alternating
# (each replay's flags differ from the last); eager again
FIRST = ((5, False, False),)
STEPS = (
    (6, False, True),
    (8, True, False),
    (7, True, False),
    (5, True, False),
    (3, True, False),
    (4, True, False),
    (8, True, True),
    (2, True, True),
    (6, False, False),
)
# then eager and graph calls interleaved, three replayed calls (the target's and the drafter's
# graphs of size 8, the target's of size 4) to one eager call, long enough for the replays'
# calls to outnumber the host's since the capture (a round kept apart for each would meet the
# other's: two consecutive calls with one round, the second's wait passing on the first's flag;
# an independent regression whose eager calls kept the host's round died at the third cycle
# on the CPU, six leave a margin). At the end each rank's device round must equal the calls its
# kernel completed: a round kept apart for either kind of call (or a counter made again) falls
# behind, where the two sequences never meet
CATCH_UP = ((3, False, False), (8, True, True), (4, True, False)) * 6
BREACH = "read its input after the peer had left the end barrier"  # the kernel's BREACHES
ORDER_LIMIT_S = 60.0  # a peer that never reaches its call: the harness broke (never by design)


def lockstep(runner: TPSpecRunner, rank: int, device: str) -> None:
    """Before this rank's next all-reduce call: rank 1 waits until rank 0 has completed that
    call or is spinning in it, waiting for one of rank 1's flags; rank 0 waits until rank 1 has
    completed the call before. So rank 0 always reaches each call first, and the stale read,
    where a flag allows it, happens on every run (an order, never a timing)."""
    comm = runner.comm
    if device == "cuda":
        torch.cuda.synchronize()  # this rank's calls so far are complete
    call = comm.progress(rank)[0] + 1
    deadline = time.monotonic() + ORDER_LIMIT_S
    while True:
        done, spinning = comm.progress(1 - rank)
        if (rank == 0 and done >= call - 1) or (rank == 1 and max(done, spinning) >= call):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {1 - rank} never reached all-reduce call {call}")


def replayed_round_flags(ctx: Context) -> str:
    """Two tensor-parallel ranks, a target and a drafter of one row-parallel projection each,
    their partial sums reduced by the custom all-reduce, whose start and end barriers wait for
    each peer's flag to equal the call's round. Graphs of sizes 8 and 4 are captured inside the
    capture window and registered. Then nine steps, each with new hidden states: eager; size 8's
    target graph three times in a row (steps without the drafter); size 4's twice; target and
    drafter graphs alternating; eager again. Then replays outnumber eager calls (an eager step,
    then the target and drafter graphs of size 8 and the target's of size 4, six times), and
    each rank's device round must equal the calls its kernel completed. A forced order
    (`lockstep`) has rank 0 reach each all-reduce first: rank 1 launches its call only once rank
    0 has completed it or spins in it waiting for rank 1's flag; inside each call, rank 1 reads
    the inputs only once rank 0 has completed the call or spins at its end barrier (the kernel's
    hold, `lag_rank`), and counts a call that rank 0 completed before rank 1's reads (it would
    be free to overwrite its input while rank 1 reads it). Each rank checks its outputs against
    the float64 sum of both ranks' partial products of that step, and that no call was breached.

    Fixed: the round is a counter in device memory the kernel advances at every call, replays
    included (vLLM #46913); rank 0 always finds a flag older than the call's round and spins
    until rank 1's call writes it: every step as reference. Buggy: the round is a host
    argument, frozen into each graph when it was captured; at the second replay in a row of a
    graph, rank 0's flags from rank 1 already hold that value (the last replay left it), its
    wait returns at once, and it sums rank 1's partial of the previous step: rank 0's target
    output is wrong at step 2 (wrong_result; upstream: quick-reduce's silently wrong
    all-reduce in graph mode). The first replay of each graph, graphs alternating, and eager
    calls (the host's round advances) stay right.
    """
    runner = tp_runner(ctx, capture_sizes=(8, 4), lora_cases=(0,), lag_rank=1)
    runner.order = lambda: lockstep(runner, ctx.rank, ctx.device)
    walk(ctx, runner, FIRST, "first", 100)
    runner.capture_model()
    if runner.comm.breaches():
        expect_all([f"capture: rank {ctx.rank} {BREACH}"])
    walk(ctx, runner, STEPS, "step", 0)
    walk(ctx, runner, CATCH_UP, "catch-up", 200)
    problems: list[str | None] = []
    if runner.comm.expired():
        problems.append(f"rank {ctx.rank}: {runner.comm.expired()} waits ran out of spins")
    rounds, done = int(runner.comm.counter.item()), runner.comm.progress(ctx.rank)[0]
    if rounds != done:
        problems.append(f"rank {ctx.rank}: device round {rounds} after {done} calls completed")
    expect_all(problems)
    steps = len(FIRST) + len(STEPS) + len(CATCH_UP)
    return f"{steps} steps as reference, rank 0 first at every all-reduce"


def walk(ctx: Context, runner: TPSpecRunner, steps, label: str, seed: int) -> None:
    """Run `steps` (tokens, through graphs, with the drafter), each with hidden states of its
    own (seeds from `seed` on: a stale read never finds equal values), each rank's outputs
    against the float64 reference. The first step that differs raises (WrongResult): a rank
    that went on would wait on a peer whose calls no longer pair with its own (a hang, where
    the failure was already shown)."""
    hidden_size = runner.hidden.shape[1]
    for i, (n, graphs, draft) in enumerate(steps):
        hidden = step_inputs(seed + i, n, hidden_size).to(ctx.device)
        breaches = runner.comm.breaches()
        target, drafted = runner.step(hidden, 0, use_graph=graphs, draft=draft)
        expected_target, expected_draft = references(runner, hidden.cpu())
        mine = f"{label} {i} ({n} tokens, {'graphs' if graphs else 'eager'}): rank {ctx.rank}"
        problems = [f"{mine} {BREACH}" if runner.comm.breaches() > breaches else None]
        problems.append(close(f"{mine} target vs reference", target, expected_target))
        if draft:
            problems.append(close(f"{mine} drafter vs reference", drafted, expected_draft))
        expect_all(problems)
