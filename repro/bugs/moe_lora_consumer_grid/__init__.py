"""moe_lora_consumer_grid (vLLM #32277): fused MoE-LoRA kernels launched one slot short.

The Triton twin of moe_align_grid, one step downstream: the fused MoE-LoRA shrink and expand
kernels take one LoRA slot per program on the z axis of their grid, but launched max_loras of
them while `lora_ids` has max_loras + 1 entries with -1 (the base model) first. With a mixed
base + LoRA batch the program of the last real LoRA never runs: that adapter's expert LoRA
delta is silently missing. Run alone: `python -m repro.bugs.moe_lora_consumer_grid`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import ADAPTER_STATES, Axes, BugRecord, Expect, Fidelity, Fold, Scenario

GRID = Fix.MOE_LORA_GRID_PLUS_ONE
GUARD = Fix.MOE_LORA_ID_GUARD
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# where the switches travel as names (repro checkout folds them; repro/fold.py)
FOLD_FILES = (
    "kernels/fused_moe_lora.py",
    "harness/runner/model_runner.py",
    "repro/bugs/moe_lora_consumer_grid/scenarios.py",
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "the grid part (max_loras + 1) is #32277's; the second part, the lora_id bound in the "
        "consumer, has no source in #32277's text; the silent missing delta is the project's "
        "reading of the grid gap"
    ),
    evidence=(
        "#32277's description (max_loras + 1 in the grid for mixed base and adapter tokens, fixes"
        " issue #32235); #35636 (closed) on the -1 base slot"
    ),
    not_verified=(
        "whether #32277 added a lora_id bound; issue #32235's symptom (a crash or a silent delta)"
    ),
)

RECORD = BugRecord(
    id="moe_lora_consumer_grid",
    title="Fused MoE-LoRA shrink/expand launched one LoRA slot short",
    upstream="https://github.com/vllm-project/vllm/pull/32277",
    symptom=(
        "silently wrong MoE-LoRA output: the last active adapter's expert LoRA delta is "
        "missing on mixed base + LoRA batches"
    ),
    root_cause=(
        "the fused MoE-LoRA kernels launched max_loras programs on the LoRA axis while "
        "lora_ids has max_loras + 1 entries (-1 first): the last real LoRA is never processed"
    ),
    trigger="MoE model with LoRA, a batch of base-model tokens and every loaded adapter",
    fix_parts=(GRID, GUARD),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "runner_mixed_batch",
            (Expect(frozenset({GRID}), WRONG),),
            axes=Axes(graph_modes=("FULL",), capture_sizes=(8,), adapters=("enabled", "absent")),
            signature="eager hidden states vs reference: \\d+/\\d+ differ",
        ),
        Scenario(
            "runner_adapter_states",
            (Expect(frozenset({GRID}), WRONG),),
            axes=Axes(
                graph_modes=("FULL",),
                capture_sizes=(16,),
                steps_per_size=2,
                adapters=ADAPTER_STATES,
            ),
            signature="eager hidden states vs reference: \\d+/\\d+ differ",
        ),
        Scenario(
            "last_slot_pairs",
            (Expect(frozenset({GRID}), WRONG),),
            axes=Axes(adapters=("enabled", "disabled", "absent")),
            signature="shrink output: \\d+/\\d+ differ",
        ),
        Scenario(
            "stray_lora_id",
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
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(
        Fold(GRID, ("grid_plus_one",), FOLD_FILES),
        Fold(GUARD, ("id_guard", "ID_GUARD"), FOLD_FILES),
    ),
    anchors=(
        (
            GRID,
            "vllm/lora/ops/triton_ops/fused_moe_lora_op.py, _fused_moe_lora_shrink and "
            "_fused_moe_lora_expand: the launch grid's LoRA axis covers max_loras + 1 slots",
        ),
        (
            GUARD,
            "the same file's _fused_moe_lora_kernel: it receives max_loras and a program whose "
            "lora_id >= max_loras returns before indexing the align outputs or the weights",
        ),
    ),
    history=(
        "#35636 proposed the same +1 again and was closed. #40131 (moe_align_grid) fixed the "
        "CUDA C++ align kernels that feed these, 'mirroring' this fix, and calls the id bound "
        "'the equivalent guard in the Triton kernel'; whether #32277 itself added that bound "
        "is not confirmed (its diff was not read), so the record keeps it as its own part. "
        "Upstream's own test of these kernels (tests/lora/test_fused_moe_lora_kernel.py: 100 "
        "tokens, top-k 6 and 12, 64 experts, max_loras 4, 6 and 16, ranks 4 to 256, 152 cases "
        "computing outputs) cannot see the bug: with the consumer's (and the align's) grid one "
        "slot short, all 152 pass on an H100 (tests/test_upstream_fused_moe_lora.py), since "
        "every token maps to a LoRA and lora_ids' last slot is always -1; one of its cases with a "
        "base-model sequence added shows it (test_a_base_model_sequence_shows_them)."
    ),
)
