"""Fix-site mutants of offload_store_race: regressions a refactor of the connector's stores could
make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.OFFLOAD_STORE_WAIT_COMPUTE
CONNECTOR = "harness/runner/kv_offload.py"
WAIT = "            self.streams.wait(self.streams.copy, self.streams.record_main())\n"
FORWARD = """        self.launch.queue = self.streams.main.submit
        try:
            out = forward()
        finally:
            self.launch.queue = None
"""
GATE = """        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes:
            # fix: offload_store_wait_compute -- the step's KV writes may still be queued on
            # the compute stream: the side stream waits for an event recorded after them
            self.streams.wait(self.streams.copy, self.streams.record_main())
"""
LOOP = """        event = None
        for g, block, host, _ in stores:
            for tier, caches in ((self.k[g], self.kv.k_caches), (self.v[g], self.kv.v_caches)):
                event = self.streams.copy_after(None, tier[host], caches[g][block])
"""
STORES = "        stores = self._full_blocks(requests)\n"
ISSUE = """        if self.store_next_step:
            self.deferred = stores
        else:
            self._issue(stores)
"""

MUTANTS = (
    Mutant(
        "compute_waits_instead",
        PART,
        "wrong_row",
        CONNECTOR,
        WAIT,
        "            self.streams.wait(self.streams.main, self.streams.record_main())\n",
        "the wait is put on the compute stream (which waits for itself), not on the store stream",
    ),
    Mutant(
        "wait_on_the_store_stream",
        PART,
        "wrong_row",
        CONNECTOR,
        WAIT,
        "            self.streams.wait(self.streams.copy, "
        "self.streams._record(self.streams.copy))\n",
        "the compute-done event is recorded on the side stream itself: the stores wait for "
        "nothing of the compute stream's",
    ),
    Mutant(
        "stores_before_the_forward",
        PART,
        "ordering",
        CONNECTOR,
        FORWARD + STORES + ISSUE,
        STORES + ISSUE + FORWARD,
        "the stores are issued before the step's forward is launched: the event they wait for "
        "precedes the KV writes",
    ),
    Mutant(
        "wait_only_for_deferred_stores",
        PART,
        "partial",
        CONNECTOR,
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes:\n",
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes and self.store_next_step:\n",
        "only the deferred path waits (#31341's connector fixed, the simple one not): stores in "
        "the step of their writes race them",
    ),
    Mutant(
        "wait_only_for_stores_in_the_step",
        PART,
        "partial",
        CONNECTOR,
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes:\n",
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes and not self.store_next_step:\n",
        "the deferred stores skip the wait, trusting the one-step deferral (#45704: host "
        "bookkeeping, no device order once the host runs a step ahead)",
    ),
    Mutant(
        "wait_only_for_several_blocks",
        PART,
        "boundary",
        CONNECTOR,
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes:\n",
        "        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes and len(stores) > 2:\n",
        "the wait is skipped for a step that stores a single block (one K/V pair per group)",
    ),
    Mutant(
        "wait_after_the_copies",
        PART,
        "ordering",
        CONNECTOR,
        GATE + LOOP,
        LOOP + GATE,
        "the side stream waits for the compute-done event after its copies were submitted: "
        "they ran already",
    ),
)
