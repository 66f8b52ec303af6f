"""Fix-site mutants of partial_wake_forward: regressions of the engine's pause and wake."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.FULLY_AWAKE_GATE
ENGINE, WORKER = "harness/runner/engine.py", "harness/runner/worker.py"
GATE = "        if Fix.FULLY_AWAKE_GATE in self.fixes and self.worker.is_sleeping:\n"
RESUME, DUMMY = GATE + "            return", GATE + "            #"

MUTANTS = (
    Mutant(
        "resume_on_any_wake",
        PART,
        "partial",
        ENGINE,
        RESUME,
        "        if Fix.FULLY_AWAKE_GATE not in self.fixes:\n            return",
        "the resume gate is gone, the dummy guard kept: a request after a partial wake runs",
    ),
    Mutant(
        "dummy_batch_unguarded",
        PART,
        "partial",
        ENGINE,
        DUMMY,
        "        if Fix.FULLY_AWAKE_GATE not in self.fixes:\n            #",
        "the DP loop's dummy batch is not guarded (#44483 before its review): a pause issued "
        "while asleep kicks a dummy forward",
    ),
    Mutant(
        "resume_once_weights_awake",
        PART,
        "wrong_row",
        ENGINE,
        RESUME,
        "        if Fix.FULLY_AWAKE_GATE in self.fixes and "
        '"weights" in self.worker.sleeping_tags:\n            return',
        "the gate waits for the weights only: a wake of the weights with the KV cache "
        "released resumes",
    ),
    Mutant(
        "resume_once_kv_cache_awake",
        PART,
        "wrong_row",
        ENGINE,
        RESUME,
        "        if Fix.FULLY_AWAKE_GATE in self.fixes and "
        '"kv_cache" in self.worker.sleeping_tags:\n            return',
        "the gate waits for the KV cache only: a wake of the KV cache first resumes with the "
        "weights released",
    ),
    Mutant(
        "awake_after_any_wake",
        PART,
        "partial",
        WORKER,
        "        self.sleeping_tags -= set(TAGS if tags is None else tags)\n",
        "        self.sleeping_tags = set()\n",
        "is_sleeping clears at the first wake, whatever its tags (the executor's flag before "
        "it counted tags)",
    ),
    Mutant(
        "sleep_marks_weights_only",
        PART,
        "partial",
        WORKER,
        "        self.sleep_level = level\n        self.sleeping_tags = set(TAGS)\n",
        "        self.sleep_level = level\n        self.sleeping_tags = {'weights'}\n",
        "a sleep records only the weights as asleep: a wake of the weights counts as fully awake",
    ),
)
