"""async_window_free (vLLM #47728; issue #47282): under async scheduling, blocks that left a
sliding window are freed on the optimistic token count, and a rejected draft rolls the window
back onto a freed block.

The scheduler runs one step ahead: a request's num_computed_tokens already counts the tokens of
the step in flight, and remove_skipped_blocks freed the blocks before the window of that count.
When the in-flight step's verification rejects drafts, the count rolls back and the next step,
already launched, starts earlier on the device: its window reaches back into blocks already
freed (their table entries the null block). The fix frees on the processed count
(num_computed_tokens minus num_in_flight_tokens).
Run alone: `python -m repro.bugs.async_window_free`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.ASYNC_WINDOW_FREE_PROCESSED
# the null block holds NaN (poison) on both devices: attention reads it, the logits are NaN
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# the signature: NaN logits (the null block's bytes), not merely off
SIGNATURE = r"logits at positions .* vs reference: .*\bnan vs "

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "the null block is poisoned with NaN, one window spans every layer, and #47282's "
        "connector overwrite is not modelled"
    ),
    evidence=(
        "#47728's title and review (free out-of-window blocks on the processed-token basis; async"
        " num_computed_tokens may hold rejected drafts); vllm-ascend #13501"
    ),
    not_verified=(
        "#47728's description proper (review excerpts only); issue #47282; wrong tokens from the "
        "rejection path"
    ),
)

RECORD = BugRecord(
    id="async_window_free",
    title="Async scheduling frees sliding-window blocks on the optimistic token count",
    upstream="https://github.com/vllm-project/vllm/pull/47728",
    symptom=(
        "with async scheduling (the default) and speculative decoding on a sliding-window (or "
        "chunked-local) model, a step after rejected drafts attends through the null block: "
        "silently wrong tokens; with a KV-consumer connector (P/D), blocks still read by the "
        "step in flight are reallocated and overwritten (issue #47282)"
    ),
    root_cause=(
        "the scheduler advances request.num_computed_tokens at schedule time; "
        "remove_skipped_blocks frees the blocks before the window of that optimistic count; a "
        "rejection in the step in flight rolls the count back below blocks already replaced by "
        "the null block"
    ),
    trigger=(
        "a scheduler one step ahead, speculative tokens, a sliding window whose block boundary "
        "lies within the rejected drafts of the optimistic window start"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "rejected_drafts_after_window_free",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                # two drafts rejected once; one draft rejected by steps 1-4, under a window of
                # 3 tokens; blocks of 2 tokens; a request preempted, resumed, then rejected
                states=(
                    "several drafts",
                    "one draft",
                    "rejections in a row",
                    "two steps in flight",
                    "running request grows into a new block",
                    "window not block-aligned",
                    "resumed after preemption",
                ),
            ),
            signature=SIGNATURE,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz="",
    anchors=(
        (
            PART,
            "vllm/v1/core/single_type_kv_cache_manager.py: remove_skipped_blocks (sliding "
            "window, chunked local, Mamba) frees the blocks before the window and puts the null "
            "block in their place; vllm/v1/core/kv_cache_manager.py allocate_slots calls it "
            "with the request's num_computed_tokens; #47728 adds Request.num_in_flight_tokens "
            "and frees on num_computed_tokens minus it; here: "
            "harness/runner/async_scheduler.py AsyncScheduler._add, "
            "harness/runner/kv_cache.py KVCache.remove_skipped_blocks",
        ),
    ),
    history=(
        "Verified with search (2026-11): #47728 (merged; opened 2026-07) names both failures of "
        "freeing on the optimistic count under async scheduling or pipeline parallelism: "
        "issue #47282's load write-after-read (a KV-consumer connector reallocates a block the "
        "step in flight still reads and overwrites it on another stream) and the silent "
        "speculative-rejection misfree (the rolled-back boundary below nulled blocks, attention "
        "reading null KV; before it only Mamba subtracted num_speculative_tokens locally); the "
        "fix tracks num_in_flight_tokens (scheduled minus processed, symmetric across "
        "preemption, rejection and failed KV loads) and frees on the settled basis. #45357 "
        "(merged) defers returning a finished or preempted request's blocks to the pool until "
        "the newest in-flight step finished (async scheduling with a P/D KV consumer); #48481 "
        "(merged) a hybrid-attention race of the same family; issue #49878 (open) measured the "
        "KV-cache sizing cost #47728 added (two batches in flight in the startup bound); "
        "vllm-ascend issue #13501 reports the window free on v0.23 with P/D and MTP. Not read: "
        "issue #47282 itself and the diffs line by line. Modelled: one sliding window on every "
        "layer, the paged kernel's `window` argument; the null block is block 0 of each group, "
        "poisoned with NaN (upstream's null block is never a request's; what it holds is not "
        "specified), so a read of it shows as NaN logits on both devices; the connector's "
        "overwrite (#47282) is not modelled; drafts are the sampled token again, rejected by a "
        "fixed pattern."
    ),
)
