"""Fix-site mutants of dp_zero_token_skip: regressions of the idle DP rank's dummy step."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.DP_ZERO_TOKEN_DUMMY_RUN
RUNNER = "harness/runner/model_runner.py"
GATE = "                and self.config.parallel.data_parallel_size > 1\n            ):"
DUMMY = "self.execute_model(dummy_run=True, num_tokens=1, num_reqs=1)"
JOIN = "            self._coordinate_dp(num_tokens)  # a dummy run joins the ranks' agreement too"

MUTANTS = (
    Mutant(
        "gate_above_two_ranks",
        PART,
        "boundary",
        RUNNER,
        GATE,
        "                and self.config.parallel.data_parallel_size > 2\n            ):",
        "the dummy step only from three DP ranks up: two ranks go out of step",
    ),
    Mutant(
        "dummy_on_rank_zero_only",
        PART,
        "wrong_row",
        RUNNER,
        GATE,
        "                and self.config.parallel.dp_rank == 0\n            ):",
        "only DP rank 0 runs its dummy step when idle: an idle rank 1 still skips",
    ),
    Mutant(
        "dummy_on_later_ranks_only",
        PART,
        "wrong_row",
        RUNNER,
        GATE,
        "                and self.config.parallel.dp_rank > 0\n            ):",
        "only the ranks after 0 run their dummy step: an idle rank 0 still skips",
    ),
    Mutant(
        "dummy_joins_nothing",
        PART,
        "partial",
        RUNNER,
        JOIN,
        "            pass  # a dummy run joins the ranks' agreement too",
        "the dummy step runs its forward but skips the token-count all-reduce",
    ),
    Mutant(
        "dummy_of_zero_tokens",
        PART,
        "boundary",
        RUNNER,
        DUMMY,
        "self.execute_model(dummy_run=True, num_tokens=0, num_reqs=1)",
        "the dummy step counts zero tokens: the peers pad to the wrong count (upstream: "
        "_dummy_run(1))",
    ),
    Mutant(
        "dummy_only_when_every_rank_idle",
        PART,
        "partial",
        RUNNER,
        GATE,
        "                and self.config.parallel.data_parallel_size > 1\n"
        "                and self.num_tokens_across_dp == [0, 0]\n            ):",
        "the dummy step only when the last agreement saw every rank idle: a rank idle alone skips",
    ),
)
