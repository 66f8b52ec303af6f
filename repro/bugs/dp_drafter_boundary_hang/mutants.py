"""Fix-site mutants of dp_drafter_boundary_hang: regressions of the drafter's dummy steps on a
DP rank past the drafter's limit."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.DP_DRAFTER_DUMMY_RUN
DRAFTER = "harness/runner/drafter.py"
GATE = "if Fix.DP_DRAFTER_DUMMY_RUN in self.fixes and self.parallel.data_parallel_size > 1:"
DUMMY = "                self.dummy_run()\n            return None"
STEPS = (
    "        tokens = torch.zeros(1, dtype=torch.int64, device=self.model.device)\n"
    "        for _ in range(self.k):"
)

MUTANTS = (
    Mutant(
        "gate_above_two_ranks",
        PART,
        "boundary",
        DRAFTER,
        GATE,
        GATE.replace("> 1:", "> 2:"),
        "the drafter's dummy steps only from three DP ranks up: two ranks go out of step",
    ),
    Mutant(
        "dummy_on_rank_zero_only",
        PART,
        "wrong_row",
        DRAFTER,
        GATE,
        GATE.replace("> 1:", "> 1 and self.parallel.dp_rank == 0:"),
        "only DP rank 0 runs the drafter's dummy steps: rank 1 past the limit still skips",
    ),
    Mutant(
        "dummy_on_later_ranks_only",
        PART,
        "wrong_row",
        DRAFTER,
        GATE,
        GATE.replace("> 1:", "> 1 and self.parallel.dp_rank > 0:"),
        "only the ranks after 0 run the drafter's dummy steps: rank 0 past the limit skips",
    ),
    Mutant(
        "dummy_only_for_several_requests",
        PART,
        "partial",
        DRAFTER,
        GATE,
        GATE.replace("> 1:", "> 1 and len(requests) > 1:"),
        "the dummy steps only for a batch of several requests: a lone request past the limit "
        "skips (upstream: the gate is the batch's, whatever its size)",
    ),
    Mutant(
        "dummy_of_zero_tokens",
        PART,
        "boundary",
        DRAFTER,
        DUMMY,
        DUMMY.replace("dummy_run()", "dummy_run(num_tokens=0)"),
        "the dummy steps count zero tokens: the drafting peers pad to the wrong batch "
        "(upstream: the one-token dummy path)",
    ),
    Mutant(
        "dummy_one_step_short",
        PART,
        "partial",
        DRAFTER,
        STEPS,
        STEPS.replace("range(self.k)", "range(self.k - 1)"),
        "the dummy runs one draft step fewer than the drafting ranks: the last draft step's "
        "agreement waits for it",
    ),
)
