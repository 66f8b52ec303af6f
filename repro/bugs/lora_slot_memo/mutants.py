"""Fix-site mutants of lora_slot_memo: keys that miss a rotation, and an activation too late."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.LORA_SLOT_LAYOUT_MEMO
LORA, RUNNER = "harness/runner/lora.py", "harness/runner/model_runner.py"
KEY = "slot_layout = tuple(self.lora_index_to_id)"
ACTIVATE = "            self._activate_adapters(requests)\n"
MAPPING = (
    "            mapping = LoRAMapping(batch.token_lora_ids, batch.req_lora_ids, is_prefill=True)\n"
    "            self.lora_manager._adapter_manager.set_adapter_mapping(mapping)\n"
)

MUTANTS = (
    Mutant(
        "layout_as_a_set",
        PART,
        "partial",
        LORA,
        KEY,
        "slot_layout = frozenset(self.lora_index_to_id)",
        "the memo keys on which adapters are active, not where: a rotation of the same "
        "adapters between slots hits it",
    ),
    Mutant(
        "layout_aliases_the_live_list",
        PART,
        "unused_state",
        LORA,
        KEY,
        "slot_layout = self.lora_index_to_id",
        "the memo keeps the live list, not a snapshot: the comparison sees itself, always equal",
    ),
    Mutant(
        "layout_in_recency_order",
        PART,
        "wrong_row",
        LORA,
        KEY,
        "slot_layout = tuple(self._lru)",
        "the memo keys on the LRU order, which the step's activations restore while the slots "
        "rotate",
    ),
    Mutant(
        "layout_occupancy_only",
        PART,
        "partial",
        LORA,
        KEY,
        "slot_layout = tuple(i is not None for i in self.lora_index_to_id)",
        "the memo keys on which slots are taken, not by whom",
    ),
    Mutant(
        "either_key_unchanged_skips",
        PART,
        "partial",
        LORA,
        "unchanged = unchanged and slot_layout == self._last_slot_layout",
        "unchanged = unchanged or slot_layout == self._last_slot_layout",
        "the refresh needs both keys changed: a new batch on the same slots keeps the last "
        "step's metadata",
    ),
    Mutant(
        "layout_kept_while_any_slot_is",
        PART,
        "partial",
        LORA,
        "unchanged = unchanged and slot_layout == self._last_slot_layout",
        "unchanged = unchanged and any(\n"
        "                a == b for a, b in zip(slot_layout, self._last_slot_layout or ())\n"
        "            )",
        "the layout counts as moved only when every slot changed: a swap refreshes, one "
        "adapter moved while another stays does not",
    ),
    Mutant(
        "adapters_activated_after_the_mapping",
        PART,
        "ordering",
        RUNNER,
        ACTIVATE + MAPPING,
        MAPPING + ACTIVATE,
        "the step's adapters are activated after its metadata was refreshed: the refresh sees "
        "the hot-added adapter's slots, without the batch's evicted one",
    ),
)
