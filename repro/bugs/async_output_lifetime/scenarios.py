"""Scenarios of async_output_lifetime (vLLM #29623): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import expect_all
from harness.record import Context
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, updated
from repro.bugs.async_pinned_race.scenarios import (
    STEP_0,
    STEP_1,
    STEP_2,
    async_config,
    ranked,
    token_problems,
    warm_up,
)

# four steps of new requests of the same lengths (each step's kernels are the first's); each
# prompt's best next token leads the next by over 20% of its largest logit, and step 3's best
# tokens are none of steps 1 and 2's in the same row (a step that reads them shows)
STEPS = (STEP_0, STEP_1, STEP_2, {"G": (4, 6, 5), "H": (0, 1)})


def _step(runner: ModelRunner, prompts: dict[str, tuple[int, ...]]):
    for row in range(len(prompts)):  # the last step's requests finished (one token each)
        runner.kv_cache.free(row)
    return runner.execute_model_async([Request(r, p) for r, p in prompts.items()])


def steps_in_flight_back_to_back(ctx: Context) -> str:
    """Async scheduling (upstream: `--async-scheduling`, Model Runner V2's AsyncOutput): each
    step samples its requests' tokens on the main stream into device memory and downloads them
    on the copy stream; the step returns at once and the engine issues the next step before it
    reads the last one's tokens. Steps 0 to 3 prefill two new requests each (same lengths),
    after a warm-up step of their shapes; the host issues steps 0 and 1 (two in flight), reads
    step 0's tokens, issues steps 2 and 3 (step 3 while steps 1 and 2 are unread: three in
    flight), then reads steps 1, 2 and 3. The walk runs twice, on a runner each: first with the
    copy stream late (its copies reach the device only at the host's next wait on them, after
    the main stream's queued work, on both devices), then with the main stream late (the
    device behind the host: a copy's wait for the main stream's work so far is met, and the
    copy runs, before the main stream's later work reaches the device). The sampled tokens'
    device memory comes from an arena that hands a freed slot to the next step, as the caching
    allocator hands a freed block to the next allocation of its size on the main stream.

    Fixed: each output keeps its device tensor until its download completed (upstream: the
    AsyncOutput's references), and its download is issued after its sampling: every step's
    tokens are its requests' best by the float64 reference, in both orders. Buggy: the step's
    last reference dies when it returns; with the copy stream late the next step's sampling
    takes the same memory and writes its tokens before the download reads it: step 0 reads
    step 1's tokens, steps 1 and 2 step 3's (wrong result, silent, on both devices); step 3,
    read after nothing else was issued, is right; with the main stream late every download
    runs before the next step's sampling, and all are right. A download issued before its
    step's sampling (a regression of the fix's order) reads the slot's earlier contents with
    the main stream late (the arena's -1, an earlier step's tokens): wrong from step 1 on.
    """
    ranks, tokens = {}, {}
    for late in ("copy", "main"):
        runner = ModelRunner(updated(async_config(ctx), late_stream=late))
        if not ranks:
            for prompts in STEPS:
                ranks |= ranked(runner, prompts)
        warm_up(runner, ranks["A"][0])
        out = [_step(runner, STEPS[0]), _step(runner, STEPS[1])]
        tokens[late] = [out[0].get_output()]
        out += [_step(runner, STEPS[2]), _step(runner, STEPS[3])]
        tokens[late] += [o.get_output() for o in out[1:]]
    expected = [[ranks[rid][0] for rid in prompts] for prompts in STEPS]
    expect_all(
        [
            token_problems(
                f"{late} stream late: step {i} tokens of {', '.join(STEPS[i])}",
                tokens[late][i],
                expected[i],
            )
            for late in tokens
            for i in range(len(STEPS))
        ]
    )
    return (
        f"four steps, two then three in flight, copy then main stream late: tokens "
        f"{tokens['copy']} as the reference"
    )
