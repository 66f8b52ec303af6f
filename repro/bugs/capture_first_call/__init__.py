"""capture_first_call (vLLM #46523, open; issue #40742): the FULL path's first call is the capture.

Warm-up runs every descriptor's warm-up function (create_forward_fn(desc, warmup=True)) eagerly.
Since #42444, FULL capture makes a fresh capture-compatible function (warmup=False) and calls
it for the first time inside capture, so one-time work of that path (upstream: Inductor/Triton
autotuning of the compiled graph, which times candidates and synchronises) runs while the
stream is capturing: the driver refuses the sync and capture fails. Fix part (proposed, not
merged), in upstream's call order: a first warmup=False function runs eagerly (mode NONE, a
disposable attention state), then a second one is captured (mode NONE: the whole forward is in
the graph). Run alone: `python -m repro.bugs.capture_first_call`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario
from repro.bugs.lazy_attn_state import LORA_CASE_AXES

PART = Fix.CAPTURE_PREWARM
# GPU: torch.cuda.synchronize raises "operation not permitted when stream is capturing" and the
# capture is invalidated; CPU: the graph emulation refuses a host sync while recording.
FAILS = ByDevice.both(Outcome.EXCEPTION)

# the signature: a host sync broke the capture; the CPU emulation and CUDA name it at the sync,
# or (CUDA, the sync's own error swallowed) at the capture's end: cudaErrorStreamCaptureInvalidated
CAPTURE_BROKEN = (
    r"operation not permitted when stream is capturing"
    r"|operation failed due to a previous error during capture"
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "upstream's first-call work is Inductor/Triton autotuning; here a per-shape launch-config"
        " tuning of the runner's own, with host syncs, stands for it; the call order follows "
        "#46523"
    ),
    evidence=(
        "#46523's description (a fresh capture-compatible forward_fn first executed inside "
        "torch.cuda.graph, autotuning issues unsupported operations during capture; the fix runs "
        "it eagerly first); cites issue #40742"
    ),
    not_verified="issue #40742's text (the exact error string); the test at 172525b",
)

RECORD = BugRecord(
    id="capture_first_call",
    title="The FULL path's first call (and its one-time tuning) runs inside CUDA-graph capture",
    upstream="https://github.com/vllm-project/vllm/pull/46523",
    symptom=(
        "FULL CUDA-graph capture fails: cudaErrorStreamCaptureUnsupported ('operation not "
        "permitted when stream is capturing') from a first-call autotune (issue #40742)"
    ),
    root_cause=(
        "warm-up runs the eager path; the capture-compatible path (a fresh forward function "
        "made with warmup=False since #42444) runs for the first time inside capture, where "
        "its one-time tuning synchronises"
    ),
    trigger="FULL capture of a path whose first call tunes per shape (host syncs)",
    fix_parts=(PART,),
    buggy_outcome=FAILS,
    scenarios=(
        Scenario(
            "full_decode_capture",
            (Expect(frozenset({PART}), FAILS),),
            timeout_s=300.0,
            axes=Axes(graph_modes=("FULL_AND_PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
            signature=CAPTURE_BROKEN,
        ),
        Scenario(
            "pure_full_capture",
            (Expect(frozenset({PART}), FAILS),),
            timeout_s=300.0,
            axes=Axes(graph_modes=("FULL",), capture_sizes=(4, 8), steps_per_size=2),
            signature=CAPTURE_BROKEN,
        ),
        Scenario(
            "lora_case_capture",
            (Expect(frozenset({PART}), FAILS),),
            timeout_s=300.0,
            axes=LORA_CASE_AXES,
            signature=CAPTURE_BROKEN,
        ),
        Scenario(
            "piecewise_capture",
            (
                Expect(
                    frozenset({PART}),
                    ByDevice.both(Outcome.PASS),
                    why="the PIECEWISE path is the one warm-up ran: tuned before capture",
                ),
            ),
            timeout_s=300.0,
            axes=Axes(graph_modes=("PIECEWISE",), capture_sizes=(4, 8), steps_per_size=2),
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu/cudagraph_utils.py, CudaGraphManager.capture (as proposed in "
            "#46523): for FULL descriptors, after the general warm-up (create_forward_fn(desc, "
            "warmup=True)), call create_forward_fn(desc, warmup=False) and run it eagerly "
            "(disposable attention metadata), then call it again for fresh metadata and "
            "capture; the forward is called in mode NONE both times",
        ),
    ),
    history=(
        "Open upstream: #46523 is not merged and issue #40742 is open (a v0.22.0 B200 report "
        "shows the same first-call Inductor autotuning). The fix follows upstream's call "
        "order, pinned by #46523's test (tests/v1/cudagraph/test_gpu_cudagraph_utils.py at "
        "172525b; here tests/test_cudagraph.py): warm-up function, a disposable capture "
        "function run eagerly, a second capture function captured, each forward called in "
        "mode NONE; an earlier version of this runner prewarmed by running a warm-up function "
        "in FULL mode, with the tuning keyed on the mode. The runner stands for Inductor with "
        "a per-shape first-call tuning of the KV-cache write's launch config, owned by the "
        "path (a warmup=False function tunes the capture path, a warm-up function the eager "
        "path; two configs timed with host syncs on scratch tensors; they write the same "
        "bytes). #46523's prewarm is itself a hazard for a speculator whose factory answers "
        "warmup=False with the target's captured state (#44253's design): registered as "
        "spec_prewarm_captured_state. The issue also names "
        "a first-call buffer allocated during capture and later overwritten: not modelled. A "
        "buffer that capture allocates and the runner keeps stays the graph pool's for as "
        "long as it is referenced, so the hazard needs an address kept without its tensor; "
        "#48261, the nearest merged case, is about metadata views of persistent buffers that "
        "later builds overwrite, which faulted only at capture on low-SM devices; neither "
        "was found in a form this runner can show deterministically on both devices."
    ),
)
