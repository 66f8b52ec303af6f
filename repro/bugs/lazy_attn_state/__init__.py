"""lazy_attn_state (vLLM #42444): lazy attention plan made in warm-up, missing from the graph.

FlashMLA-style attention plans its split-KV work partition on first use
(tile_scheduler_metadata is None -> allocate and run the planner). CudaGraphManager.capture()
shared one attention state between warm-up and FULL capture, so the planner ran in warm-up and
was never recorded; every replay reuses the plan made for the dummy warm-up lengths (DeepSeek
V4 produced garbled or looping output upstream). The fix calls create_forward_fn(desc,
warmup=False) before FULL capture, captures that fresh function and keeps its state. Run
alone: `python -m repro.bugs.lazy_attn_state`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# A FULL decode graph per specialised LoRA capture case, decode steps in every case
LORA_CASE_AXES = Axes(
    graph_modes=("FULL_AND_PIECEWISE",),
    capture_sizes=(4,),
    steps_per_size=3,
    adapters=("enabled", "absent"),
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "seed 004 (#42444 digest): warm-up and capture shared one FlashMLASchedMeta, the planner "
        "ran in warm-up only, garbled output under FULL graphs; the fix calls create_forward_fn "
        "again for FULL capture; #44253's description restates it"
    ),
    not_verified="the diff; whether the warmup keyword is #42444's or later",
)

RECORD = BugRecord(
    id="lazy_attn_state",
    title="Lazy attention plan made in warm-up, missing from the CUDA graph",
    upstream="https://github.com/vllm-project/vllm/pull/42444",
    symptom="garbled or repeating output with full CUDA graphs (DeepSeek V4, FlashMLA)",
    root_cause=(
        "capture() shared one attention state between warm-up and capture: the lazy planner "
        "ran in warm-up, so the graph replays a plan made for the dummy lengths"
    ),
    trigger="FULL CUDA-graph capture of an attention backend that initializes state lazily",
    fix_parts=(Fix.FRESH_ATTN_STATE_FOR_CAPTURE,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "full_decode_graphs",
            (Expect(frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}), WRONG),),
            timeout_s=300.0,
            axes=Axes(graph_modes=("FULL_AND_PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
            signature="replay hidden states vs eager: \\d+/\\d+ differ",
        ),
        Scenario(
            "piecewise_decode",
            (
                Expect(
                    frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}),
                    ByDevice.both(Outcome.PASS),
                    why="PIECEWISE graphs leave the attention (and its plan) out",
                ),
            ),
            timeout_s=300.0,
            axes=Axes(graph_modes=("PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
        ),
        Scenario(
            "lora_case_decode_graphs",
            (Expect(frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}), WRONG),),
            timeout_s=300.0,
            axes=LORA_CASE_AXES,
            signature="replay hidden states vs eager: \\d+/\\d+ differ",
        ),
        Scenario(
            "captured_state_consumer",
            (Expect(frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}), WRONG),),
            timeout_s=300.0,
            axes=Axes(graph_modes=("FULL_AND_PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
            signature="draft replay vs eager: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            Fix.FRESH_ATTN_STATE_FOR_CAPTURE,
            "vllm/v1/worker/gpu/cudagraph_utils.py, CudaGraphManager.capture: for FULL "
            "descriptors, create_forward_fn(desc, warmup=False) after the warm-up, capture "
            "with that fresh state and keep it in captured_attn_states (PIECEWISE keeps the "
            "warm-up one)",
        ),
    ),
    history=(
        "PIECEWISE capture was unaffected: attention runs outside its graphs "
        "(piecewise_decode shows it). captured_attn_states went on to the speculator's "
        "prefill graph manager, which used one state for its own warm-up and capture: "
        "#44253 gave it separate states (registered as spec_capture_state). Later (#48261, "
        "#49364) attention metadata is always built at capture time."
    ),
)
