"""Scenarios of kv_block_stale_nan (vLLM #35219): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, RunnerConfig, runner_config
from harness.runner.worker import Worker

POOL = 4  # blocks per group: the null block, one request's state block and two pages of group 0
FIRST, SECOND = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]  # 5 tokens: page 1 of group 0 holds one
THIRD = [3, 1, 4, 1]  # 4 tokens: page 0 full, page 1 given by the decode step (length 5)
NEW_TOKENS = 2  # the prefill, then a decode step at length 6: slots 2-3 of page 1 unused
# (label, level, the wake_up calls' tags)
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])", 2, (["weights"], ["kv_cache"])),
)


def hybrid_config(ctx: Context) -> RunnerConfig:
    """A hybrid runner (a state group in group 0's blocks) whose decode loads whole pages."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        decode_backend="trtllm",
        num_splits=1,
        hybrid=True,
        num_kv_blocks=POOL,
        max_model_len=16,
    )


def serve(runner: ModelRunner, prompt: list[int], label: str) -> tuple[list[int], dict, list]:
    """One request in row 0: its prefill, then decode steps, each step's logits vs the
    recomputed reference; then it finishes (its blocks freed). Returns its tokens, the blocks
    it held ({"pages": group 0's, "state": its state block}) and the problems found."""
    kv, seq, problems = runner.kv_cache, list(prompt), []
    for step in range(NEW_TOKENS):
        start = 0 if step == 0 else len(seq) - 1
        logits = runner.execute_model([Request("r0", tuple(seq[start:]), 0, start)]).logits
        what = f"{label}: step {step} (length {len(seq)}) logits vs recomputed reference"
        problems.append(close(what, logits, recomputed_logits(runner, [seq])))
        seq.append(int(logits[0].argmax()))
    held = {"pages": list(kv.blocks[0][0]), "state": kv.state_blocks.get(0)}
    kv.free(0)
    return seq[len(prompt) :], held, problems


def recycled_state_block(ctx: Context) -> str:
    """A hybrid runner (a Mamba-like state group whose blocks are group 0's: each request's
    state block is a value page read as int32, -1 where empty) with a decode kernel that loads
    whole KV pages and masks unused slots by their weight, 0 (TRTLLM's and FA3's way), and a
    pool of 3 blocks per group besides the null block. Request A (5 tokens, 2 decode steps)
    holds a state block and two pages of group 0, then finishes; request B (5 tokens) is given
    A's blocks back: its state block is A's page 1, and its page 1 is A's state block, still
    holding A's -1 words (0xFFFFFFFF: NaN read as float32 or bfloat16) in the slots B has not
    written yet.

    Then request C (4 tokens: page 0 full) is given B's blocks back: its prefill takes one
    page, and its decode step, crossing into page 1, is given B's state block, holding B's -1
    words (a page a request grows into mid-generation, not one its prefill took).

    Every step's logits are compared with a float64 reference that recomputes every position.
    Fixed: B's and C's new pages are zeroed before the step that takes them (upstream:
    new_block_ids_to_zero and the KVBlockZeroer), a decode step's as a prefill's: the unused
    slots weigh 0 x 0, every step as the reference. Buggy: B's prefill is right (its attention
    loads only live positions), its decode steps load page 1 whole: 0 x NaN = NaN, the logits
    are NaN (wrong result, on both devices); C's decode the same.
    """
    runner = ModelRunner(hybrid_config(ctx))
    tokens_a, held_a, problems = serve(runner, FIRST, "request A")
    tokens_b, held_b, found = serve(runner, SECOND, "request B (A's blocks)")
    assert held_b["pages"][-1] == held_a["state"], (
        f"trigger not reached: B's pages {held_b['pages']}, A's state block {held_a['state']}"
    )
    tokens_c, held_c, grown = serve(runner, THIRD, "request C (B's blocks, page 1 at decode)")
    assert held_c["pages"][-1] == held_b["state"], (
        f"trigger not reached: C's pages {held_c['pages']}, B's state block {held_b['state']}"
    )
    expect_all(problems + found + grown)
    return (
        f"A {tokens_a}, B {tokens_b}, C {tokens_c}: B's last page is A's state block "
        f"{held_a['state']}, C's (given at its decode) B's, every step as the reference"
    )


def fresh_blocks_after_wake(ctx: Context) -> str:
    """The same hybrid runner in a worker: serve a request, then for each cycle sleep, wake
    and serve it again; its tokens must not change and every step must match the recomputed
    reference. Cycles: sleep(1) -> wake_up(); sleep(2) -> wake_up(["weights"]) ->
    wake_up(["kv_cache"]). The wake leaves every KV byte 0xFF (the CuMem emulation's poison;
    the GPU allocator's too), so every page a request is given after it holds NaN in its unused
    slots, in group 1 (no state tenant: full attention alone, as #51749 generalized the zeroing
    to every attention group) as in group 0.

    Fixed: new pages are zeroed, identical tokens, every step as the reference. Buggy: the
    first decode step after the wake loads NaN pages: NaN logits (wrong result, both devices).
    """
    worker = Worker(hybrid_config(ctx))
    runner = worker.model_runner
    expected, _, problems = serve(runner, FIRST, "before sleeping")
    for label, level, wakes in CYCLES:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)
        got, _, found = serve(runner, FIRST, label)
        problems += found
        if got != expected:
            problems.append(f"{label}: generated {got}, before sleeping {expected}")
    expect_all(problems)
    return f"{len(CYCLES)} sleep/wake cycles: identical tokens {expected}, as the reference"
