"""spec_capture_state (vLLM #44253): a speculator's graphs warm up on a plan never computed.

After #42444 the target's FULL graphs are captured with a fresh attention state, whose lazy
planner is recorded in the graph, not run: until the first replay its plan tensor is allocated
but never written. The speculator's graph manager does not build attention states of its own:
it reused the target's captured state both for its eager warm-up and for its capture. The
warm-up sees the state initialised, skips the planner and runs the split-KV kernel on the
never-computed plan. Fix part: the speculator warms up with the target's warm-up state and
captures with its captured one. Run alone: `python -m repro.bugs.spec_capture_state`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.SPEC_SEPARATE_WARMUP_STATE
# Capture-allocated memory is poison on both devices (int32 max): the split-KV kernel walks the
# plan's request range from its first entry and reads far out of bounds (CPU: SIGSEGV).
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#44253's description (the prefill EAGLE graph manager reuses the target's capture "
        "metadata, returned by create_forward_fn for warm-up and capture; capture records without"
        " executing); #44069 (an error with DSv4 MTP under MRV2)"
    ),
    not_verified=(
        "the exact upstream error text (illegal address here is the runner's poisoned plan); the "
        "diff"
    ),
)

RECORD = BugRecord(
    id="spec_capture_state",
    title="A speculator's graph warm-up runs on the target's never-computed attention plan",
    upstream="https://github.com/vllm-project/vllm/pull/44253",
    symptom=(
        "DeepSeek V4 with MTP (FlashMLA) broke at the speculator's prefill graph capture: its "
        "eager warm-up read attention metadata that had been allocated but never computed"
    ),
    root_cause=(
        "the speculator's graph manager returned the target's captured attention state for "
        "its warm-up and its capture; capture recorded the target's planner without running "
        "it, so the warm-up found the state initialised and read an uncomputed plan"
    ),
    trigger=(
        "a speculator whose graphs reuse the target's captured attention states (FULL "
        "decode graphs, lazily planned FlashMLA-style attention), at capture_model"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "speculator_capture",
            (
                Expect(frozenset({PART}), ILLEGAL),
                Expect(
                    frozenset({Fix.SPEC_DISPOSABLE_PREWARM_STATE}),
                    ILLEGAL,
                    why="#46523's prewarm runs the draft eagerly on the captured state too "
                    "(spec_prewarm_captured_state)",
                ),
            ),
            timeout_s=300.0,
            axes=Axes(graph_modes=("FULL_AND_PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
            cpu_signature='kernels/split_kv_attention\\.py", line \\d+ in _split_kv_kernel\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu/cudagraph_utils.py, CudaGraphManager.capture keeps both states "
            "of each descriptor (warm-up and captured); the speculator's prefill graph manager "
            "(spec_decode, PrefillEagleCudaGraphManager.capture) returns the warm-up one from "
            "create_forward_fn for its warm-up and the captured one for its capture",
        ),
    ),
    history=(
        "A follow-up of #42444 (lazy_attn_state): its fix made the captured state fresh, "
        "which is what left that state's plan uncomputed until the first replay. #48261 "
        "(merged) found the next layer: the speculator's capture reused attention metadata "
        "that were views of persistent buffers later builds overwrite (a capture-time illegal "
        "address in FA3's combine on low-SM devices); it builds fresh metadata for every "
        "speculator warm-up and capture. Here the plan memory that capture allocates is "
        "poisoned (int32 max, on both devices), so the uncomputed plan always sends the "
        "split-KV kernel out of bounds; with allocator leftovers it would read whatever was "
        "there. #46523's prewarm (open; capture_first_call) adds an eager warmup=False pass, "
        "which the #44253 factory answers with the captured state: the same fault again, "
        "registered as spec_prewarm_captured_state (speculator_capture fails without its "
        "part too)."
    ),
)
