"""mamba_align_prefix_poison (vLLM #51113; issue #43559): a Mamba state hashed at a block
boundary it was never computed at.

In Mamba "align" cache mode a hybrid model caches a request's Mamba state per block: the entry
of block p, once the request has passed (p + 1) * block_size tokens, is hashed as the state at
exactly that many tokens, and later requests sharing the prefix resume from it. The state is
written where a prefill chunk ends, so the scheduler keeps chunk ends on block boundaries, but
only below the last cacheable position, which EAGLE (and MTP) backs off by one block (to 0 for
prompts under two blocks). Past it, when concurrent prefills share a step's token budget, a
chunk ends mid-block; the next chunk crosses the boundary and the entry holding the state at
the mid-block end is hashed as the state at the boundary: every request resuming from it
restores a truncated state. The fix keeps chunks aligned past that position too.
Run alone: `python -m repro.bugs.mamba_align_prefix_poison`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.MAMBA_ALIGN_PAST_LAST_CACHE
WRONG = ByDevice.both(Outcome.WRONG_RESULT)  # a finite state of the wrong position: no fault

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search, read_file).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#51113's description (merged: chunks kept block-aligned past last_cache_position; the "
        "364-of-2002 example, state@364 hashed as state@1600); #45477's description (the EAGLE "
        "back-off of last_cache_position, zero under two mamba blocks; issue #43559's accuracy "
        "collapse with MTP and prefix caching); a stored pre-fix Scheduler."
        "_mamba_block_aligned_split (align below last_cache_position, force a stop at it, "
        "accept anything past it); a stored tests/v1/core/test_mamba_align_chunk_split.py "
        "(its cases rewritten in tests/test_mamba_align.py)"
    ),
    not_verified=(
        "#51113's diff: the fixed split here is the project's rule that its test implies (every "
        "non-final chunk ends on a boundary; a chunk resuming mid-block stops at its block's "
        "end); issue #43559's own text; MambaManager.cache_blocks and allocate_new_blocks read "
        "only through the PR descriptions"
    ),
    what=(
        "the Mamba layer is a width-4 causal convolution and a decaying linear recurrence on "
        "seeded embeddings (harness/runner/mamba_align.py), not a model's mixer, run alone "
        "(no attention groups: a prefix hit needs the Mamba state only, and the EAGLE pruning "
        "of the last attention hit is not modelled, only the back-off it causes in the split); "
        "blocks of 8 tokens and a budget of 16 stand for upstream's 1600 and "
        "max_num_batched_tokens; one scheduler loop gives each step's budget to the wave's "
        "prefills in order, deferring a request its split gives 0; a mid-block start is made "
        "by a kept request's next turn after a prompt that ended mid-block (upstream's source "
        "of mid-block starts, a prefix hit finer than a block, is not modelled), and the split "
        "is also checked alone over a grid of starts, budgets, prompts and EAGLE on/off"
    ),
)

RECORD = BugRecord(
    id="mamba_align_prefix_poison",
    title="A Mamba state left mid-block is hashed as the state at the block's boundary",
    upstream="https://github.com/vllm-project/vllm/pull/51113",
    symptom=(
        "hybrid Mamba/GDN models (Qwen3.5/3.6) with mamba_cache_mode='align', prefix caching "
        "and EAGLE/MTP speculative decoding lose accuracy under concurrent load (issue #43559): "
        "requests resuming from a poisoned prefix-cache entry silently restore a truncated "
        "state, nothing raises or logs, and the entry persists until restart"
    ),
    root_cause=(
        "the scheduler's align-mode split kept prefill chunk ends block-aligned only below the "
        "last cacheable position, which EAGLE backs off by one block; past it a chunk shortened "
        "by the shared token budget ends mid-block, its entry holds that position's state, and "
        "the Mamba manager hashes the entry as the state at the block's end once a later chunk "
        "passes it"
    ),
    trigger=(
        "align mode with prefix caching and EAGLE (a prompt under two Mamba blocks backs the "
        "last cache position to 0); two prefills in one step, the second given a share of the "
        "budget that ends mid-block; a later request sharing the first block's tokens"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "shared_budget_resume",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "prompt lengths around Mamba block boundaries",
                    "two prefills sharing a step's token budget",
                    "one prefill per step",
                    "EAGLE back-off of the last cache position",
                    "no EAGLE back-off",
                    "prefix hit on a cached Mamba state",
                    "a chunk resuming mid-block",
                    # an unrelated request between the producer's wave and the consumer
                    "freed block reused by a new request",
                ),
            ),
            signature="consumer \\(hit 8 tokens\\) logits vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: the Mamba align-mode engine (harness/runner/mamba_align.py: waves of "
        "prefills sharing a token budget, EAGLE's back-off) is no runner configuration the "
        "programs of repro/program.py build"
    ),
    anchors=(
        (
            PART,
            "vllm/v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split: past "
            "last_cache_position (EAGLE: one block less) the chunk end is kept on a block "
            "boundary too (#51113); vllm/v1/core/single_type_kv_cache_manager.py "
            "MambaManager.cache_blocks hashes entry p as the state at (p + 1) * block_size "
            "tokens (here AlignStates.cache_blocks)",
        ),
    ),
    history=(
        "Verified with search and read_file (2026-11): #51113 '[Bugfix] Keep mamba align "
        "prefill chunks block-aligned past last_cache_position' (merged, opened 2026-08-05) is "
        "the correctness half of issue #43559, re-derived from #45477 (closed, kodek) and "
        "#47861 (yanghui1-arch) after the split was refactored; its description gives the "
        "mechanism (slot p hashed as the state at (p + 1) * block_size; alignment enforced "
        "below last_cache_position only; concurrent prefills sharing the budget; state@364 "
        "hashed as state@1600). #45477 quotes the EAGLE prune of last_cache_position and its "
        "Qwen3.6-27B block of 1600 tokens. A stored copy of the scheduler before the fix shows "
        "the three branches (align below, stop at, anything past). The stored upstream test "
        "tests/v1/core/test_mamba_align_chunk_split.py holds #51113's cases (first-chunk and "
        "tail fragments, five first-chunk sizes, three block sizes, mid-block resumes) and "
        "later ones (prefill checkpoint blocks, use_eagle_block_drop, partial hits) not "
        "modelled. Relatives: #50409 (open: the replay boundary as a stop), #53945/#53923 "
        "(the state at EAGLE's resume position), #54076 (open: the split on the Mamba group's "
        "block size, not the smallest group's: the same poisoning class), #33706 (alignment "
        "for resumed requests), #34798 (Mamba1 kernel-level chunk alignment), 1Cat-vLLM #472 "
        "(a split that returns 0 forever: starvation). Round 6 (an independent regression "
        "whose finish freed cached slots too survived: nothing was allocated between a "
        "producer's finish and the consumer's hit but the consumer's own new entry): an "
        "unrelated request now runs between them, so a freed block is reused by a new request "
        "before the hit (upstream's BlockPool evicts a cached block's hash when the free queue "
        "hands it out again, vllm/v1/core/block_pool.py _maybe_evict_cached_block; the "
        "engine here keeps cached slots out of the free list instead)."
    ),
)
