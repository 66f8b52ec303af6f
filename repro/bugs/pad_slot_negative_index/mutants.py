"""Fix-site mutants of pad_slot_negative_index: regressions of the cache-only layer's padding
skip a refactor of the layer, its call or the padding sentinel could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.CACHE_ONLY_SKIP_PAD_SLOTS
LAYER = "harness/runner/extract_hidden_states.py"
RUNNER, KV_CACHE = "harness/runner/model_runner.py", "harness/runner/kv_cache.py"
SKIP = "if Fix.CACHE_ONLY_SKIP_PAD_SLOTS in self.fixes:"
WRITE = "launch(reshape_and_cache, to_cache, to_cache, cache, cache, slot_mapping)"

MUTANTS = (
    Mutant(
        "skip_only_when_eager",
        PART,
        "partial",
        LAYER,
        SKIP,
        "if Fix.CACHE_ONLY_SKIP_PAD_SLOTS in self.fixes and not launch.capturing:",
        "the kernel write is taken where a step runs eagerly; the write a graph records "
        "indexes with torch again, and only graphs pad",
    ),
    Mutant(
        "pad_slots_clamped_to_zero",
        PART,
        "boundary",
        LAYER,
        WRITE,
        "launch(basic_cache, to_cache, cache, slot_mapping.clamp_min(0))",
        "padding redirected to slot 0 (upstream's later null-block clamp) on a runner whose "
        "block 0 a request holds: the padding rows overwrite that request's first slot there",
    ),
    Mutant(
        "group_one_slot_mapping",
        PART,
        "wrong_row",
        RUNNER,
        "self.cache_only.forward(hidden, attn.slot_mappings[0], self.launch)",
        "self.cache_only.forward(hidden, attn.slot_mappings[1], self.launch)",
        "the layer writes with another group's slot mapping, computed for another block size "
        "(#51328's relative): the states land in slots the connector does not read",
    ),
    Mutant(
        "write_into_a_copy",
        PART,
        "unused_state",
        LAYER,
        "        cache = self.kv_cache\n",
        "        cache = self.kv_cache.clone()\n",
        "the write goes to a temporary copy of the cache (a refactor that makes it contiguous "
        "first): the connector reads a cache nothing wrote",
    ),
    Mutant(
        "padding_slot_zero",
        PART,
        "boundary",
        KV_CACHE,
        "run(torch.Tensor.fill_, tables.slot_mappings[:, :t], -1)",
        "run(torch.Tensor.fill_, tables.slot_mappings[:, :t], 0)",
        "padding tokens get slot 0 (a reserved-slot convention, SGLang's) on a runner that "
        "reserves none: the skip never fires and slot 0 holds a request's token",
    ),
)
