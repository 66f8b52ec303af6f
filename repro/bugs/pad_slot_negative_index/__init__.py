"""pad_slot_negative_index (vLLM #43869, open; issue #43810): a padding slot of -1 wraps.

The extract_hidden_states speculative method stores every token's hidden state through a
cache-only attention layer, which writes `kv_cache[slot // block_size, slot % block_size] =
hidden` with torch indexing. A batch padded to a captured graph's size gives its padding
tokens slot -1 (PADDING_SLOT_ID), and torch reads -1 as "the last": the padding rows overwrite
the last slot of the pool's last block, silently, whenever a request holds that block. The
proposed fix writes through the fixed-shape cache-write op, whose kernel skips negative slots.
Run alone: `python -m repro.bugs.pad_slot_negative_index`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.CACHE_ONLY_SKIP_PAD_SLOTS
# torch wraps a negative index the same way on both devices (an in-bounds write: no fault)
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#43869's description (PADDING_SLOT_ID -1 wraps to the last slot of the last block; the "
        "fix skips negative slots); issue #43810's title"
    ),
    not_verified="the clamp-to-0 change the record mentions",
)

RECORD = BugRecord(
    id="pad_slot_negative_index",
    title="Graph padding's slot -1 overwrites the last slot of a cache-only layer's cache",
    upstream="https://github.com/vllm-project/vllm/pull/43869",
    symptom=(
        "with speculative method extract_hidden_states and CUDA graphs, a request's extracted "
        "hidden states differ from the model's at one position (issue #43810: a 64-token "
        "drafter call padded to 128 rows overwrote the hidden state in the pool's last slot, "
        "deterministically, with no error)"
    ),
    root_cause=(
        "the cache-only layer's basic_cache indexes its cache with the slot mapping in torch; "
        "padding tokens' slot -1 becomes block -1, offset block_size - 1: the last slot of the "
        "last block, a real token's when a request holds that block"
    ),
    trigger=(
        "a cache-only layer whose cache is read later (the connector's read of a request's "
        "hidden states); a step padded to a captured graph's size; a request holding the "
        "pool's last block whose last slot an earlier step wrote"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "padded_decode_after_prefill",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("FULL", "PIECEWISE"),
                capture_sizes=(2, 4),  # FULL: graphs of 4; PIECEWISE: of 2 and 4
                # A's decode: 1 token in the graph of 4 (FULL), in the graph of 2 (PIECEWISE,
                # under its largest, 4); then an eager dummy run of 1 token (every slot -1)
                states=(
                    "padded by tokens",
                    "padded count below the largest",
                    "an eager dummy run while a request holds blocks",
                ),
            ),
            signature="extracted hidden states .* vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/model_executor/models/extract_hidden_states.py: basic_cache (called from "
            "CacheOnlyAttentionImpl.do_kv_cache_update, through the unified_kv_cache_update "
            "op of CacheOnlyAttentionLayer.forward) writes the cache with the layer's slot "
            "mapping; #43869 replaces the indexing with reshape_and_cache_flash on CUDA (its "
            "kernel returns for slot_idx < 0) and a CPU fallback that drops negative slots; "
            "the padding comes from ExtractHiddenStatesProposer (vllm/v1/spec_decode/"
            "extract_hidden_states.py), which pads slot mappings with PADDING_SLOT_ID = -1",
        ),
    ),
    history=(
        "Verified with search and read_file (2026-11): issue #43810 (closed) names "
        "ExtractHiddenStatesProposer, PADDING_SLOT_ID = -1 and basic_cache's indexing, with "
        "a repro on an A100 (ExampleHiddenStatesConnector as KV producer, CUDA graphs on: the "
        "padded rows overwrote physical slot 79) and calls the corruption deterministic; it "
        "mentions #39247 (an illegal memory access) as perhaps related, not read here. PR "
        "#43869 (open) writes through reshape_and_cache_flash, whose CUDA kernel skips "
        "negative slots, to keep the write fixed-shape (no data-dependent boolean indexing in "
        "a graph), with a CPU fallback that filters negative slots: modelled, through this "
        "runner's paged cache-write kernel. A stored copy of upstream's "
        "extract_hidden_states.py instead clamps padding slots to 0, redirecting them to the "
        "null block (block 0, never given to a request); the PR that made that change was "
        "not found. This runner has no null block (block 0 is a request's like any other), "
        "so that clamp is a mutant here (pad_slots_clamped_to_zero). Relatives: #51328 "
        "(open: the proposer passed the main group's slot mapping to a cache-only layer of "
        "another block size), SGLang #32477 and #36207 (padding writes into a reserved slot "
        "0), TensorRT-LLM #18673 (a -1 padded cache slot written below the cache's base). "
        "Modelled: one cache-only layer on group 0's blocks and slot mapping stores the "
        "final hidden state of every token; CacheOnlyLayer.extract stands for the "
        "connector's read. The scenario also runs an eager dummy run while the request holds "
        "the pool's last block: Model Runner V2's dummy batches (an idle DP rank's step, "
        "profiling, warm-up) take their slot mappings from BlockTables.get_dummy_slot_mappings, "
        "PAD_SLOT_ID in every entry (read 2026-11, vllm/v1/worker/gpu/block_table.py), so "
        "eager steps are padded too and a fix applied to graph captures only is caught. The "
        "CPU shows what the GPU shows: torch wraps -1 in both index kernels and writes in "
        "bounds."
    ),
)
