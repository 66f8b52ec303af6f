"""reload_derived_rebind (vLLM #48251): tensors derived at post-load processing are rebound by a
weight reload, and CUDA graphs captured before it read the old ones.

Post-load processing (upstream: process_weights_after_loading) derives tensors the forward reads
from the parameters: MLA's W_UV and W_UK_T from kv_b_proj, FlashInfer's float32 copy of the
attention sinks. A weight reload (an RL trainer's update, the reload after a level-2 wake) runs
it again; it assigned new tensors, so graphs captured before the reload kept replaying the old
allocations: the old weights, or after a level-2 sleep the fresh memory's garbage. The fix
refreshes them in place. Run alone: `python -m repro.bugs.reload_derived_rebind`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.RELOAD_DERIVED_IN_PLACE
# the old weights' logits, or NaN (the wake's 0xFF bytes) after a level-2 sleep, on every device
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#48251's description (merged: MLA's W_UV/W_UK_T reassigned after graph capture, "
        "FlashInfer's sinks converted with .to(float32) into a detached tensor; level 2 makes "
        "it severe, level 1 can mask it; the fix copies into the existing storage); tracker "
        "#48312's table; RFC #48941 and #49140 (graphs hold data_ptr, reload re-captures "
        "nothing); vllm-ascend #16717, #15666 (the same hazard, in place on reload)"
    ),
    not_verified=(
        "#48251's diff and tests (only its description and later code quoting "
        "replace_parameter(..., prefer_copy=True) were read); the MLA and FlashInfer code"
    ),
    what=(
        "the decoder has no MLA or sinks: its derived tensors are the LM head's transpose (a "
        "permuted copy, as W_UK_T) and a float32 embedding table (a dtype-converted copy, as "
        "the sinks'); the buggy rebinding allocates outside the weights pool, as a plain "
        "torch allocation; a new checkpoint is the same seeded weights drawn with another seed"
    ),
)

RECORD = BugRecord(
    id="reload_derived_rebind",
    title="A weight reload rebinds post-load derived tensors that captured graphs still read",
    upstream="https://github.com/vllm-project/vllm/pull/48251",
    symptom=(
        "after reload_weights() (an RL weight update) or a level-2 sleep and wake, generation "
        "under CUDA graphs is wrong while eager mode is right: stale attention sinks with "
        "FlashInfer, obsolete W_UV/W_UK_T addresses in MLA graphs (garbage after level 2); no "
        "error is raised"
    ),
    root_cause=(
        "post-load processing, re-run by every reload, assigned newly derived tensors to the "
        "layer instead of writing into the existing ones: graphs captured before the reload "
        "hold the old allocations' addresses and replay the old values (after a level-2 sleep, "
        "whatever the remapped memory holds)"
    ),
    trigger=(
        "a model whose post-load processing derives a tensor the forward reads; capture CUDA "
        "graphs; reload weights with new values, or sleep(level=2) and wake (the reload); "
        "replay a graph"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "reload_under_graph",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("FULL", "NONE"),  # each cycle replays and runs eagerly
                capture_sizes=(4,),
                sleep_levels=(1, 2),
                wakes=("all at once", "staged"),
                states=(
                    "graphs across a level-2 sleep",
                    "weights reloaded with the same values",
                    "weights reloaded with new values",
                    "several derived tensors",
                    "a derived tensor converted to another dtype",
                ),
            ),
            signature="at its captured storage vs the parameters: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/model_executor/layers/attention/mla_attention.py, "
            "MLAAttention.process_weights_after_loading (W_UV and W_UK_T through "
            "replace_parameter(..., prefer_copy=True): copied into compatible existing storage); "
            "the FlashInfer backend keeps the sinks' source and refreshes its float32 runtime "
            "tensor in place (#48251's description); here post_load.DerivedWeights.refresh, "
            "called by the model's reload_weights",
        ),
    ),
    history=(
        "Verified with search (2026-11-28): PR #48251 '[Bugfix][Attention] Preserve post-load "
        "tensors across weight reloads' (merged; opened 2026-07-10): MLA reassigned W_UV and "
        "W_UK_T, FlashInfer converted its bf16/fp16 sinks into a detached float32 tensor that "
        "later reloads never updated; level 2 makes the MLA failure severe (the stale "
        "allocation is remapped without its contents), level 1 can mask it. Tracker #48312 "
        "(RFC 'Weight Reload Correctness for RL', open) lists it beside #40390 (ROCm AITER MoE "
        "weight shuffle, merged), #46009 (MoE padding through .data), #41670 (CUTLASS FP8 MoE "
        "strides), #48438 (Marlin workspace); #48478 proposes a fail-closed graph-storage "
        "registry; #48941/#49140 (closed) a recursive collector that copies back every "
        "non-parameter tensor. vllm-ascend #15666 (merged) and #16717 (open) fix the same "
        "hazard for their weight_fp32 and MLA/SFA tensors. Not verified: the diff of #48251. "
        "Relatives in this catalogue: level2_sleep_state (buffers the reload misses), "
        "block_table_graph_wake (state rebound under a graph)."
    ),
)
