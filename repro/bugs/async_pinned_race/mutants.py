"""Fix-site mutants of async_pinned_race: waits that do not make the host wait, or come late."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ASYNC_PINNED_REUSE_WAIT
FILE = "harness/runner/async_output.py"
GUARD = "        if Fix.ASYNC_PINNED_REUSE_WAIT in self.fixes and self.uploaded is not None:\n"
COMMENT = (
    "            # fix: async_pinned_reuse_wait -- "
    "the last upload may not have read the rows yet.\n"
)
WAIT = "            self.uploaded.synchronize()\n"
UPDATE = "        return super().add_requests(requests)\n"
APPLY_HEAD = (
    "\n    def apply(self, logits: torch.Tensor) -> torch.Tensor:\n"
    '        """The masked logits, written on the main stream once this step\'s upload landed."""\n'
    "        rows = logits.shape[0]\n"
)
UPLOAD = "        self.uploaded = self.streams.h2d(self.mask[:rows], self.mask_cpu[:rows])\n"

MUTANTS = (
    Mutant(
        "query_for_a_wait",
        PART,
        "unused_state",
        FILE,
        WAIT,
        "            self.uploaded.query()\n",
        "the event is asked whether the upload is done, and the answer ignored: nothing waits",
    ),
    Mutant(
        "wait_after_the_update",
        PART,
        "ordering",
        FILE,
        WAIT + UPDATE,
        "            restricted = super().add_requests(requests)\n"
        + WAIT
        + "            return restricted\n"
        + UPDATE,
        "the host waits for the upload once it has rewritten the rows the upload reads",
    ),
    Mutant(
        "device_side_wait",
        PART,
        "partial",
        FILE,
        WAIT,
        "            self.streams.wait(self.streams.main, self.uploaded)\n",
        "the main stream waits for the upload (a device-side wait): the host goes on writing",
    ),
    Mutant(
        "wait_only_when_restricted",
        PART,
        "partial",
        FILE,
        GUARD,
        GUARD.replace(
            " is not None:\n", " is not None and any(q.allowed_token_ids for q in requests):\n"
        ),
        "only a step that uploads the mask itself waits; an unrestricted step still rewrites it",
    ),
    Mutant(
        "wait_before_the_next_upload",
        PART,
        "ordering",
        FILE,
        GUARD + COMMENT + WAIT + UPDATE + APPLY_HEAD,
        UPDATE + APPLY_HEAD + GUARD + WAIT,
        "the host waits before the next upload, not before the next update: a step that "
        "uploads nothing (no restricted request) rewrites the rows unwaited",
    ),
    Mutant(
        "wait_only_when_incomplete",
        PART,
        "boundary",
        FILE,
        GUARD,
        GUARD.replace(" is not None:\n", " is not None and not self.uploaded.query():\n"),
        "the host skips the wait when the upload is already complete",
        equivalent="a complete upload has read the rows: skipping its wait changes nothing",
    ),
    Mutant(
        "event_of_the_main_stream",
        PART,
        "wrong_row",
        FILE,
        UPLOAD,
        "        self.uploaded = self.streams.on_main(None, torch.Tensor.size, logits)\n"
        + UPLOAD.replace("self.uploaded = ", ""),
        "the event is recorded on the main stream, not after the upload on the copy stream",
    ),
)
