"""partial_wake_forward (vLLM #44483): a forward while the KV cache still sleeps.

A staged wake (sleep, wake_up(tags=["weights"]), later wake_up(tags=["kv_cache"])) leaves the
KV cache released in between. EngineCore.wake_up resumed the scheduler after any wake, so a
request, or on an idle data-parallel rank the dummy batch it runs to stay in step with its
peers, ran a forward against the released memory: an illegal memory access. The fix resumes
only once the executor is fully awake (`is_sleeping` clears when every tag is awake) and skips
the data-parallel loop's dummy batch while asleep (a pause issued while asleep kicks that loop
too). Run alone: `python -m repro.bugs.partial_wake_forward`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

# GPU: unmapped CuMem memory; CPU: the PROT_NONE arena of the sleeping tag, SIGSEGV
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)
PART = Fix.FULLY_AWAKE_GATE

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#44483's description (resume scheduling only once fully resident; sleep, wake weights, a"
        " request: illegal memory access); issue #44395 (idle DP ranks' dummy batch); #44406, "
        "#44779, #45700"
    ),
    not_verified="that #44483's final version also guards the DP loop's dummy batch",
)

RECORD = BugRecord(
    id="partial_wake_forward",
    title="A forward runs after a partial wake, while the KV cache still sleeps",
    upstream="https://github.com/vllm-project/vllm/pull/44483",
    symptom=(
        "CUDA illegal memory access after wake_up(tags=['weights']) (issue #44395), with data "
        "parallelism even without a request (an idle rank's dummy batch; seen at the dummy "
        "run's input-prep sync, or as an NCCL error on its peers)"
    ),
    root_cause=(
        "EngineCore.wake_up resumes the scheduler after any wake, partial ones included, and "
        "the data-parallel loop runs an idle rank's dummy batch whenever the engines run, "
        "asleep or not"
    ),
    trigger=(
        "sleep(1 or 2), wake_up of one tag, then a request or (data parallel) any loop "
        "iteration; or a pause (sleep level 0) issued while asleep on a data-parallel rank"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "staged_wake_request",
            (Expect(frozenset({PART}), ILLEGAL),),
            axes=Axes(
                graph_modes=("NONE",),
                sleep_levels=(1, 2),
                wakes=("staged", "staged, kv_cache first"),
            ),
            cpu_signature='harness/runner/block_table\\.py", line \\d+ in set_row\\b',
        ),
        Scenario(
            "idle_dp_rank_dummy_batch",
            (Expect(frozenset({PART}), ILLEGAL),),
            axes=Axes(graph_modes=("NONE",), sleep_levels=(1,), wakes=("staged",)),
            cpu_signature='harness/runner/block_table\\.py", line \\d+ in run_now\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/engine/core.py, EngineCore.wake_up (resume_scheduler only when "
            "model_executor.is_sleeping is false), and the data-parallel busy loop of "
            "DPEngineCoreProc (execute_dummy_batch skipped while the executor sleeps); "
            "vllm/v1/executor/abstract.py Executor.wake_up clears is_sleeping only once no "
            "tag sleeps",
        ),
    ),
    history=(
        "Verified upstream (search): PR #44483 (merged; opened 2026-06-04; fixes issue #44395, "
        "vLLM 0.22.0, Qwen3-30B-A3B with TP 2, DP 2, expert parallel) gates resume_scheduler on "
        "not is_sleeping; after review it also guards the DP loop's execute_dummy_batch on "
        "is_sleeping: its author's pure-vLLM DP repro was sleep(level=1) then sleep(level=0), "
        "whose pause completion sets engines_running for the consensus all-reduce, and the "
        "trace ended in the dummy run's input-prep synchronize with an illegal memory access. "
        "Rivals for the same issue: #44406 (open), #44779 (closed), #45700 (closed; its "
        "description, not #44483's, says the dummy batch writes the KV slot mapping into "
        "freed memory). Not verified: #44483's final diff line by line (its description and "
        "comments were read). Relatives: vllm-omni #4834 (admission guard on partial wake); "
        "#44890 (a release_kv_cache_memory API whose review found sleep after a partial wake "
        "reading discarded buffers); the sleep bugs of this catalogue: block_table_wake "
        "(the kv_cache pool discarded at sleep; staged wakes), level2_sleep_state (buffers "
        "restored only when the weights wake). On the H100 the first version of "
        "staged_wake_request showed `exception`, not `illegal_address`: its first touch of the "
        "released pool was a host-to-device copy of a block-table row, which CUDA refuses "
        "(invalid argument); the runner now writes block-table rows with device kernels from "
        "staged ids, as Model Runner V2 applies its staged writes, and a kernel's write there "
        "faults as upstream's did (illegal address on both devices, 20 of 20 runs)."
    ),
)
