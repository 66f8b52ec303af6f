"""offload_store_race (vLLM #46278): a CPU offload connector's stores race the step's KV writes.

The CPU offload connector copies a step's freshly computed KV blocks to host memory on a side
stream once the scheduler confirms the tokens computed, while the step's KV-write kernels may
still be queued on the compute stream: the copy takes what the blocks held before, and a later
request whose prefix hits the CPU tier loads that back. The fix records a compute-done event
after the KV writes and makes the store stream wait on it. Run alone:
`python -m repro.bugs.offload_store_race`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.OFFLOAD_STORE_WAIT_COMPUTE
# the CPU tier holds what the blocks held before the writes (zeros): wrong logits, no fault
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#46278's review thread (merged: a compute-done event recorded on the compute stream, "
        "the store waits on it, one event reused each step; its docstring cites issue #45704); "
        "issue #45704 (garbled output under load, no event or wait_stream between the KV write "
        "and the store; the one-step deferral is host bookkeeping; 150/150 corrupt iterations "
        "without a wait); #31341 (OffloadingConnector: stores wait on the compute stream, moved "
        "to the next step's start); #47324, #50863 (the load side, WAR, open or closed)"
    ),
    not_verified=(
        "#46278's whole diff and test; SimpleCPUOffloadConnector's code (its block pool, LRU "
        "eviction, batched memcpy); the exact step at which it issues a store"
    ),
    what=(
        "the tier is a dict of block hashes over host blocks with no eviction and one block "
        "size; stores are two copies per block and group (K, V) on the stream model's copy "
        "stream; the device's lateness is streams.py's delay on the compute stream (the "
        "step's launches held on the host until the host waits for them), not a busy GPU; "
        "the host waits for pending stores before a lookup (upstream: get_finished reports "
        "them); async scheduling's overlap is only the host a step ahead up to the next "
        "step's start (offload_host_ahead), where it waits for the last step before it "
        "prepares the next one's inputs"
    ),
)

RECORD = BugRecord(
    id="offload_store_race",
    title="CPU offload stores copy KV blocks before the step's writes to them complete",
    upstream="https://github.com/vllm-project/vllm/pull/46278",
    symptom=(
        "with SimpleCPUOffloadConnector, requests whose prefix is restored from the CPU cache "
        "intermittently produce garbled output under load (issue #45704); no error is raised"
    ),
    root_cause=(
        "the GPU-to-CPU stores run on their own stream and are ordered after the KV writes "
        "only by host bookkeeping (the tokens confirmed computed): with the device behind the "
        "host the copy reads blocks the compute stream has not written yet, and the CPU cache "
        "keeps those bytes under the blocks' hashes"
    ),
    trigger=(
        "a CPU offload connector; a prompt filling whole blocks; the device behind the host "
        "when its blocks are stored; the prompt's blocks evicted from the device; a request "
        "sharing its prefix"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "store_then_hit",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE", "FULL"),
                capture_sizes=(4, 16),
                states=(
                    "store issued in the step of its KV writes",
                    "store issued a step after its KV writes",
                    "one block stored",
                    "several blocks stored",
                    "prefix hit in the CPU tier",
                    "two steps in flight",
                ),
            ),
            signature="of A's blocks in the CPU tier vs the device's: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/simple_kv_offload/worker.py, the worker's get_finished (#46278): before "
            "launching the GPU-to-CPU stores it records a compute-done event on the current "
            "stream (one event, re-recorded each step) and the store copies wait on it; here "
            "kv_offload.CPUOffloadConnector._issue",
        ),
    ),
    history=(
        "Verified with search (2026-11-28): PR #46278 '[Bugfix][KVConnector] Fix "
        "SimpleCPUOffloadConnector GPU->CPU store race' (merged; review 2026-06-22) and issue "
        "#45704 (closed: garbled output with restored KV under load; the reporter's test of "
        "the connector's copy primitives found every iteration corrupt without a wait_stream, "
        "and argued the one-step deferral of stores is host-side bookkeeping, no device "
        "ordering under overlapped execution). #31341 (merged) made the OffloadingConnector's "
        "GPU-to-CPU copies wait on the compute stream and moved them to the start of the next "
        "step. The load side's write-after-read race (a freed block reloaded while a previous "
        "request still reads it): issue #47282, #47324 (open) and #50863 (closed), not "
        "modelled (loads here wait for the compute stream in every variant). #29013 (merged) "
        "gave the OffloadingConnector a stream per transfer. Relatives in this catalogue: "
        "async_pinned_race and async_output_lifetime (copies on a side stream racing the main "
        "stream), sleep_prefix_cache (a cache hit on bytes that are not the prefix's)."
    ),
)
