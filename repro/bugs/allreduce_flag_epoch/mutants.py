"""Fix-site mutants of allreduce_flag_epoch: regressions of the device's round, each leaving a
replay (or a call) waiting for a value its flag already holds."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ALLREDUCE_DEVICE_ROUND
KERNEL = "kernels/custom_allreduce.py"
COMM = "harness/runner/custom_allreduce.py"
LOAD = "        rnd = tl.load(counter) + 1"
STORE = "        tl.store(counter, rnd)"
SWITCH = "        device_round = Fix.ALLREDUCE_DEVICE_ROUND in self.fixes"
KEYWORD = "            device_round=device_round,"

MUTANTS = (
    Mutant(
        "round_not_advanced",
        PART,
        "partial",
        KERNEL,
        LOAD,
        LOAD.replace("+ 1", "+ 0"),
        "the kernel reads the device's round without advancing it: every call waits for the "
        "value its flag already holds",
    ),
    Mutant(
        "counter_written_back_unadvanced",
        PART,
        "unused_state",
        KERNEL,
        STORE,
        STORE.replace("rnd)", "rnd - 1)"),
        "the advanced round is used but the counter keeps the old one: each call waits for "
        "the last call's value",
    ),
    Mutant(
        "counter_synced_from_the_host",
        PART,
        "wrong_row",
        KERNEL,
        STORE,
        STORE.replace("rnd)", "host_round)"),
        "the counter is set from the host's round: a replay stores its captured value, and "
        "the next replay of the graph waits for what the last one wrote",
    ),
    Mutant(
        "device_round_for_eager_calls_only",
        PART,
        "partial",
        COMM,
        KEYWORD,
        KEYWORD.replace("=device_round,", "=device_round and not self.launch.capturing,"),
        "only eager calls take the device's round: graphs keep the host's, frozen at capture",
    ),
    Mutant(
        "device_round_past_two_ranks",
        PART,
        "boundary",
        COMM,
        SWITCH,
        SWITCH + " and self.parallel.world_size > 2",
        "the device's round only for worlds of more than two ranks: TP 2 keeps the host's",
    ),
)
