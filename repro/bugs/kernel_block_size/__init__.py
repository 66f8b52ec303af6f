"""kernel_block_size (vLLM #27753; issues #27264, #26936): attention told the KV manager's block
size over tables in kernel blocks.

A hybrid model's KV manager sizes its blocks to the Mamba state's page, a size the attention
backend may not support; the runner then splits each manager block into kernel blocks (vLLM
#24486): the cache is viewed in kernel pages and the block tables and slot mappings are in
kernel blocks. The metadata builders were still given the manager's block size
(kv_cache_spec.block_size): attention walked the kernel-block table as if each entry held a
manager block and loaded the wrong pages (#27547: "garbage loads", gsm8k 0.02). The fix passes
the kernel block size to the builders.
Run alone: `python -m repro.bugs.kernel_block_size`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.KERNEL_BLOCK_SIZE_TO_BUILDERS
# in-bounds loads of the wrong pages (the scenario keeps every kernel block id below the pool's
# block count): numbers, not a fault, on both devices
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#27753's description (pass the kernel block size to the metadata builders; solves #27264"
        " and #26936); #36701"
    ),
    not_verified=(
        "#27547 (the gsm8k 0.02 vs 0.85 figures); the detailed indexing path is the project's "
        "reading; the diff"
    ),
)

RECORD = BugRecord(
    id="kernel_block_size",
    title="Attention metadata built with the KV manager's block size over kernel-block tables",
    upstream="https://github.com/vllm-project/vllm/pull/27753",
    symptom=(
        "hybrid models (Mamba or linear attention with full attention: Qwen3-Next, Nemotron-H) "
        "whose attention kernel block size differs from the KV manager's produce gibberish: "
        "gsm8k exact match 0.02 instead of 0.85 on Qwen3-Next with FlashInfer (#27547), no error"
    ),
    root_cause=(
        "the GPU model runner built each attention group's metadata builder with the KV cache "
        "spec's block size (the manager's) while the cache view, the block table and the slot "
        "mapping were in kernel blocks; the attention kernel indexed the kernel-block table by "
        "position // manager block size and paged by the manager's size: the wrong pages"
    ),
    trigger=(
        "a KV-cache group whose kernel block size is smaller than its manager block size (a "
        "hybrid model whose manager block is aligned to the state page); any request whose "
        "blocks are not all block 0"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "prefill_then_decode",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                # the main runner: each step replayed (PIECEWISE 8, FULL decode 2), then eager
                graph_modes=("NONE", "FULL_AND_PIECEWISE"),
                capture_sizes=(2, 8),
                steps_per_size=1,
                # SPLITS: group 1 split alone; a hybrid runner
                states=(
                    "a later KV group split",
                    "hybrid groups",
                    "split KV group replayed on capture metadata",
                ),
            ),
            signature="prefill logits vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py: the attention groups' metadata builders are "
            "created with the kernel block size (#27753: 'pass the kernel block size to the "
            "metadata builders'); the expansion of manager blocks into kernel blocks in the "
            "block table and slot mapping came with #24486 (vllm/v1/worker/block_table.py) "
            "and, for Model Runner V2, #38831 (vllm/v1/worker/gpu/block_table.py: "
            "kernel_block_sizes, blocks_per_kv_block)",
        ),
    ),
    history=(
        "Verified with search (2026-11), from PR descriptions, not the diffs line by line: "
        "#27753 (merged; opened 2025-10-29) solves issues #27264 and #26936: the GPU model "
        "runner now passes the kernel block size to the metadata builders ('a pretty bad bug "
        "that exists on main'), and restricts FlashAttention's kernel block sizes for hybrid "
        "models (block size >= 128 read partial blocks whose fp32 Mamba bytes are NaN: "
        "kv_block_stale_nan's relative, lifted by #36701 once #35219 zeroed new blocks). "
        "#27547 (closed) found the intermix of kv_manager_block_size and kernel_block_size "
        "('garbage loads in attn kernel') with gsm8k 0.0197 before, 0.8514 after on "
        "Qwen3-Next. #24486 (merged) decoupled the kernel block size from the page size with a "
        "block-table conversion; #26476 chose the kernel block size more simply; #27843 "
        "(closed) hard-coded FlashInfer's size as a stopgap; #29084 limited #27753's FA "
        "restriction to hybrid models. Model Runner V2: #38831 (merged; approved 2026-05-18) added "
        "kernel_block_sizes and blocks_per_kv_block to its block tables; #42888 (closed) "
        "reported FlashInfer's builder still paging by the manager's 128 under MRV2 (a "
        "relative, not modelled). Issues #27264 and #26936 were not read themselves. "
        "Modelled: RunnerConfig.cache.kernel_block_sizes; KVCache views each group's cache in "
        "kernel "
        "pages and BlockTables expands manager blocks into kernel blocks; the builder's size "
        "reaches paged_attention as a host-side argument (its kernel took the block size as a "
        "runtime value already). The flashmla/trtllm decode backends page by the cache view "
        "and are not given the builder's size here. Round 6 (an independent regression that "
        "gave dummy batches the manager's sizes survived: the scenario ran eagerly): the main "
        "runner now captures FULL_AND_PIECEWISE graphs first, as upstream's CudaGraphManager "
        "builds its capture metadata through the same builders (vllm/v1/worker/gpu/"
        "cudagraph_utils.py, prepare_inputs_to_capture), and replays the prefill (PIECEWISE) "
        "and the decode (FULL) before running each eagerly: a split KV group replayed on "
        "capture metadata."
    ),
)
