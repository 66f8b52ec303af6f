"""level2_sleep_state (vLLM #16889): model buffers garbage after a level-2 sleep.

A level-2 sleep discards the weights pool without a host copy; wake maps new memory and the
worker reloads the checkpoint's parameters into it. A model's buffers (state the forward reads
that is no checkpoint parameter: a rotary cos/sin cache, Gemma's embedding normalizer) live in
the same pool, and nothing writes them again: they come back as garbage. The fix saves
`named_buffers()` to host memory before a level-2 sleep and copies them back when the weights
wake. Run alone: `python -m repro.bugs.level2_sleep_state`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import WAKES, Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)  # 0xFF bytes read as NaN, on both devices

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#16889 (merged, restores buffers at a level-2 wake, fixes #16564); #49774's description "
        "(level 2 releases the weights pool, non-persistent buffers need saving, restore gated on"
        " the weights tag); #15254 ('output is also messed up')"
    ),
    not_verified="#16889's diff; issue #16564's own text",
)

RECORD = BugRecord(
    id="level2_sleep_state",
    title="Model buffers garbage after a level-2 sleep",
    upstream="https://github.com/vllm-project/vllm/pull/16889",
    symptom=(
        "after sleep(level=2) and wake_up() (and the weights' reload) generation is wrong "
        "(issue #16564); no error is raised"
    ),
    root_cause=(
        "level 2 discards the weights pool with no host copy and the wake reloads checkpoint "
        "parameters only: non-persistent buffers in that pool (a rotary cos/sin cache, Gemma's "
        "normalizer) keep the fresh memory's garbage"
    ),
    trigger="sleep(level=2), wake_up (at once or staged), then any step",
    fix_parts=(Fix.SLEEP_SAVED_BUFFERS,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "sleep_wake_normalizer",
            (Expect(frozenset({Fix.SLEEP_SAVED_BUFFERS}), WRONG),),
            axes=Axes(
                graph_modes=("FULL", "NONE"),  # eager once, after sleep(2) -> wake_up()
                capture_sizes=(4,),
                sleep_levels=(1, 2),
                wakes=WAKES,
                # the FULL graph is captured before the first sleep and replayed after each wake
                states=("graphs across a level-2 sleep",),
            ),
            signature="the normalizer buffer vs the config: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            Fix.SLEEP_SAVED_BUFFERS,
            "vllm/v1/worker/gpu_worker.py, Worker.sleep (level 2: every model.named_buffers() "
            "copied to CPU into _sleep_saved_buffers before the allocator sleeps) and "
            "Worker.wake_up (each saved buffer copied back after the allocator wakes; the "
            "restore is gated on the weights tag since #49774)",
        ),
    ),
    history=(
        "Verified upstream (search): PR #16889 (merged; opened 2025-04-20, approved "
        "2025-04-21; fixes issue #16564) saves the buffers at a level-2 sleep and restores "
        "them at wake. Its restore first ran on any "
        "wake: #45619 (closed) and #49774 (merged) gate it on the weights tag, since a "
        "wake_up([kv_cache]) first copied into unmapped weights memory and then dropped the "
        "saved copy; #49774 also saves a speculator's draft-model buffers. Relatives: "
        "#28783 (merged, for issue #25800: fp8 KV cache gibberish after sleep(level=2)) reset "
        "the fp8 KV scales (_k_scale, _v_scale) to 1.0 and zeroed the KV cache at a KV-cache "
        "wake (a reset to a default, not a restore: calibrated scales were lost, #45617, "
        "#48310); #53508 (merged) removed that reset once the scales became buffers that this "
        "fix restores; #53507 (merged) registers more runtime tensors as buffers so the save "
        "sees them; #57163 (open) finds scales rebound as parameters that the save misses. "
        "Not a second fix part here: this runner's KV cache is in the model's dtype, so no KV "
        "scale sits on its compute path (the kernels take fp8 scales; the runner passes none). "
        "vLLM's Gemma models register their normalizer (sqrt(hidden_size), in the model's "
        "dtype) as a non-persistent buffer, as this runner's decoder does. "
        "Issue #29341 and NeMo-RL #2631 report level-2 gibberish after a weights-only reload. "
        "Not verified: the exact diff of #16889 (only its title, issue and later code that "
        "carries it were read). Relatives in this catalogue: block_table_wake (state in the "
        "kv_cache pool garbage after a wake), partial_wake_forward."
    ),
)
