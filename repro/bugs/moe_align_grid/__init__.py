"""moe_align_grid (vLLM #40131): MoE-LoRA align kernels launched one slot short.

`active_lora_ids` has max_loras + 1 entries and -1 (base model) sorts first, but the three align
kernels launched max_loras slots: with a mixed base + LoRA batch and max_loras equal to the
active LoRA count, the last real LoRA slot is never processed. Its rows of sorted_token_ids,
expert_ids and num_tokens_post_pad stay uninitialized and the fused MoE-LoRA kernel reads
garbage: an illegal address. Run alone: `python -m repro.bugs.moe_align_grid [--device cpu|cuda]`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import ADAPTER_STATES, Axes, BugRecord, Expect, Fidelity, Fold, Scenario

GRID = Fix.MOE_ALIGN_GRID_PLUS_ONE
GUARD = Fix.MOE_ALIGN_OOB_GUARD
SORT_CHECK = Fix.MOE_ALIGN_SORT_ADAPTER_CHECK
WRONG = ByDevice.both(Outcome.WRONG_RESULT)
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)  # CPU: the interpreter's wild read, SIGSEGV

# where the switches travel as names (repro checkout folds them; repro/fold.py)
FOLD_FILES = (
    "kernels/moe_lora_align.py",
    "harness/runner/model_runner.py",
    "repro/bugs/moe_align_grid/scenarios.py",
    "csrc/moe_lora_align.h",
    "csrc/moe_lora_align.cu",
    "csrc/moe_lora_align_bindings.cpp",
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "seed 002 (#40131 digest): max_loras+1 active ids with -1, the grid, the lora_id >= "
        "max_loras guard and the adapter_enabled check in the sort kernel; "
        "cudaErrorIllegalAddress; sentinel-prefilled outputs in its tests"
    ),
    not_verified="the diff itself",
)

RECORD = BugRecord(
    id="moe_align_grid",
    title="MoE-LoRA align kernels launched one slot short",
    upstream="https://github.com/vllm-project/vllm/pull/40131",
    symptom="cudaErrorIllegalAddress in the fused MoE-LoRA kernel on mixed base + LoRA batches",
    root_cause=(
        "active_lora_ids has max_loras + 1 entries (-1 first) but the three align kernels "
        "launched max_loras slots; the last LoRA's align outputs stay uninitialized"
    ),
    trigger="mixed base + LoRA batch with max_loras equal to the number of active LoRAs",
    fix_parts=(GRID, GUARD, SORT_CHECK),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "last_slot_rows",
            (Expect(frozenset({GRID}), WRONG),),
            axes=Axes(adapters=("enabled", "absent")),
            signature="sorted_token_ids: \\d+/\\d+ differ",
        ),
        Scenario(
            "upstream_sizes",
            (Expect(frozenset({GRID}), WRONG),),
            axes=Axes(adapters=("enabled", "absent")),
            signature="sorted_token_ids: \\d+/\\d+ differ",
        ),
        Scenario(
            "consumer_poisoned",
            (Expect(frozenset({GRID}), ILLEGAL),),
            axes=Axes(adapters=("enabled", "absent")),
            cpu_signature='kernels/fused_moe_lora\\.py", line \\d+ in _fused_moe_lora_kernel\\b',
        ),
        Scenario(
            "oob_lora_id",
            (
                Expect(
                    frozenset({GRID}),
                    ByDevice.both(Outcome.PASS),
                    why="without the grid fix the stray slot is never launched",
                ),
                Expect(frozenset({GUARD}), WRONG),
            ),
            axes=Axes(adapters=("enabled", "absent")),
        ),
        Scenario(
            "disabled_adapter",
            (Expect(frozenset({SORT_CHECK, GRID}), WRONG),),
            axes=Axes(adapters=("enabled", "disabled", "absent")),
            signature="sorted_token_ids: \\d+/\\d+ differ",
        ),
        Scenario(
            "triton_twin",
            (Expect(frozenset({GRID, GUARD, SORT_CHECK}), WRONG),),
            axes=Axes(adapters=("enabled", "disabled", "absent")),
            signature="sorted_token_ids: \\d+/\\d+ differ",
        ),
        Scenario(
            "runner_mixed_batch",
            (Expect(frozenset({GRID}), ILLEGAL),),
            axes=Axes(graph_modes=("NONE",), adapters=("enabled", "absent")),
            cpu_signature='kernels/fused_moe_lora\\.py", line \\d+ in _fused_moe_lora_kernel\\b',
        ),
        Scenario(
            "runner_adapter_states",
            (Expect(frozenset({GRID}), ILLEGAL),),
            axes=Axes(graph_modes=("NONE",), adapters=ADAPTER_STATES),
            cpu_signature='kernels/fused_moe_lora\\.py", line \\d+ in _fused_moe_lora_kernel\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(
        Fold(GRID, ("grid_plus_one",), FOLD_FILES),
        Fold(GUARD, ("oob_guard", "FIXED_OOB_GUARD"), FOLD_FILES),
        Fold(SORT_CHECK, ("sort_adapter_check", "FIXED_SORT_ADAPTER_CHECK"), FOLD_FILES),
    ),
    anchors=(
        (
            GRID,
            "csrc/moe/moe_lora_align_sum_kernels.cu (later moe_align_sum_kernels.cu), "
            "moe_lora_align_block_size: the launch grids of the small-batch, align and "
            "count-and-sort kernels cover max_loras + 1 slots",
        ),
        (
            GUARD,
            "the same kernels: a program whose lora_id >= max_loras returns before it indexes "
            "the output rows",
        ),
        (
            SORT_CHECK,
            "lora_count_and_sort_expert_tokens_kernel (large path: numel >= 1024 or E > 64) "
            "also skips adapter_enabled[lora_id] == 0",
        ),
    ),
    history=(
        "Triton twin of the same off-by-one: vLLM #32277 (registered as moe_lora_consumer_grid; "
        "the fused_moe_lora launch grid, "
        "vllm/lora/ops/triton_ops/fused_moe_lora_op.py). The align op is called from the "
        "punica wrapper's moe_lora_align_block_size, for the fused-MoE LoRA layer. Upstream's "
        "own regression test of these kernels (tests/lora/test_moe_lora_align_sum.py: 100 to "
        "4096 tokens, top-k 6, 64 to 512 experts, max_loras 2 and 32) passes on the buggy "
        "kernels in all its cases: it maps every token to a real LoRA id, so no -1 sorts first "
        "and a grid one slot short drops nothing; upstream_sizes runs its sizes with -1 among "
        "the ids. Its fused MoE-LoRA test (tests/lora/test_fused_moe_lora_kernel.py: 100 "
        "tokens, top-k 6 and 12, 64 experts, max_loras 4, 6 and 16, ranks 4 to 256, 152 cases "
        "computing outputs) passes on the buggy align and consumer grids too, all 152 on an "
        "H100 (tests/test_upstream_fused_moe_lora.py): lora_ids' last slot is -1 in every "
        "case."
    ),
)
