"""allreduce_flag_epoch (vLLM #46913, ROCm/aiter #3928, SGLang #29508): a graph replays the
all-reduce's round captured as a host argument, so its wait is satisfied by its last replay's
flag and a rank reads a peer's data of the previous round.

The all-reduce's barriers wait until each peer's flag equals the call's round ("flag color").
Passed as a host scalar and advanced on the host after each call, the round is frozen into a
CUDA graph when captured: every replay waits for the same value, which the previous replay of
that graph left in the flag, so the wait returns before the peer has written this round's data
and the rank sums the peer's previous data, silently. The fix keeps the round in device memory
and advances it in the kernel at every call, replays included (as vLLM's custom all-reduce's
per-block flag). Runs as two rank processes (Scenario.ranks):
`python -m repro.bugs.allreduce_flag_epoch`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Fold, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
PART = Fix.ALLREDUCE_DEVICE_ROUND
FOLD_FILES = (
    "kernels/custom_allreduce.py",
    "harness/runner/custom_allreduce.py",
    "kernels/resources.py",
)

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues corpus).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "ROCm/aiter #3928's description (merged: quick-reduce passes its round, flag_color, as "
        "a host scalar kernel argument advanced on the host; captured, the value is baked and "
        "reused by every replay while the block-keyed flags are never reset and the wait "
        "compares for equality; when a captured quick-reduce is the sole writer of its flag "
        "slot, the next replay finds the value left by the previous one and reads the "
        "previous replay's data; the fix keeps a per-block flag-color counter in device "
        "memory, initialized to 1, read and advanced by the kernel, as custom_all_reduce's "
        "self_sg->_flag[blockIdx.x] + 1); vLLM #46913's and SGLang #29508's descriptions "
        "(merged: the same cause in steps, a two-rank reproducer over a gloo group in the FP "
        "regime, bit-exact small fp16 integers)"
    ),
    not_verified=(
        "the three diffs line by line (the descriptions were read); the reproducer's exact "
        "sizes and rounds; whether the two-stage and quantized paths differ"
    ),
    what=(
        "the model is the custom all-reduce of car_register_before_replay's runner (a "
        "one-stage, one-program Triton kernel over peer memory) with quick-reduce's host round "
        "as the buggy variant, not quick-reduce's two-shot quantized kernel; one flag per rank "
        "pair (no blocks); the stale read made to happen on every run by a forced order of "
        "the ranks (rank 0 first at each call: rank 1 launches once rank 0 has finished the "
        "call or spins in it), never by timing; float32"
    ),
)

RECORD = BugRecord(
    id="allreduce_flag_epoch",
    title="A replayed all-reduce waits for its captured round and reads a peer's old data",
    upstream="https://github.com/vllm-project/vllm/pull/46913",
    symptom=(
        "tensor parallelism with quick all-reduce (ROCm) under CUDA graphs: accuracy errors, "
        "all-reduce results silently wrong from the second replay of a graph (#46913, "
        "ROCm/aiter #3928)"
    ),
    root_cause=(
        "the round a rank's barrier waits for is a host scalar kernel argument advanced on the "
        "host; a CUDA graph bakes it, so a replay waits for the value its previous replay "
        "already left in the flag and proceeds before the peer wrote this round's data"
    ),
    trigger=(
        "two TP ranks; a graph whose all-reduce is the only writer of its flags replayed twice "
        "in a row, the peer late"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "replayed_round_flags",
            (Expect(frozenset({PART}), WRONG),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE", "FULL"),
                capture_sizes=(8, 4),
                steps_per_size=3,
                states=(
                    "one graph replayed several times in a row",
                    "graphs replayed alternately",
                    "eager all-reduce through the registered buffer",
                    "the all-reduce's first call",
                    "eager calls between replays, the replays outnumbering them",
                ),
            ),
            # rank 0's stale sum, or rank 1's read after rank 0 left (the end barrier's stale
            # flag, the same replay): the rank that exits first names the run
            signature=(
                r"step 2 \(7 tokens, graphs\): rank (0 target vs reference: \d+/\d+ differ"
                r"|1 read its input after the peer had left the end barrier)"
            ),
            ranks=2,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(Fold(PART, ("device_round", "DEVICE_ROUND"), FOLD_FILES),),
    fuzz=(
        "not drawn yet: ranks (a tensor-parallel world of two workers over the custom "
        "all-reduce, ordered at each call) replaying one graph in a row; a program drives one "
        "worker"
    ),
    anchors=(
        (
            PART,
            "ROCm/aiter quick-reduce (quick_all_reduce.cuh and its launcher): the flag color "
            "from a device counter the kernel advances (#3928); vLLM and SGLang "
            "quick_all_reduce.py and csrc/quickreduce (#46913, #29508); the model's "
            "kernels/custom_allreduce.py DEVICE_ROUND branch",
        ),
    ),
    history=(
        "Verified upstream (search, issues corpus): ROCm/aiter #3928 (merged, 2026-06-25: "
        "flag sync made CUDA-graph-safe, the device-side flag color); vLLM #46913 and SGLang "
        "#29508 (merged, 2026-06-27: quick-reduce accuracy error in graph mode, the same "
        "cause). Relatives: tokenspeed #1440's review (a host-side staging-slot counter "
        "frozen under capture, fixed with an exit barrier); ROCm/mori #559 (64-bit "
        "device-side generations for graph replays of SDMA all-reduce). In this catalogue: "
        "car_register_before_replay (the same kernel's rank-data rows in the capture window)."
    ),
)
