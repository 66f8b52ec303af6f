"""Fix-site mutants of rank_rng_divergence: regressions of the shared default seed."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.SEED_DEFAULT_ZERO
RUNNER = "harness/runner/model_runner.py"
GATE = "        if seed is None and Fix.SEED_DEFAULT_ZERO in self.fixes:\n"
DEFAULT = "            seed = 0\n"
SEEDED = "        return torch.Generator(c.device).manual_seed(seed)"
DRAW = "torch.rand(k, generator=self.rejection_generator, device=self.device)"

MUTANTS = (
    Mutant(
        "default_of_the_process_state",
        PART,
        "partial",
        RUNNER,
        DEFAULT,
        "            seed = torch.initial_seed()\n",
        "the unset seed resolves to the process's own state: each rank's, as before the fix",
    ),
    Mutant(
        "default_per_tp_rank",
        PART,
        "wrong_row",
        RUNNER,
        DEFAULT,
        "            seed = self.config.parallel.tp_rank\n",
        "the default seed is the worker's TP rank: set on every rank, but differently",
    ),
    Mutant(
        "seed_offset_by_global_rank",
        PART,
        "wrong_row",
        RUNNER,
        SEEDED,
        "        return torch.Generator(c.device).manual_seed(seed + c.parallel.rank)",
        "each worker's seed offset by its global rank (a per-DP-group offset needs the DP "
        "rank: rank // tensor_parallel_size): the TP ranks of one group draw apart",
    ),
    Mutant(
        "default_on_the_driver_only",
        PART,
        "wrong_row",
        RUNNER,
        GATE,
        "        if seed is None and Fix.SEED_DEFAULT_ZERO in self.fixes and "
        "self.config.parallel.rank == 0:\n",
        "only the driver worker (rank 0) seeds with the default; the others keep their own "
        "state (V0's reasoning: only rank 0's output was used)",
    ),
    Mutant(
        "default_above_two_ranks",
        PART,
        "boundary",
        RUNNER,
        GATE,
        "        if seed is None and Fix.SEED_DEFAULT_ZERO in self.fixes and "
        "self.config.parallel.tensor_parallel_size > 2:\n",
        "the default seed only from three TP ranks up: two ranks still draw apart",
    ),
    Mutant(
        "seeded_generator_unused",
        PART,
        "unused_state",
        RUNNER,
        DRAW,
        "torch.rand(k, device=self.device)",
        "the acceptance uniforms come from the process's default generator, not the seeded "
        "one: the ranks' own states again",
    ),
)
