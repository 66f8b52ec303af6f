"""lora_slot_memo (vLLM #47725; issue #47724): an adapter added between two decode steps
moves the in-flight adapters' slots while the memoised mapping says nothing changed.

The LoRA model manager's set_adapter_mapping skips the punica metadata refresh when the
step's LoRAMapping (the LoRA id of each token and request) equals the last one. Adding an
adapter to a live engine activates it at once; with every slot taken the least recently used
adapter is evicted, and the next step's activation of the batch's adapters evicts and
reloads again: lora_index_to_id rotates. The batch is unchanged, so the mapping is too, the
memo hits, and the metadata still holds the old slots: in-flight requests decode with another
adapter's weights, silently. The fix keys the memo on the slot layout as well.
Run alone: `python -m repro.bugs.lora_slot_memo`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
PART = Fix.LORA_SLOT_LAYOUT_MEMO
ADAPTERS = ("enabled", "evicted")
# two slots: the hot add evicts 1; the next step's activation moves 1 to slot 1 and 2 to slot
# 0: (1, 2) becomes (2, 1). Three slots (a second runner): 1 re-added (touched), 3 into the
# free slot, 4 evicts 2; the next step reloads 2 over 3: (1, 2, -) becomes (1, 4, 2)
STATES = ("two adapters swap slots", "one adapter's slot changes")

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#47725's description (set_adapter_mapping memoized on the mapping; an out-of-band "
        "add_lora can rotate lora_index_to_id; the fix keys the memo on the slot layout too); "
        "issue #47724"
    ),
    not_verified="the worker manager's per-step order; the diff",
)

RECORD = BugRecord(
    id="lora_slot_memo",
    title="Adapter added mid-decode rotates LoRA slots under a memoised mapping",
    upstream="https://github.com/vllm-project/vllm/pull/47725",
    symptom=(
        "after a runtime add_lora(), an in-flight LoRA request is silently served with another "
        "adapter's weights (no error, no log: issue #47724)"
    ),
    root_cause=(
        "set_adapter_mapping memoises on the last LoRAMapping only; an out-of-band activation "
        "LRU-evicts and reassigns slots (lora_index_to_id rotates) while the running batch, "
        "and so the mapping, is unchanged: the punica metadata keeps the old slots"
    ),
    trigger=(
        "every LoRA slot taken by decoding requests; add_lora() of another adapter between two "
        "decode steps of the same batch"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "adapter_added_between_decode_steps",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(graph_modes=("NONE",), adapters=ADAPTERS, states=STATES),
            signature="hidden states vs reference: \\d+/\\d+ differ",
        ),
        Scenario(
            "adapter_added_between_graph_replays",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("FULL",),
                capture_sizes=(2,),
                steps_per_size=3,
                adapters=ADAPTERS,
                states=STATES,
            ),
            signature="hidden states vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/lora/model_manager.py, LoRAModelManager.set_adapter_mapping (the memo, now "
            "on _last_mapping and _last_slot_layout, a tuple of lora_index_to_id; both reset "
            "by remove_all_adapters); the eviction: LRUCacheLoRAModelManager.activate_adapter "
            "(_active_adapters.remove_oldest, whose removal callback _deactivate_adapter frees "
            "the slot without touching the memo), reached from "
            "LRUCacheWorkerLoRAManager.add_adapter (vllm/lora/worker_manager.py)",
        ),
    ),
    history=(
        "Verified upstream (search and read_file, 2026-11): PR #47725 (merged) and its issue "
        "#47724 (closed; reproduced on v0.22.1 and v0.24.0; reached by AsyncLLM.add_lora, the "
        "/v1/load_lora_adapter endpoint and Dynamo's runtime LoRA load); a stored copy of "
        "vllm/lora/model_manager.py holds the fixed set_adapter_mapping, the LRU manager's "
        "activate_adapter with remove_oldest, and _deactivate_adapter, which leaves the memo. "
        "Not verified: the worker manager's per-step _apply_adapters order (modelled: each "
        "request's adapter activated and touched in batch order, which rotates two slots into "
        "each other's), and the PR's diff line by line. Here an explicit remove_lora drops the "
        "memo (the runner did before this bug); upstream's remove_adapter does not, so a "
        "remove then add under one mapping is a second upstream path not modelled. A re-add of "
        "a loaded adapter only touches it (LRUCacheWorkerLoRAManager.add_adapter, read in a "
        "stored copy of vllm/lora/worker_manager.py): with a free slot, that touch and two hot "
        "adds move one in-flight adapter while the other stays (the three-slot phase). Relatives: "
        "lora_dummy_run and lora_graph_capture (the same metadata, unset or not launched), "
        "sglang #8103 (an evicted adapter's buffers left stale)."
    ),
)
