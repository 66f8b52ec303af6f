"""Fix-site mutants of lazy_attn_state: regressions a refactor of capture could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.FRESH_ATTN_STATE_FOR_CAPTURE
GRAPHS, RUNNER = "harness/runner/cudagraph.py", "harness/runner/model_runner.py"
FRESH = "            forward_fn, attn_state = create_forward_fn(desc, warmup=False)"
WARM_UP = "        forward_fn(CUDAGraphMode.NONE)  # warm-up: allocations, lazy init, autotuning\n"
COMMENT = (
    "            # fix: fresh_attn_state_for_capture -- "
    "lazy attention init must run in the graph.\n"
)
PREWARM = (
    "        if desc.cg_mode == CUDAGraphMode.FULL and Fix.CAPTURE_PREWARM in self.fixes:\n"
    "            # fix: capture_prewarm -- "
    "the capture path's first call (its tuning) must be eager.\n"
    "            create_forward_fn(desc, warmup=False)[0](CUDAGraphMode.NONE)"
    "  # a disposable state\n"
)
CONDITION = (
    "        if desc.cg_mode == CUDAGraphMode.FULL"
    " and Fix.FRESH_ATTN_STATE_FOR_CAPTURE in self.fixes:"
)


def _condition_and(extra: str) -> str:
    """CONDITION with one more conjunct."""
    return (
        "        if (\n"
        "            desc.cg_mode == CUDAGraphMode.FULL\n"
        "            and Fix.FRESH_ATTN_STATE_FOR_CAPTURE in self.fixes\n"
        f"            and {extra}\n"
        "        ):"
    )


MUTANTS = (
    Mutant(
        "fresh_function_unused",
        PART,
        "unused_state",
        GRAPHS,
        FRESH,
        "            _, attn_state = create_forward_fn(desc, warmup=False)",
        "a fresh state is made and kept, but the capture runs the warm-up's forward function",
    ),
    Mutant(
        "fresh_state_not_kept",
        PART,
        "unused_state",
        GRAPHS,
        FRESH,
        "            forward_fn, _ = create_forward_fn(desc, warmup=False)",
        "the capture uses the fresh state, captured_attn_states keeps the warm-up's",
    ),
    Mutant(
        "fix_for_the_largest_size_only",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        _condition_and("not any(d.cg_mode == desc.cg_mode for d in self.graphs)"),
        "only the first (largest) FULL descriptor gets a fresh state",
    ),
    Mutant(
        "fix_for_piecewise_instead",
        PART,
        "wrong_row",
        GRAPHS,
        CONDITION,
        CONDITION.replace("CUDAGraphMode.FULL", "CUDAGraphMode.PIECEWISE"),
        "the fresh state goes to the PIECEWISE descriptors, whose attention is not captured",
    ),
    Mutant(
        "fresh_state_before_warm_up",
        PART,
        "ordering",
        GRAPHS,
        WARM_UP + PREWARM + CONDITION + "\n" + COMMENT + FRESH + "\n",
        CONDITION + "\n" + FRESH + "\n" + WARM_UP + PREWARM,
        "the fresh state is made before the warm-up, which then plans with it",
    ),
    Mutant(
        "runner_reuses_the_state",
        PART,
        "unused_state",
        RUNNER,
        "attn.uniform_decode, attn.sched = desc.uniform_decode, FlashMLASchedMeta()",
        "attn.uniform_decode = desc.uniform_decode\n"
        "        old = self.capture_attn.get(desc)\n"
        "        attn.sched = old.sched if old is not None else FlashMLASchedMeta()",
        "create_forward_fn hands out the descriptor's earlier (warm-up) state again",
    ),
    Mutant(
        "piecewise_replay_keeps_last_plan",
        PART,
        "unused_state",
        RUNNER,
        "attn.sched, attn.uniform_decode = FlashMLASchedMeta(), batch.uniform_decode",
        "attn.uniform_decode = batch.uniform_decode",
        "a PIECEWISE replay's eager attention keeps the plan of the graph's previous replay",
    ),
    Mutant(
        "fresh_state_first_lora_case_only",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        _condition_and("(desc.num_active_loras or 1) == 1"),
        "a fresh state for the first LoRA capture case only: the other cases' FULL graphs are "
        "captured on the warm-up state (found by an independent regression)",
    ),
)
