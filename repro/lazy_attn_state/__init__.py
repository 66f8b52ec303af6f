"""lazy_attn_state (vLLM #42444): lazy attention plan made in warm-up, missing from the graph.

FlashMLA-style attention plans its split-KV work partition on first use
(tile_scheduler_metadata is None -> allocate and run the planner). CudaGraphManager.capture()
shared one attention state between warm-up and FULL capture, so the planner ran in warm-up and
was never recorded; every replay reuses the plan made for the dummy warm-up lengths (DeepSeek
V4 produced garbled or looping output upstream). The fix calls create_forward_fn(desc) again
before FULL capture and keeps that fresh state. Run alone: `python -m repro.lazy_attn_state`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Expect, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)

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
            "replay_vs_eager",
            (Expect(frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}), WRONG),),
        ),
    ),
    package=__name__,
    history="PIECEWISE capture was unaffected: attention runs outside its graphs.",
)
