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
from harness.runner.model_runner import ModelRunner, RunnerConfig

MANAGER, KERNEL = (8, 16), (4, 16)  # group 0: manager blocks of 8 tokens, kernel blocks of 4
POOL = 10  # manager blocks per group: the seeded free list hands group 0's block 2 out first
PROMPT = (5, 9, 13, 2, 7)  # 5 tokens, then one decode: 6 positions in manager block 2


def split_config(ctx: Context) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) whose group 0 attends in kernel blocks of half the
    KV manager's."""
    return RunnerConfig(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        block_sizes=MANAGER,
        kernel_block_sizes=KERNEL,
        num_kv_blocks=POOL,
        max_num_reqs=2,
        max_num_tokens=8,
        max_model_len=16,
    )


def prefill_then_decode(ctx: Context) -> str:
    """Group 0's KV manager hands out blocks of 8 tokens; its attention kernel pages the cache
    in blocks of 4 (upstream: a hybrid model's manager block, sized to the Mamba state's page,
    is not a size the attention backend supports, so each manager block is split into kernel
    blocks). The block table holds kernel blocks (manager block 2 becomes kernel blocks 4 and 5)
    and the slot mapping is computed in them; group 1 (16 and 16) is not split. Request A's
    5-token prefill, then one decode step; each step's logits vs the float64 reference, which
    recomputes every position, and the decode's vs one that reads the prompt's K/V from the
    cache at the manager's slots (the layout every other reader of the cache assumes).

    Fixed: attention is told the kernel block size (4): position p reads kernel block
    table[p // 4], slot table[p // 4] * 4 + p % 4: A's own K/V.
    Buggy: attention is told the manager's (8): position p reads table[p // 8] * 8 + p % 8,
    slots 32-37 of manager block 4, which no request wrote (zeros): every logit wrong, no
    error (upstream: gsm8k 0.02 on Qwen3-Next, #27547). The same on both devices: the
    reads stay inside the pool here (kernel block ids below POOL); a larger id reads past
    it, an unchecked load: neighbours' bytes, or a fault at a wild address.
    """
    runner = ModelRunner(split_config(ctx))
    seq = list(PROMPT)
    first = runner.execute_model([Request("A", PROMPT)])
    held = runner.kv_cache.blocks[0][0]
    assert held == [2], f"trigger not reached: A's manager blocks in group 0 {held}, not [2]"
    problems = [
        close("prefill logits vs reference", first.logits, recomputed_logits(runner, [seq]))
    ]
    seq.append(int(first.logits[0].argmax()))
    step = Request("A", (seq[-1],), 0, len(PROMPT))
    decode = runner.execute_model([step])
    problems += [
        close("decode logits vs reference", decode.logits, recomputed_logits(runner, [seq])),
        # the reference reads the prompt's K/V at the KV manager's slots: the cache layout
        close(
            "decode logits vs the cache at the manager's slots",
            decode.logits,
            step_reference(runner, [step])[1],
        ),
    ]
    expect_all(problems)
    return "group 0 in kernel blocks of 4 under manager blocks of 8: both steps as the reference"
