"""moe_align_grid (vLLM #40131): MoE-LoRA align kernels launched one slot short.

`active_lora_ids` has max_loras + 1 entries and -1 (base model) sorts first, but the three align
kernels launched max_loras slots: with a mixed base + LoRA batch and max_loras equal to the
active LoRA count, the last real LoRA slot is never processed. Its rows of sorted_token_ids,
expert_ids and num_tokens_post_pad stay uninitialized and the fused MoE-LoRA kernel reads
garbage: an illegal address. Run alone: `python -m repro.moe_align_grid [--device cpu|cuda]`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Expect, Scenario

GRID = Fix.MOE_ALIGN_GRID_PLUS_ONE
GUARD = Fix.MOE_ALIGN_OOB_GUARD
SORT_CHECK = Fix.MOE_ALIGN_SORT_ADAPTER_CHECK
WRONG = ByDevice.both(Outcome.WRONG_RESULT)
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)  # CPU: the interpreter's wild read, SIGSEGV

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
        Scenario("last_slot_rows", (Expect(frozenset({GRID}), WRONG),)),
        Scenario("consumer_poisoned", (Expect(frozenset({GRID}), ILLEGAL),)),
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
        ),
        Scenario("disabled_adapter", (Expect(frozenset({SORT_CHECK, GRID}), WRONG),)),
    ),
    package=__name__,
    history="Triton twin of the same off-by-one: vLLM #32277 (fused_moe_lora launch grid).",
)
