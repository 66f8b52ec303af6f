"""spec_prewarm_captured_state (vLLM #46523 on #44253's design; fixed upstream by #48261's way):
the capture path's eager prewarm runs a speculator's draft on a never-computed plan.

#46523 (open) runs every FULL descriptor's capture-compatible forward function
(create_forward_fn(desc, warmup=False)) once eagerly before capture, so that its first call is
not the capture. The speculator's prefill graph manager builds no attention state of its own:
since #44253 its factory returns the target's warm-up state for warmup=True and the target's
captured state for warmup=False. The prewarm is a warmup=False call run eagerly: it finds the
captured state initialised (its plan allocated inside the target's capture, never computed),
skips the planner and runs the split-KV kernel on the poisoned plan: #44253's hazard, re-opened
by the fix of another bug. Fix part (modelled on #48261, which builds fresh speculator metadata
for every warm-up and capture pass): an eager warmup=False pass runs on a disposable state; the
capture still runs on the target's captured state. Run alone:
`python -m repro.bugs.spec_prewarm_captured_state`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.SPEC_DISPOSABLE_PREWARM_STATE
# As spec_capture_state: capture-allocated memory is poison on both devices (int32 max), the
# split-KV kernel walks the plan's request range from it (CPU: SIGSEGV in the interpreter).
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="inferred",
    what=(
        "no upstream report of this hazard: #46523's prewarm (open) meeting #44253's factory, "
        "which returns the captured state for warmup=False, is the project's reasoning from the "
        "two descriptions; #48261 (merged) fixed another fault (metadata views of persistent "
        "buffers overwritten by later builds) and removes this hazard in passing; the symptom is "
        "inferred"
    ),
    evidence="#48261's, #46523's and #44253's descriptions",
    not_verified="#46523's reviews; whether #48261 covers an eager warmup=False pass",
)

RECORD = BugRecord(
    id="spec_prewarm_captured_state",
    title="The capture path's eager prewarm runs a speculator on the target's uncomputed plan",
    upstream="https://github.com/vllm-project/vllm/pull/46523",
    symptom=(
        "inferred, no upstream report: with #46523's prewarm on the #44253 design, capture_model "
        "of a speculator with FULL graphs over lazily planned attention (DeepSeek V4 MTP, "
        "FlashMLA) would fault (illegal memory access) in the draft's eager prewarm"
    ),
    root_cause=(
        "#46523 calls create_forward_fn(desc, warmup=False) once more and runs it eagerly; the "
        "speculator's factory answers warmup=False with the target's captured attention state, "
        "whose plan the target's capture allocated and recorded but never computed: the eager "
        "run skips the planner and reads the uncomputed plan"
    ),
    trigger=(
        "#46523's prewarm, and a speculator whose graphs reuse the target's captured attention "
        "states (FULL decode graphs, lazily planned FlashMLA-style attention), at capture_model"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "speculator_prewarm",
            (
                Expect(
                    frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}),
                    ByDevice.both(Outcome.WRONG_RESULT),
                    why="without #42444's fix the target keeps its warm-up state, already "
                    "planned: the prewarm is safe, the draft replays a stale plan "
                    "(lazy_attn_state)",
                ),
                Expect(
                    frozenset({Fix.CAPTURE_PREWARM}),
                    ByDevice.both(Outcome.EXCEPTION),
                    why="without #46523's prewarm nothing runs the draft eagerly on the "
                    "captured state; the target's capture fails first (capture_first_call)",
                ),
                Expect(
                    frozenset({Fix.SPEC_SEPARATE_WARMUP_STATE}),
                    ILLEGAL,
                    why="the draft's warm-up already runs on the captured state "
                    "(spec_capture_state)",
                ),
                Expect(frozenset({PART}), ILLEGAL),
            ),
            timeout_s=300.0,
            axes=Axes(
                graph_modes=("FULL_AND_PIECEWISE",),
                capture_sizes=(4, 8),
                steps_per_size=2,
                # 3 and 7 decodes in the graphs of 4 and 8 requests; one draft attention a step
                states=("padded by tokens", "padded count below the largest", "one draft"),
            ),
            cpu_signature='kernels/split_kv_attention\\.py", line \\d+ in _split_kv_kernel\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu/spec_decode (PrefillEagleCudaGraphManager.capture's "
            "create_forward_fn): #48261 builds fresh dummy inputs and attention metadata, through "
            "the target runner's builders and buffers, for every warm-up and capture pass; here, "
            "keeping #44253's pair of states, an eager warmup=False pass (#46523's prewarm) gets "
            "a disposable state and the capture keeps the target's captured one",
        ),
    ),
    history=(
        "Facts: #42444 (merged 2026-05-15) captures FULL graphs on a fresh attention state, "
        "whose lazy plan the graph records and no eager run computes; #44253 (merged) made the "
        "speculator's prefill graph manager, which builds no metadata of its own, return the "
        "target's warm-up metadata from create_forward_fn for its warm-up and the target's "
        "captured metadata for its capture; #46523 (open, opened 2026-06-23; issue #40742) "
        "calls the factory once more with warmup=False and runs that function eagerly before "
        "FULL capture (its test pins the order warmup, capture-1 eager, capture-2 in the "
        "graph); #48261 (merged 2026-07-10) builds fresh dummy inputs and attention metadata "
        "for every warm-up and capture pass of the speculator's prefill graphs (for another "
        "fault: metadata views of persistent buffers that later builds overwrite, an illegal "
        "address in FA3's combine at capture on low-SM devices). Inferred, from the code, with "
        "no upstream report found (#46523's reviews are not indexed): #46523 on the #44253 "
        "design would run the speculator's prewarm on the target's captured metadata and "
        "fault as #44253 did; after #48261 the prewarm runs on disposable metadata. The runner "
        "keeps #44253's design, so the captured-state consumer of lazy_attn_state stays "
        "observable; #48261's own mechanism (a fresh state for the capture too, the draft's "
        "graph then records a planner of its own) is listed as an equivalent mutant: it passes "
        "on the fixed runner. A disposable state shared by the prewarms of every capture size "
        "(the largest plans it, the smaller run on that plan) computes the smaller batch's rows "
        "right and walks the rows past them out of bounds, in outputs thrown away: nothing "
        "faults reliably, so the scenario also checks, after every eager draft run, the plan "
        "it ran on against the plan of its own lengths."
    ),
)
