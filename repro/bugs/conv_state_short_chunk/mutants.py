"""Fix-site mutants of conv_state_short_chunk: regressions of where the causal-conv1d kernel
stores a chunk's final conv state, in the kernel and in the slots the runner names."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.CONV_STATE_OWN_BLOCK
KERNEL, ALIGN = "kernels/causal_conv1d.py", "harness/runner/mamba_align.py"
FIXED_STORE = (
    "            # fix: conv_state_short_chunk -- the sequence's own slot, not the one read from\n"
    "            _store_state(states, final,"
)
GATE = "own_block = Fix.CONV_STATE_OWN_BLOCK in self.fixes"

MUTANTS = (
    Mutant(
        "short_store_to_the_read_slot",
        PART,
        "wrong_row",
        KERNEL,
        FIXED_STORE,
        FIXED_STORE.replace("states, final,", "states, source,"),
        "the short branch's store goes back to the pointer its initial state came from",
    ),
    Mutant(
        "one_short_length_only",
        PART,
        "boundary",
        KERNEL,
        "        if OWN_BLOCK:\n",
        "        if OWN_BLOCK and seqlen == 2:\n",
        "only a chunk of width - 2 tokens stores to its own slot: a one-token chunk does not",
    ),
    Mutant(
        "own_slot_for_fresh_starts_only",
        PART,
        "partial",
        ALIGN,
        GATE,
        GATE + " and src is None",
        "the own-slot store is kept where the two slots are one anyway (no initial state)",
    ),
    Mutant(
        "one_slot_per_sequence",
        PART,
        "wrong_row",
        ALIGN,
        "initial, slots(dst), u, own_block=own_block)",
        "initial, initial if src is not None else slots(dst), u, own_block=own_block)",
        "the runner names one state slot per sequence, as before prefix caching: every chunk "
        "from a cached block writes that block",
    ),
    Mutant(
        "state_slot_stride",
        PART,
        "boundary",
        KERNEL,
        "base = states + slot.to(tl.int64) * dim * 3 + feats * 3",
        "base = states + slot.to(tl.int64) * 3 + feats * 3",
        "the stored state's slot offset forgets the channels: it lands inside another slot",
    ),
    Mutant(
        "long_branch_from_width",
        PART,
        "boundary",
        KERNEL,
        "    if seqlen >= 3:",
        "    if seqlen >= 4:",
        "a chunk of exactly width - 1 tokens takes the short branch",
        equivalent=(
            "the fixed short branch stores the same shifted columns to the same own slot: for a "
            "chunk of 3 they are its 3 inputs, as the long branch's"
        ),
    ),
)
