"""sleep_prefix_cache (vLLM #22726): the prefix cache outlives a sleep that discarded its blocks.

Sleep (any level) discards the KV cache: CuMem releases its physical memory and a wake maps new
memory at the same addresses. The prefix cache (block hashes of whole blocks of token ids,
chained with their prefix's, mapping to block ids) is host state and survives: after the wake a
repeated prompt hits it, skips computing its cached tokens and attends over discarded bytes.
Offline serving (LLM.sleep) already reset the prefix cache before sleeping; online serving
(AsyncLLM.sleep) did not. The fix resets it there, before the engine sleeps. Run alone:
`python -m repro.bugs.sleep_prefix_cache`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import WAKES, Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.RESET_PREFIX_CACHE_ON_SLEEP
WRONG = ByDevice.both(Outcome.WRONG_RESULT)  # NaN logits: the wake's 0xFF bytes, on every device

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#22726's description (sleep must clear the prefix cache to avoid gibberish; done "
        "offline, missing online; issue #20627); issue #17103 (fine with prefix caching off); "
        "#12284"
    ),
    not_verified=(
        "issue #20627's text; the diff; the reset sits in the worker's sleep here, not in AsyncLLM"
    ),
)

RECORD = BugRecord(
    id="sleep_prefix_cache",
    title="The prefix cache survives a sleep that discarded the KV cache it points into",
    upstream="https://github.com/vllm-project/vllm/pull/22726",
    symptom=(
        "with sleep mode and prefix caching on (the default), a server (AsyncLLM) put to sleep "
        "and woken up answers prompts it had served before with meaningless output (issue "
        "#17103, RL frameworks' colocated rollouts); enable_prefix_caching=False, or a "
        "reset_prefix_cache call before sleep, avoids it"
    ),
    root_cause=(
        "sleep discards the KV cache's contents, but the scheduler's prefix-cache hash table "
        "keeps mapping the served prompts' blocks: a repeated prompt after the wake is a cache "
        "hit on discarded memory, and its cached tokens are never recomputed"
    ),
    trigger=(
        "prefix caching; serve a prompt; sleep (level 1 or 2) with no reset of the prefix cache; "
        "wake up; serve a prompt sharing at least one whole block with it"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "repeat_prompts_after_wake",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                sleep_levels=(1, 2),
                wakes=WAKES[:2],
                # the prompts served before each sleep are served again after its wake (the
                # hits happen where the sleep keeps the cache: without the fix part)
                # and a runner with a sliding window (its null block reserved), one cycle
                states=("prefix hit on blocks cached before a sleep", "a reserved null block"),
            ),
            signature="logits vs recomputed reference: \\d+/\\d+ differ .*\\bnan vs ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/engine/async_llm.py AsyncLLM.sleep awaits self.reset_prefix_cache() before "
            "engine_core.sleep_async(level) (#22726; vllm/entrypoints/llm.py LLM.sleep already "
            "reset it); vllm/v1/core/kv_cache_manager.py reset_prefix_cache (#12284) returns "
            "False, resetting nothing, while any block is in use; here the worker's sleep calls "
            "the KV cache's reset_prefix_cache, which keeps that refusal",
        ),
    ),
    history=(
        "Verified with search (2026-11): #22726 '[Bugfix] Add reset prefix cache for online "
        "serving' (merged, opened 2025-08-12; its description: sleep mode must clear the prefix "
        "cache to avoid gibberish, done for offline inference, not for online serving, see "
        "issue #20627); issue #17103 'AsyncLLM sleep then wake_up produces meaningless "
        "outputs' (closed; the reporter found it goes away with enable_prefix_caching=False); "
        "#12284 (merged) added reset_prefix_cache, which can only reset while all blocks are "
        "free; stored copies of vllm/v1/engine/async_llm.py show sleep calling "
        "reset_prefix_cache before sleep_async (later copies' sleep takes a pause mode and "
        "no longer calls it there; their pause_generation clears the caches: not followed "
        "further). Downstream workarounds that cite #17103: ms-swift #5143, "
        "NeMo-RL #112, SkyRL's and others' reset before sleep. Related reports: #16234 "
        "(/wake_up after /sleep, improper responses), vllm-omni #6442 (open: its AR sleep "
        "keeps the scheduler's block hashes, later requests attend zeroed KV). Not found with "
        "search: issue #20627's own text. Relatives here: block_table_wake (the same pool "
        "discarded at sleep: its block-table pointers), kv_block_stale_nan (what a new block "
        "holds after the wake); not modelled: a sleep while a request holds blocks, where "
        "upstream's reset is refused and the hashes survive even with the fix (upstream "
        "later pauses or aborts requests first). The reset's refusal must not count the null "
        "block (upstream's BlockPool.reset_prefix_cache allows one used block: the null "
        "block, always in use): the scenario repeats one cycle on a runner with a sliding "
        "window, whose null block is reserved."
    ),
)
