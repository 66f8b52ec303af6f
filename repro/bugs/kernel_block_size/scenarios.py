"""Scenarios of kernel_block_size (vLLM #27753; issues #27264, #26936): each function's
docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits, step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, RunnerConfig, runner_config

MANAGER, KERNEL = (8, 16), (4, 16)  # group 0: manager blocks of 8 tokens, kernel blocks of 4
POOL = 10  # manager blocks per group: the seeded free list hands group 0's block 2 out first
PROMPT = (5, 9, 13, 2, 7)  # 5 tokens, then one decode: 6 positions in manager block 2
# the main runner's graphs (FULL_AND_PIECEWISE): the prefill replays the PIECEWISE graph of 8
# tokens, the decode the FULL decode graph of 2 requests (a padding row)
GRAPH_SIZES = (2, 8)
REPLAYED = ("piecewise 8", "full 2")
# the other splits, each on an axis a later change could treat apart (which group is split,
# a hybrid runner, a decode backend that pages by the cache's kernel view): (label, manager
# and kernel block sizes, pool, hybrid, decode backend, each group's manager blocks the seeded
# free lists hand out: every kernel block id read, at either size, stays inside the pool)
SPLITS = (
    # group 1 split alone (16 into 8), its decode through the split-KV backend (FlashMLA's)
    ("group 1 split, split-KV decode", ((8, 16), (8, 8)), POOL, False, "flashmla", [[2], [1]]),
    # a hybrid runner (a state group in group 0's blocks, its state block handed out first),
    # its decode loading whole pages (FlashInfer's TRTLLM kernels' way)
    ("hybrid, whole-page decode", ((8, 16), (4, 16)), 6, True, "trtllm", [[1], [1]]),
)


def split_config(
    ctx: Context,
    sizes: tuple[tuple[int, ...], tuple[int, ...]] = (MANAGER, KERNEL),
    pool: int = POOL,
    hybrid: bool = False,
    decode_backend: str = "paged",
    mode: CUDAGraphMode = CUDAGraphMode.NONE,
) -> RunnerConfig:
    """A runner without LoRA (eager unless `mode`: then a PIECEWISE graph of 8 tokens and 2
    requests, a FULL decode graph of 2) whose group 0 attends in kernel blocks of half the
    KV manager's (or the split `sizes`: manager, kernel)."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=mode,
        cudagraph_sizes=GRAPH_SIZES,
        block_sizes=sizes[0],
        kernel_block_sizes=sizes[1],
        num_kv_blocks=pool,
        max_num_reqs=2,
        max_num_tokens=8,
        max_model_len=16,
        hybrid=hybrid,
        decode_backend=decode_backend,
    )


def prefill_then_decode(ctx: Context) -> str:
    """Group 0's KV manager hands out blocks of 8 tokens; its attention kernel pages the cache
    in blocks of 4 (upstream: a hybrid model's manager block, sized to the Mamba state's page,
    is not a size the attention backend supports, so each manager block is split into kernel
    blocks). The block table holds kernel blocks (manager block 2 becomes kernel blocks 4 and 5)
    and the slot mapping is computed in them; group 1 (16 and 16) is not split. Request A's
    5-token prefill, then one decode step; each step's logits vs the float64 reference, which
    recomputes every position, and the decode's vs one that reads the prompt's K/V from the
    cache at the manager's slots (the layout every other reader of the cache assumes). This
    runner captures FULL_AND_PIECEWISE graphs first (upstream's order: the capture's attention
    metadata is built from dummy batches, through the same builders), and each step first
    replays its graph, the prefill the PIECEWISE graph of 8 tokens (its attention runs eagerly
    on the capture's metadata), the decode the FULL decode graph of 2 requests (its attention
    launches, with their block size, are in the graph), checked against the reference, and
    then runs again eagerly (the same K/V to the same slots).

    The same request then runs on two other runners: group 1 split alone (16 into 8; group 0
    not), its decode through the split-KV backend (FlashMLA's, which pages by the cache's
    kernel view, not by the builder's size); and a hybrid runner (a state group in group 0's
    blocks, the record's own case) with group 0 split as above, its decode loading whole
    pages (TRTLLM's, also paging by the kernel view).

    Fixed: attention is told the kernel block size (4): position p reads kernel block
    table[p // 4], slot table[p // 4] * 4 + p % 4: A's own K/V, in whichever group is split,
    hybrid or not; and each split group's cache is viewed in kernel pages (the decode backends
    read it so).
    Buggy: attention is told the manager's (8): position p reads table[p // 8] * 8 + p % 8,
    slots 32-37 of manager block 4, which no request wrote (zeros): every logit wrong, no
    error (upstream: gsm8k 0.02 on Qwen3-Next, #27547), replayed or eager; on the other
    runners the same in the split group's prefill (their decodes page by the view, right
    either way). Metadata built with the manager's size for dummy batches only (they hold only
    block 0, so it "cannot matter") passes every eager step but not the replays: the graphs
    keep their capture's size (8), both replayed steps' logits wrong. The same on both
    devices: the reads stay inside the pool here (kernel block ids below each pool's size); a
    larger id reads past it, an unchecked load: neighbours' bytes, or a fault at a wild
    address.
    """
    runner = ModelRunner(split_config(ctx, mode=CUDAGraphMode.FULL_AND_PIECEWISE))
    runner.capture_model()  # upstream's order: graphs first, from dummy batches
    problems = _serve(runner, "", graphs=True)
    held = runner.kv_cache.blocks[0][0]
    assert held == [2], f"trigger not reached: A's manager blocks in group 0 {held}, not [2]"
    for label, sizes, pool, hybrid, backend, blocks in SPLITS:
        runner = ModelRunner(split_config(ctx, sizes, pool, hybrid, backend))
        problems += _serve(runner, f"{label}: ")
        held = runner.kv_cache.blocks[0]
        assert held == blocks, f"trigger not reached ({label}): A's manager blocks {held}"
    expect_all(problems)
    return (
        "group 0 in kernel blocks of 4 under manager blocks of 8 (each step replayed, PIECEWISE "
        "8 and FULL 2, then eager), group 1 split alone, a hybrid runner: both steps as the "
        "reference"
    )


def _serve(runner: ModelRunner, label: str, graphs: bool = False) -> list[str | None]:
    """Request A in row 0: its prefill and one decode step, each vs the references; with
    `graphs`, each step first replays its graph (checked too), then runs again eagerly (the
    same K/V to the same slots)."""
    seq = list(PROMPT)
    problems: list[str | None] = []
    if graphs:
        problems += _replayed(runner, Request("A", PROMPT), seq, REPLAYED[0], "prefill")
    first = runner.execute_model([Request("A", PROMPT)], use_cudagraph=False)
    problems += [
        close(f"{label}prefill logits vs reference", first.logits, recomputed_logits(runner, [seq]))
    ]
    seq.append(int(first.logits[0].argmax()))
    step = Request("A", (seq[-1],), 0, len(PROMPT))
    if graphs:
        problems += _replayed(runner, step, seq, REPLAYED[1], "decode")
    decode = runner.execute_model([step], use_cudagraph=False)
    problems += [
        close(
            f"{label}decode logits vs reference", decode.logits, recomputed_logits(runner, [seq])
        ),
        # the reference reads the prompt's K/V at the KV manager's slots: the cache layout
        close(
            f"{label}decode logits vs the cache at the manager's slots",
            decode.logits,
            step_reference(runner, [step])[1],
        ),
    ]
    return problems


def _replayed(runner: ModelRunner, step: Request, seq: list[int], graph: str, what: str):
    """`step` through its graph (`graph`: the one it must replay) vs the reference."""
    out = runner.execute_model([step])
    ran = out.desc and f"{out.desc.cg_mode.value} {out.desc.num_tokens}"
    assert ran == graph, f"trigger not reached: the {what} ran {ran or 'eagerly'}, not {graph}"
    reference = recomputed_logits(runner, [seq])
    return [close(f"{what} logits ({graph} replay) vs reference", out.logits[:1], reference)]
