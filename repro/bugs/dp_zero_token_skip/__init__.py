"""dp_zero_token_skip (vLLM #28774): a data-parallel rank with zero tokens skips the step's
collective.

Under data parallelism every DP rank joins, on every step, an all-reduce that agrees on each
rank's token count (upstream: coordinate_batch_across_dp, whose result pads the ranks'
batches alike). A rank whose scheduler gave it zero tokens while its requests are unfinished
(async scheduling; a request waiting for its grammar) returned an empty output before that
all-reduce, so its peer waited in it while the idle rank went on to its next collective. The
fix: the idle rank runs a one-token dummy step first, which joins the agreement. Runs as two
rank processes (Scenario.ranks): `python -m repro.bugs.dp_zero_token_skip`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

MISMATCH = ByDevice.both(Outcome.COLLECTIVE_MISMATCH)
PART = Fix.DP_ZERO_TOKEN_DUMMY_RUN

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues corpus).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#28774's description (async scheduling with DP > 1, external launcher: a rank with "
        "num_scheduled_tokens == 0 returned before coordinate_batch_across_dp; gloo "
        "EnforceNotMet 'op.preamble.length <= op.nbytes. 8 vs 4' while rank 0 was in "
        "has_unfinished_requests and rank 1 in coordinate_batch_across_dp; fix: a dummy run "
        "before the early return); issue #43547's comment quoting the fixed gate "
        "(external_launcher and data_parallel_size > 1) and the ray/mp deadlock it leaves; "
        "#29433's description and diff hunk (the dummy run's size padded); #29996's "
        "description (an env switch to compile grammars synchronously: WAITING_FOR_FSM "
        "requests give zero-token steps); #44601's description (open: the gate widened to "
        "every DP backend); #51984 and #53578 (the same widening, closed/open)"
    ),
    not_verified=(
        "#28774's diff line by line (its description was read, and the fixed code as #43547 "
        "quotes it); whether upstream's Model Runner V2 has the same gate"
    ),
    what=(
        "the runner models the per-step token-count all-reduce, the engine loop's "
        "unfinished-requests all-reduce, the early return of an empty step and a drafter's "
        "per-draft-step batch all-reduce (the runner's greedy drafter, not EAGLE); no async "
        "scheduler, no external launcher gate (the fix here is #44601's: every DP backend), "
        "no MoE collectives; the buggy outcome is the harness's trace oracle "
        "(collective_mismatch), where upstream saw gloo's abort or a hang"
    ),
)

RECORD = BugRecord(
    id="dp_zero_token_skip",
    title="A data-parallel rank with zero scheduled tokens skips the step's token-count all-reduce",
    upstream="https://github.com/vllm-project/vllm/pull/28774",
    symptom=(
        "with DP > 1 and async scheduling, gloo aborts with EnforceNotMet '... 8 vs 4' (an "
        "all-reduce of 4 bytes met one of 8), or the DP ranks hang in a collective (#43547: an "
        "NCCL reduce_scatter deadlock after about an hour, ray/mp backends)"
    ),
    root_cause=(
        "execute_model returns its empty output when the rank has zero scheduled tokens, "
        "before coordinate_batch_across_dp, the all-reduce every DP rank must join each step"
    ),
    trigger=(
        "two DP ranks, a step where one has tokens and the other none while its requests "
        "are unfinished (either rank idle)"
    ),
    fix_parts=(PART,),
    buggy_outcome=MISMATCH,
    scenarios=(
        Scenario(
            "zero_token_rank_steps",
            (Expect(frozenset({PART}), MISMATCH),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "one DP rank idle, its peer busy",
                    "one DP rank idle, its peer drafting",
                    "every DP rank idle at once",
                    "a DP rank with nothing unfinished, its peer busy",
                ),
            ),
            signature=r"step \d+: rank \d all_reduce\(dp, \(2,\), int32\) vs rank \d nothing",
            ranks=2,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: ranks (a data-parallel world of two workers, each with its own "
        "batch, a step with none); a program drives one worker"
    ),
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.execute_model: before the "
            "early return of EMPTY_MODEL_RUNNER_OUTPUT when num_scheduled_tokens is 0, a "
            "_dummy_run(1) when data_parallel_size > 1 (#28774 gated it on the external "
            "launcher too; #44601 drops that gate); _dummy_run goes through "
            "coordinate_batch_across_dp (vllm/v1/worker/dp_utils.py)",
        ),
    ),
    history=(
        "Verified upstream (search, issues corpus): #28774 (merged; opened 2025-11-15) added "
        "the dummy run before the early return, for the external launcher with DP > 1; "
        "#29433 (merged, 2025-11-25) pads that dummy run's size (all DP ranks idle at once "
        "under async scheduling padded to 1, not the sequence-parallel size); #29996 (merged, "
        "2025-12-03) adds an env switch for synchronous grammar compilation, another source of "
        "zero-token steps that desynchronized the ranks; issue #43547 (2026-05-25: ray/mp DP "
        "backends still return early, an NCCL reduce_scatter deadlock) and its fixes #44601 "
        "(open), #51984 (closed), #53578 (open) widen the gate to every DP backend. The brief "
        "that started this record called #44601 a Model Runner V2 port gap: its description "
        "is about the V1 runner's backend gate (not verified: Model Runner V2's own path). "
        "With speculative decoding the dummy run is also the idle rank's stand-in for the "
        "drafter (upstream _dummy_run calls drafter.dummy_run whatever its token count), so "
        "the scenario's runner has a drafter and an idle rank beside a drafting peer joins its "
        "draft steps' agreements too. Relatives in this catalogue: partial_wake_forward (an "
        "idle DP rank's dummy batch while asleep); dp_drafter_boundary_hang (a rank past the "
        "drafter's limit beside a drafting peer)."
    ),
)
