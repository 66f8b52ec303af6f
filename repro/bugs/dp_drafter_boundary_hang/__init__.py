"""dp_drafter_boundary_hang (vLLM #44185, #40589, #44954): near max_model_len one data-parallel
rank skips the drafter's collectives while its peer drafts.

Under data parallelism with speculative decoding, each rank decides on its own batch whether it
can take drafts (its longest sequence plus the drafts within the drafter's max_model_len;
upstream: _input_fits_in_drafter). The drafter's forward agrees with the other DP ranks on its
batch (and a MoE drafter exchanges tokens across them), so a rank whose request nears
max_model_len and skips the drafter leaves its peers waiting in the drafter's collectives while
it goes on to its next step: a hang. The fix: a rank that skips still runs the drafter's dummy
steps, as an idle rank's dummy run does. Runs as two rank processes (Scenario.ranks):
`python -m repro.bugs.dp_drafter_boundary_hang`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

MISMATCH = ByDevice.both(Outcome.COLLECTIVE_MISMATCH)
PART = Fix.DP_DRAFTER_DUMMY_RUN

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues and code corpora).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#44185's description (open: DP 2 with expert parallelism, MTP with 3 speculative "
        "tokens, max_model_len 2048, a request whose length nears max_model_len; the server "
        "hangs after the response, 'No available shared memory broadcast block found' on both "
        "DP engine cores); #44954's description (open, fixes #44185: applies the vllm-ascend "
        "fix to the main path; DP + EP + MTP, enforce-eager); #40589's description and the "
        "start of its review hunk (merged: a drafter dummy_run when a DP rank skips proposing "
        "because max_seq_len + num_spec_tokens > max_model_len while other DP ranks run the "
        "drafter; DeepSeek-R1, dp 4 tp 2 mtp 3, max_model_len 4100); vllm-ascend #16512/#16514 "
        "(merged: the host-side check, empty drafts, the one-token dummy path for model-backed "
        "proposers when DP > 1, none for DP 1 or non-model proposers); #29422 (closed: the "
        "check diverges DP ranks with different max sequence lengths; proposed running the "
        "drafter unconditionally); #45963's description (merged: the rank-local gate and the "
        "drafter's K-dependent DP collectives); upstream runner copies in the code corpus "
        "(input_fits_in_drafter = max_seq_len + num_spec_tokens <= the drafter's max_model_len; "
        "_dummy_run calls drafter.dummy_run(num_tokens) for EAGLE-style proposers)"
    ),
    not_verified=(
        "#44954's and #40589's diffs line by line (descriptions and one review hunk's start "
        "were read); why #44185 still hangs after #40589 merged (which path #40589's dummy "
        "run misses: the MoE drafter's EP collectives, another proposer path, or async "
        "scheduling); Model Runner V2's speculator"
    ),
    what=(
        "the drafter is the target's embedding and LM head chained greedily (no draft model, "
        "no verification or rejection); its collectives are one all-reduce per draft step of "
        "each DP rank's draft batch (tokens, requests), standing for the drafter forward's DP "
        "padding agreement and a MoE drafter's expert exchange; the drafter's max_model_len "
        "is the target's; the fix is #40589's (a dummy drafter run on the rank that skips); "
        "the buggy outcome is the harness's trace oracle (collective_mismatch), where upstream "
        "hangs"
    ),
)

RECORD = BugRecord(
    id="dp_drafter_boundary_hang",
    title="Near max_model_len one DP rank skips the drafter's collectives while its peer drafts",
    upstream="https://github.com/vllm-project/vllm/issues/44185",
    symptom=(
        "with DP > 1 (and EP) and MTP speculative decoding, a request whose length nears "
        "max_model_len completes, then the DP engine cores hang: 'No available shared memory "
        "broadcast block found in 60 seconds' repeated (#44185, #40589)"
    ),
    root_cause=(
        "each DP rank decides alone whether its batch fits the drafter (longest sequence + "
        "num_speculative_tokens <= the drafter's max_model_len) and skips the drafter when it "
        "does not, while its peers run the drafter, whose forward joins collectives across the "
        "DP ranks"
    ),
    trigger=(
        "two DP ranks drafting; one rank's request reaches max_model_len - k while the other's "
        "does not (either rank first; or a long prompt is past it at its first step)"
    ),
    fix_parts=(PART,),
    buggy_outcome=MISMATCH,
    scenarios=(
        Scenario(
            "drafter_at_the_boundary",
            (Expect(frozenset({PART}), MISMATCH),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "one DP rank past the drafter's limit, its peer drafting",
                    "a DP rank past the drafter's limit at its first step",
                    "every DP rank past the drafter's limit at once",
                    "one DP rank idle, its peer busy",
                ),
            ),
            signature=r"step \d+: rank \d all_reduce\(dp, \(2, 2\), int32\) vs rank \d nothing",
            ranks=2,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: ranks (a data-parallel world of two workers, each with its own "
        "batch) and a drafter (num_speculative_tokens) whose requests run to max_model_len; "
        "a program drives one worker"
    ),
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py, sample_tokens: input_fits_in_drafter "
            "(max_seq_len + num_spec_tokens <= effective_drafter_max_model_len); when it is "
            "False and data_parallel_size > 1, drafter.dummy_run so the rank joins the "
            "drafting ranks' collectives (#40589; #44954 for #44185; vllm-ascend "
            "model_runner_v1.py, #16512 and its backports #16513/#16514/#16964)",
        ),
    ),
    history=(
        "Verified upstream (search, issues corpus): issue #44185 (open, 2026-05-28 logs: "
        "Qwen3.5-35B-A3B, DP 2, EP, MTP 3, a request near max_model_len 2048 hangs the DP "
        "engine cores); #44954 (open, 2026-06-09: fixes #44185 on the main path, as "
        "vllm-ascend did); #40589 (merged, opened 2026-04-22: the drafter dummy run when a DP "
        "rank skips proposing, DeepSeek-R1 dp 4 tp 2 mtp 3); #27837 (closed, 2025-10: every "
        "rank must agree to run the drafter, for #27691) and #29422 (closed: run the drafter "
        "unconditionally, clamping its max_model_len) took other routes; #45963 (merged: "
        "dynamic speculative decoding off under DP, K-dependent collectives); vllm-ascend "
        "#16512 (merged) and backports #16513, #16514, #16713, #16964 (merged); #49027 (open: "
        "the same gate diverging across TP ranks). A long prompt can be past the drafter's "
        "limit from its first step (#24662: inputs longer than the drafter's length but not "
        "the target's), so the scenario also puts one rank past it at step 0, before any draft "
        "agreement, while its peer drafts. Relatives in this catalogue: "
        "dp_zero_token_skip (an idle DP rank's dummy step; here a rank idle at the last step "
        "runs the drafter's dummy too)."
    ),
)
