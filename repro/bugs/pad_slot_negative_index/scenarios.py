"""Scenarios of pad_slot_negative_index (vLLM #43869, issue #43810): each function's docstring
is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits, step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, RunnerConfig, runner_config

POOL = 2  # group 0's blocks: the seeded free list hands out block 1, the pool's last, first
BLOCK = 4  # group 0's block size
# 5 tokens: positions 0-3 fill block 1 (position 3 in the pool's last slot), 4 is in block 0
PROMPT = (5, 9, 13, 2, 7)
# each mode's captured sizes: A's decode (1 token) replays the smallest, in PIECEWISE a padded
# count under the largest captured size
MODES = ((CUDAGraphMode.FULL, (4,)), (CUDAGraphMode.PIECEWISE, (2, 4)))


def extract_config(
    ctx: Context, mode: CUDAGraphMode, sizes: tuple[int, ...] = (4,)
) -> RunnerConfig:
    """A runner with a cache-only layer on group 0's blocks, graphs of `sizes` tokens (up to 4
    requests)."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=mode,
        cudagraph_sizes=sizes,
        block_sizes=(BLOCK, 16),
        num_kv_blocks=POOL,
        max_num_reqs=4,
        max_num_tokens=8,
        max_model_len=8,
        extract_hidden_states=True,
    )


def serve_and_extract(runner: ModelRunner, label: str, dummy_run: bool = False) -> list[str | None]:
    """Request A's prefill (5 tokens: over the graph sizes, eager), then one decode step (the
    smallest graph: its padding tokens have slot -1), with `dummy_run` then an eager dummy run
    of one token (every slot -1) while A holds its blocks; then A's hidden states read back
    from the cache-only layer's cache by its slots (the connector's read) vs the float64
    reference of every position, and the decode step's logits vs the recomputed reference."""
    seq = list(PROMPT)
    first = runner.execute_model([Request("A", PROMPT)])
    seq.append(int(first.logits[0].argmax()))
    decode = runner.execute_model([Request("A", (seq[-1],), 0, len(PROMPT))])
    if dummy_run:  # an idle DP rank's step (or a warm-up): eager, padded throughout
        # (upstream: the dummy batch's slot mappings are PAD_SLOT_ID everywhere)
        runner.execute_model(dummy_run=True, num_tokens=1, num_reqs=1)
    kv = runner.kv_cache
    held = kv.blocks[0][0]
    smallest = min(runner.config.graphs.cudagraph_sizes)
    graph = decode.desc and decode.desc.num_tokens
    assert graph == smallest and held[0] == POOL - 1, (
        f"trigger not reached: graph {decode.desc}, A's blocks {held} (the last is {POOL - 1})"
    )
    slots = [kv.slot(0, 0, p) for p in range(len(seq))]
    hidden = step_reference(runner, [Request("ref", tuple(seq))])[0]
    return [
        close(
            f"{label}: A's {len(seq)} extracted hidden states (slots {slots}) vs reference",
            runner.cache_only.extract(slots),
            hidden,
        ),
        close(
            f"{label}: decode logits vs reference", decode.logits, recomputed_logits(runner, [seq])
        ),
    ]


def padded_decode_after_prefill(ctx: Context) -> str:
    """A cache-only layer (extract_hidden_states) stores every token's final hidden state in
    a cache of its own on group 0's blocks (block size 4, a pool of 2 blocks) through group 0's
    slot mapping. Request A's 5-token prefill runs eagerly (no graph of 5): block 1, the
    pool's last, gets positions 0-3, so position 3 sits in the pool's last slot. A's decode
    step replays the smallest graph, its padding tokens with slot -1: in FULL mode (graphs of 4)
    the graph of 4 (3 padding tokens), in PIECEWISE mode (graphs of 2 and 4) the graph of 2 (1
    padding token; padded to a size under the largest captured). Then an eager dummy run of one
    token (an idle DP rank's step, a warm-up: no graph, every slot -1) while A still holds
    block 1. Then A's 6 hidden states are read back by their slots and compared with the
    float64 reference (the write is captured in both modes, and eager in the dummy run).

    Fixed: the write skips slot -1 (the cache-write kernel), in replays and eager steps alike:
    every state as the reference. Buggy: torch indexing writes the padding rows at block -1,
    offset 3: position 3's state is replaced by a padding token's, silently (wrong result on
    both devices; the step's logits stay right: no attention reads this cache); the eager
    dummy run writes its token there again. A fix applied to graph captures only (eager steps
    assumed unpadded) passes the replays and fails at the dummy run: position 3 holds the dummy
    token's state. Without graphs (NONE) a real step is not padded; a dummy run still is.
    """
    problems = []
    for mode, sizes in MODES:
        runner = ModelRunner(extract_config(ctx, mode, sizes))
        runner.capture_model()
        problems += serve_and_extract(runner, f"{mode.value}, graphs of {sizes}", dummy_run=True)
    expect_all(problems)
    shown = "; ".join(f"{m.value} (graphs of {s})" for m, s in MODES)
    return f"{shown}: A's extracted hidden states as the reference"
