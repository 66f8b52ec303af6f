"""Fix-site mutants of draft_lookahead_alloc: regressions of the lookahead the scheduler counts,
of the steps that get it, and of the allocation and the drafter's writes it must agree with."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

BONUS, PREFILL = Fix.DRAFT_LOOKAHEAD_BONUS_SLOT, Fix.DRAFT_LOOKAHEAD_ON_PREFILL
LOOKAHEAD, KV_CACHE = "harness/runner/lookahead.py", "harness/runner/kv_cache.py"
RUNNER = "harness/runner/model_runner.py"
CALL = "lookahead_slots(self.drafter.k, kv.first_step(row), self.fixes)"
ROWS = "            for row, q in enumerate(requests)\n        }"

MUTANTS = (
    Mutant(
        "bonus_slot_dropped",
        BONUS,
        "partial",
        LOOKAHEAD,
        "        slots = num_speculative_tokens + 1\n",
        "        slots = num_speculative_tokens\n",
        "EAGLE's count for a drafter whose query block is one longer",
    ),
    Mutant(
        "bonus_slot_on_decodes_only",
        BONUS,
        "partial",
        LOOKAHEAD,
        "if Fix.DRAFT_LOOKAHEAD_BONUS_SLOT in fixes:",
        "if Fix.DRAFT_LOOKAHEAD_BONUS_SLOT in fixes and not first_step:",
        "the extra slot only after a request's first step: a prefill gets k",
    ),
    Mutant(
        "drafts_counted_one_short",
        BONUS,
        "boundary",
        RUNNER,
        CALL,
        CALL.replace("self.drafter.k,", "self.drafter.k - 1,"),
        "the scheduler's speculative count one below the drafter's",
    ),
    Mutant(
        "blocks_rounded_down",
        BONUS,
        "boundary",
        KV_CACHE,
        "while len(owned[g]) < triton.cdiv(slots, size):",
        "while len(owned[g]) < slots // size:",
        "whole blocks only: the slots of a partly used last block never allocated",
    ),
    Mutant(
        "allocation_one_slot_short",
        BONUS,
        "boundary",
        KV_CACHE,
        "slots = min(seq_len + self.lookahead.get(row, 0), self.max_model_len)",
        "slots = min(seq_len + self.lookahead.get(row, 0) - 1, self.max_model_len)",
        "the last lookahead position left out of the allocation",
    ),
    Mutant(
        "query_block_shifted",
        BONUS,
        "wrong_row",
        LOOKAHEAD,
        "written = torch.arange(q.num_computed_tokens, end + self.k + 1, device=device)",
        "written = torch.arange(q.num_computed_tokens + 1, end + self.k + 2, device=device)",
        "the drafter writes one position later than the scheduler counted: its last one past",
    ),
    Mutant(
        "prefill_lookahead_dropped",
        PREFILL,
        "partial",
        LOOKAHEAD,
        "if first_step and Fix.DRAFT_LOOKAHEAD_ON_PREFILL not in fixes:",
        "if first_step:",
        "every prefill's lookahead dropped again (the override of #22317)",
    ),
    Mutant(
        "lookahead_for_running_rows_only",
        PREFILL,
        "partial",
        RUNNER,
        ROWS,
        ROWS.replace("(requests)", "(requests)\n            if not kv.first_step(row)"),
        "lookahead only for a request that ran a step before: never on its first",
    ),
    Mutant(
        "lookahead_for_single_token_steps",
        PREFILL,
        "partial",
        RUNNER,
        ROWS,
        ROWS.replace("(requests)", "(requests)\n            if len(q.token_ids) == 1"),
        "lookahead only for decode steps (one token): a prefill, however short, gets none",
    ),
    Mutant(
        "lookahead_after_a_prefix_hit_only",
        PREFILL,
        "wrong_row",
        RUNNER,
        ROWS,
        ROWS.replace("(requests)", "(requests)\n            if q.num_computed_tokens"),
        "a request that starts at position 0 gets none; one with a prefix hit keeps it",
    ),
    Mutant(
        "allocation_ignores_lookahead",
        PREFILL,
        "unused_state",
        KV_CACHE,
        "slots = min(seq_len + self.lookahead.get(row, 0), self.max_model_len)",
        "slots = min(seq_len, self.max_model_len)",
        "the lookahead counted and passed, never allocated",
    ),
)
