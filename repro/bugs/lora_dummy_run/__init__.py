"""lora_dummy_run (vLLM #43139): LoRA metadata unset in dummy runs, a device-side assert.

With LoRA enabled, Model Runner V2's dummy runs (profile, warm-up, capture) never set a LoRA
mapping, so the punica wrapper's index buffers, allocated empty, still hold garbage when the
LoRA embedding gathers A rows at input_ids + embeddings_indices[1]: the gather's bounds assert
fires ("Triton Error [CUDA]: device-side assert triggered" upstream). The fix sets an all-zero
LoRAMapping in the dummy branch; convert_mapping turns id 0 into slot -1 and offset 0.
Run alone: `python -m repro.bugs.lora_dummy_run [--device cpu|cuda]`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)

# the batches of capture scenarios: each FULL size, the smallest twice; adapters and base mixed
CAPTURE_AXES = Axes(
    graph_modes=("FULL",),
    capture_sizes=(4, 8),
    steps_per_size=2,
    adapters=("enabled", "absent"),
)

# the signature on the CPU: the LoRA embedding gather with garbage offsets, in the runner's _embed
EMBED_GATHER = r"index out of range[\s\S]*harness/runner/model\.py:\d+ in _embed\b"

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "seed 000 (#43139 digest): the dummy-run branch set no LoRA mapping, a Triton device-side"
        " assert; the fix sets an all-zero LoRAMapping there"
    ),
    not_verified="the original traceback",
)

RECORD = BugRecord(
    id="lora_dummy_run",
    title="LoRA metadata unset in dummy runs: device-side assert",
    upstream="https://github.com/vllm-project/vllm/pull/43139",
    symptom="Triton Error [CUDA]: device-side assert triggered in a dummy run with LoRA enabled",
    root_cause=(
        "the dummy-run branch of execute_model never sets a LoRA mapping, so the LoRA index "
        "buffers (allocated empty) hold garbage that a gather indexes with"
    ),
    trigger="any dummy run (profile, warm-up, capture) with LoRA enabled before a real batch",
    fix_parts=(Fix.LORA_DUMMY_MAPPING,),
    buggy_outcome=ASSERT,
    scenarios=(
        Scenario(
            "dummy_run_before_mapping",
            (Expect(frozenset({Fix.LORA_DUMMY_MAPPING}), ASSERT),),
            axes=Axes(graph_modes=("NONE",), adapters=("absent", "enabled")),
            cpu_signature=EMBED_GATHER,
        ),
        *(
            Scenario(
                name,
                (Expect(frozenset({Fix.LORA_DUMMY_MAPPING}), ASSERT),),
                timeout_s=240.0,
                axes=CAPTURE_AXES,
                cpu_signature=EMBED_GATHER,
            )
            for name in ("capture_without_dummy_run", "capture_after_base_batch")
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            Fix.LORA_DUMMY_MAPPING,
            "vllm/v1/worker/gpu/model_runner.py, execute_model's dummy-run branch (where a "
            "note had left LoRA warm-up to be fixed): set_adapter_mapping with an all-zero "
            "LoRAMapping",
        ),
    ),
    history=(
        "Merged as a stop-gap, to be replaced by LoRA warm-up (PR #35536: a LoRA capture hook "
        "per active-LoRA case, dummy runs with dummy adapters). Its all-(-1) mapping made "
        "CUDA-graph capture skip every LoRA kernel: regression lora_graph_capture (#43314)."
    ),
)
