"""Fix-site mutants of level2_sleep_state: regressions a refactor of sleep and wake could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.SLEEP_SAVED_BUFFERS
WORKER = "harness/runner/worker.py"
SAVE = """        if level == 2 and Fix.SLEEP_SAVED_BUFFERS in self.fixes:
            # fix: sleep_saved_buffers -- level 2 keeps no copy of the weights pool, and the
            # reload at wake writes checkpoint parameters only
            buffers = self.model_runner.model.named_buffers()
            self._sleep_saved_buffers = {n: b.cpu().clone() for n, b in buffers.items()}
"""
DISCARD = '        self.pools.sleep(offload_tags=("weights",) if level == 1 else ())\n'
GATE = 'Fix.SLEEP_SAVED_BUFFERS in self.fixes and (tags is None or "weights" in tags)'

MUTANTS = (
    Mutant(
        "restore_on_any_wake",
        PART,
        "partial",
        WORKER,
        GATE,
        "Fix.SLEEP_SAVED_BUFFERS in self.fixes",
        "the restore ignores the wake's tags (#16889 as first merged, #49774's bug): a wake of "
        "the KV cache first copies into the sleeping weights pool",
    ),
    Mutant(
        "restore_only_on_full_wake",
        PART,
        "partial",
        WORKER,
        GATE,
        "Fix.SLEEP_SAVED_BUFFERS in self.fixes and tags is None",
        "a staged wake never restores the buffers",
    ),
    Mutant(
        "save_after_discard",
        PART,
        "ordering",
        WORKER,
        SAVE + DISCARD,
        DISCARD + SAVE,
        "the buffers are saved after the pool was discarded: the copy reads released memory",
    ),
    Mutant(
        "save_a_device_view",
        PART,
        "unused_state",
        WORKER,
        "{n: b.cpu().clone() for n, b in buffers.items()}",
        "{n: b.detach() for n, b in buffers.items()}",
        "the saved buffers alias the device memory the sleep discards, no host copy",
    ),
    Mutant(
        "reset_to_default",
        PART,
        "wrong_row",
        WORKER,
        "                buffers[name].copy_(saved)\n",
        "                buffers[name].fill_(1.0)\n",
        "the wake resets each buffer to a default instead of restoring it (#28783's way with "
        "the fp8 KV scales, whose calibrated values it lost)",
    ),
    Mutant(
        "restore_rebinds_the_buffer",
        PART,
        "unused_state",
        WORKER,
        "                buffers[name].copy_(saved)\n",
        "                buffers[name].data = saved.to(buffers[name].device)\n",
        "the wake gives each buffer new memory holding the saved values instead of writing them "
        "in place: the model's tensor is right, but a graph captured before the sleep reads the "
        "old address, the wake's bytes",
    ),
    Mutant(
        "save_at_level_1",
        PART,
        "boundary",
        WORKER,
        "if level == 2 and Fix.SLEEP_SAVED_BUFFERS in self.fixes:",
        "if level == 1 and Fix.SLEEP_SAVED_BUFFERS in self.fixes:",
        "the save runs for the level that keeps a host copy anyway, not for level 2",
    ),
)
