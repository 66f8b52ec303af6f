"""draft_lookahead_alloc (vLLM #42971, #43733): a drafter's KV written past a new request's
blocks lands in another request's prefix blocks.

DFlash drafts in the same step as the target's prefill: its query block (the bonus token and
num_spec_tokens mask tokens) writes KV at num_spec_tokens + 1 positions past the sequence,
through the request's block table. The scheduler allocated num_spec_tokens lookahead slots
(EAGLE's count), and none at all when it scheduled a request's prefill (#22317's override):
the positions past the allocation went through block-table entries no block of the request
backed, into shared prefix blocks of other requests, whose cached KV was overwritten. Fixed by
k + 1 lookahead slots for DFlash (#42971) and by keeping them on prefills (#43733). Run alone:
`python -m repro.bugs.draft_lookahead_alloc`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

BONUS, PREFILL = Fix.DRAFT_LOOKAHEAD_BONUS_SLOT, Fix.DRAFT_LOOKAHEAD_ON_PREFILL
# in-bounds writes through stale block ids (real blocks): numbers, not a fault, on both devices
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#42971's description (the target prefill and the first drafter pass in one step; "
        "DFlash issues num_spec_tokens + 1 query tokens past the prefill; no lookahead blocks "
        "allocated on the first prefill, so new prefix-hit requests' drafter passes wrote KV "
        "into shared prefix blocks; mean generated length degraded under concurrency) and its "
        "review diff (the scheduler's num_lookahead_tokens = num_spec_tokens + 1 for DFlash); "
        "#43733's description and review diff (DFlash needs an extra lookahead slot; #22317 "
        "overrode the lookahead when scheduling prefills, a request with num_computed_tokens "
        "0; the override limited to P/D's asynchronous KV loads); #41971 (open, the same "
        "first-prefill allocation); for the row width: #39324 (merged, 2026-04: a block "
        "table's max_num_blocks rounded up to a multiple of 128 / block_size where the block "
        "is at most 128 tokens, as TRTLLM and CUTLASS MLA need), read in "
        "vllm/v1/worker/block_table.py (MultiGroupBlockTable) and in its review diff of "
        "vllm/v1/worker/gpu/block_table.py (Model Runner V2); block 0 is BlockPool's null "
        "block (vllm/v1/core/block_pool.py)"
    ),
    not_verified=(
        "the diffs line by line; which stale entries upstream's writes went through (here the "
        "request row's entries past its allocation keep an earlier tenant's block ids); #22317 "
        "itself; Model Runner V2's block_table.py as merged with #39324 (its stored versions "
        "read predate it: cdiv(max_model_len, block_size) columns)"
    ),
    what=(
        "the drafter is a toy: its KV of a token is the token's embedding, mask tokens a "
        "constant, its drafts the LM head over the sum of every written position's values "
        "(DFlash's bidirectional block attention reduced to a sum); its KV layer is its own "
        "cache in group 0's blocks. Upstream's symptom is the victims' draft quality (lossless "
        "verification); here the victims' draft logits (the drafter's scores) are compared "
        "with the drafter's on their own tokens: wrong_result (a draft token itself changes "
        "only where the corruption moves an argmax). The runner's prefix cache has no "
        "reference counts: the victim holds the cached blocks it hit. Rows are upstream's "
        "width (max_model_len rounded up to 128 tokens, #39324): the columns past "
        "max_model_len's blocks are never a request's and hold 0, which here is a pool block a "
        "request may hold (no null block outside a sliding window): a drafter guard off by one "
        "writes position max_model_len into a running request's block (the fifth episode); "
        "upstream's would write into the null block, or, where max_model_len is a multiple of "
        "128 tokens (no spare column), into the next row's first block through the slot "
        "kernels' unchecked row offsets"
    ),
)

RECORD = BugRecord(
    id="draft_lookahead_alloc",
    title="A drafter's query block writes KV past a new request's allocation, into shared blocks",
    upstream="https://github.com/vllm-project/vllm/pull/42971",
    symptom=(
        "under prefix caching with concurrency, DFlash's mean generated length (drafts "
        "accepted) falls over time on requests that were running correctly: their cached KV "
        "is overwritten by newly arriving prefix-hit requests' first drafter passes (#42971); "
        "crashes when lookahead slots are missing (#43733)"
    ),
    root_cause=(
        "the scheduler allocated num_spec_tokens lookahead slots, while DFlash's query block "
        "writes num_spec_tokens + 1 positions past the sequence, and it allocated none when "
        "scheduling a request's prefill, though the drafter runs in the same step; positions "
        "past the allocation are mapped through block-table entries the request does not own"
    ),
    trigger=(
        "prefix caching and a drafter that writes KV in the target's step (DFlash): a new "
        "request (prefix hit or not) whose row's table names other requests' blocks past its "
        "allocation; without the bonus slot, any step whose sequence plus num_spec_tokens ends "
        "at a block boundary"
    ),
    fix_parts=(BONUS, PREFILL),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "lookahead_past_allocation",
            (Expect(frozenset({BONUS, PREFILL}), WRONG),),
            axes=Axes(
                graph_modes=("NONE", "FULL"),
                capture_sizes=(8,),
                steps_per_size=3,
                states=(
                    "one draft",
                    "several drafts",
                    "sequence ends at a block boundary",
                    "sequence ends just before a block boundary",
                    "new request with a prefix hit",
                    "running request on prefix-cache blocks",
                    "a request joining in a replayed graph step",
                    "blocks reused without prefix caching",
                    "sequence at max_model_len - k beside a running request",
                ),
            ),
            signature="request D's draft logits vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: the fuzzer's programs have no parallel drafter "
        "(RunnerConfig.spec.parallel_drafting) and no prefix-cache hit on a finished request's "
        "blocks beside a new request in its old row"
    ),
    anchors=(
        (
            BONUS,
            "vllm/v1/core/sched/scheduler.py Scheduler.__init__: num_lookahead_tokens is "
            "num_spec_tokens + 1 for DFlash (#42971), num_spec_tokens for EAGLE and draft "
            "models; allocate_slots(num_lookahead_tokens=...) in vllm/v1/core/kv_cache_manager.py",
        ),
        (
            PREFILL,
            "vllm/v1/core/sched/scheduler.py schedule(), the waiting queue: the lookahead "
            "tokens of a new request (num_computed_tokens 0) are kept, limited only for P/D's "
            "asynchronous KV loads (#43733; #22317 had zeroed them for every prefill; #42971 "
            "found the missing first-prefill block)",
        ),
    ),
    history=(
        "Verified with search (2026-11), from PR descriptions and review diffs, not the diffs "
        "line by line: #42971 'Fix DFlash prefix cache corruption due to missing lookahead "
        "block' (merged, 2026-05-18; vllm-omni #4449 syncs it); #43733 '[Bugfix][DFlash] "
        "allocate the proper number of lookahead slots' (merged, 2026-05-27: crashes from "
        "missing lookahead slots; #22317's override of prefills); #41971 (open) the same "
        "first-prefill allocation with a slot-mapping test. Relatives: #16370 (lookahead "
        "slots for EAGLE heads), #16613/#16941 (lookahead for the waiting queue), #50062 "
        "(multi-layer MTP's prefill lookahead), issue #47930 (DFlash acceptance collapse "
        "under prefix caching, open), #54163 and #50897 (the EAGLE last-block drop). "
        "Modelled: harness/runner/lookahead.py (the drafter's own KV layer, the scheduler's "
        "lookahead count), KVCache.lookahead (the step's slots per row, allocated by "
        "ensure_blocks) and KVCache.first_step."
    ),
)
