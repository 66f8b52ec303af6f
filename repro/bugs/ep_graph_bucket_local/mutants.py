"""Fix-site mutants of ep_graph_bucket_local: regressions of the agreed decode graph bucket."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.EP_GRAPH_BUCKET_AGREED
LAYER = "harness/runner/expert_parallel.py"
GATE = "        if Fix.EP_GRAPH_BUCKET_AGREED in self.fixes:"
AGREED = "            count = agreed"
CALL = "rows = self.rows = self.bucket(n, max(self.counts_across_ep))"
FITS = "fits = [size for size in self.capture_sizes if size >= max(count, 1)]"

MUTANTS = (
    Mutant(
        "agreed_min",
        PART,
        "wrong_row",
        LAYER,
        CALL,
        CALL.replace("max(self.counts_across_ep)", "min(self.counts_across_ep)"),
        "the bucket of the smallest agreed count: one geometry, but too few rows for the "
        "larger batch",
    ),
    Mutant(
        "agreed_when_both_busy",
        PART,
        "partial",
        LAYER,
        GATE,
        GATE.replace(":", " and min(self.counts_across_ep) > 0:"),
        "the agreed bucket only when every rank has tokens: an idle rank's dummy step keeps "
        "its own bucket",
    ),
    Mutant(
        "agreed_on_rank_zero_only",
        PART,
        "wrong_row",
        LAYER,
        GATE,
        GATE.replace(":", " and self.rank == 0:"),
        "only rank 0 picks the agreed bucket; rank 1 its local one",
    ),
    Mutant(
        "idle_rank_keeps_its_bucket",
        PART,
        "partial",
        LAYER,
        AGREED,
        AGREED.replace("agreed", "max(local, agreed) if local else local"),
        "an idle rank's dummy step keeps the smallest bucket (as if a dummy needed no agreement)",
    ),
    Mutant(
        "agreed_rank_zero_count",
        PART,
        "wrong_row",
        LAYER,
        CALL,
        CALL.replace("max(self.counts_across_ep)", "self.counts_across_ep[0]"),
        "every rank goes by rank 0's count: one bucket, too small when rank 1's batch is larger",
    ),
    Mutant(
        "bucket_past_the_count",
        PART,
        "boundary",
        LAYER,
        FITS,
        FITS.replace(">= max(count, 1)", "> max(count, 1)"),
        "the next bucket up from the count: a batch of exactly a capture size finds no graph",
    ),
)
