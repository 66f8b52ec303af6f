"""async_placeholder_leak (vLLM #26385; reported as #40768, closed, issue #37159): a -1
placeholder reaches the embedding when a request with no previous-step row is scheduled under
async scheduling.

With a scheduler one step ahead, the worker stamps -1 where each sampled token goes in a
request's token row and fills the step's input ids on the device from the previous step's
sampled tokens, through the request's row in that step. A request that was not in the previous
step (resumed after a preemption, or skipped by the token budget) has no such row: the overwrite
is skipped and its -1 tokens reach the embedding's gather, a device-side assert. The fix fills
those rows from the host's tokens.
Run alone: `python -m repro.bugs.async_placeholder_leak`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.ASYNC_PLACEHOLDER_HOST_FILL
# the embedding's gather: a device-side assert on the GPU, "index out of range in self" on the CPU
ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)

# the signature on the CPU: the embedding's gather of a -1 placeholder
SIGNATURE = r"index out of range[\s\S]*harness/runner/model\.py:\d+ in _embed_base\b"

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "sampled-token placeholders only (no draft tokens); the device-side assert on this path "
        "is inferred: #26385 names no symptom; the assert is what the spec-decode variant "
        "reported (#40768, closed; #44734)"
    ),
    evidence=(
        "#26385's description (merged: refresh the runner with all token ids after preemption so "
        "the right input ids are used) and its diff excerpt (the resumed-request branch); #27756;"
        " #40768 (closed, not merged, spec-decode placeholders)"
    ),
    not_verified="issue #37159; #26385's symptom",
)

RECORD = BugRecord(
    id="async_placeholder_leak",
    title="Async scheduling: a resumed request's -1 placeholders reach the embedding",
    upstream="https://github.com/vllm-project/vllm/pull/26385",
    symptom=(
        "CUDA error: device-side assert triggered (vectorized_gather_kernel: ind >= 0, or "
        "IndexKernel's index-out-of-bounds assertion) in the embedding, with async scheduling "
        "(and speculative decoding: EAGLE, MTP) under preemption or a full token budget; the "
        "engine dies (EngineDeadError)"
    ),
    root_cause=(
        "the worker's token rows hold -1 (PLACEHOLDER) where a sampled or draft token is still on "
        "the device; _prepare_input_ids overwrites them from the previous step's tokens through "
        "prev_req_id_to_index, and skips a request whose previous index is < 0 (new, resumed "
        "after preemption, or not scheduled last step): its -1 survives into input_ids"
    ),
    trigger=(
        "a scheduler one step ahead; a request preempted (its blocks needed) while its step is "
        "in flight, resumed later by prefilling its tokens again in a step whose previous one "
        "did not hold it"
    ),
    fix_parts=(PART,),
    buggy_outcome=ASSERT,
    scenarios=(
        Scenario(
            "resumed_after_preemption",
            (Expect(frozenset({PART}), ASSERT),),
            axes=Axes(
                graph_modes=("NONE",),
                # B (then C) preempted with its step in flight, prefilled again from position 0;
                # then B skipped by the token budget for a step, scheduled again at position 2
                # beside A's decodes of two drafts
                states=(
                    "resumed after preemption",
                    "resumed at a later position",
                    "two steps in flight",
                    "several drafts",
                    "a step that schedules nothing",
                ),
            ),
            cpu_signature=SIGNATURE,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz="",
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py: _prepare_input_ids scatters "
            "prev_sampled_token_ids (and the previous step's draft tokens) into input_ids for "
            "requests found in input_batch.prev_req_id_to_index, and continues past one whose "
            "previous index is < 0; vllm/v1/core/sched/async_scheduler.py: "
            "_update_after_schedule stamps the placeholders (output placeholders, spec_token_ids "
            "[-1, ...]); here: harness/runner/async_inputs.py TokenRows.prepare",
        ),
    ),
    history=(
        "Verified with search (2026-11): #40768 (closed, for issue #37159) describes -1 "
        "placeholder tokens leaking into input_ids for a request not present in the previous "
        "worker batch (newly scheduled, or re-added after preemption): the overwrite loop in "
        "_prepare_input_ids continues when prev_index < 0, and the embedding asserts "
        "(vectorized_gather_kernel: ind >= 0); its fix touched request.py, async_scheduler.py "
        "and scheduler.py. #37629 (closed, for issue #36906) is the same leak through stale "
        "spec_token_ids placeholders of requests the budget skipped (EAGLE3, F.embedding); "
        "#46899 (closed) clears stale async speculative placeholders; #43434 (closed) carries "
        "the previous step's draft tokens through InputBatch, as the sampled ones are; issue "
        "#44734 (open; Qwen3.6 NVFP4 + MTP device-side assert) is attributed to the same -1 "
        "placeholder in its thread. #26385 (merged) refreshes the model runner with all of a "
        "resumed request's token ids after a preemption (the host-token fill modelled here), "
        "#28787 (merged) keeps all_token_ids to recover outputs after preemption, #42347 "
        "(merged) explains that the worker's token rows count -1 placeholders whose real value "
        "is patched into the GPU input_ids only. Not verified: issue #37159 itself, and the "
        "diffs line by line; no merged fix of the draft-token variant was found. Modelled: "
        "placeholders of sampled tokens only (no draft tokens); the worker's rows never learn a "
        "sampled token on the host, so a resumed request's whole re-prefill is placeholders "
        "past its prompt; the fix takes the scheduler's (host) tokens for a request with no "
        "previous-step row. The skip: the scheduler's token budget (upstream: "
        "max_num_scheduled_tokens) skips a running request whose decode does not fit what the "
        "requests before it left (with drafts, a decode launched on one in flight takes 1 + "
        "num_spec_tokens); it is scheduled again at its count, past position 0 (the budget "
        "skip of #37629, here with the sampled token's placeholder). On the GPU the assert "
        "surfaces at the next host sync (the step's "
        "sampled tokens read by the engine): device_assert on both devices."
    ),
)
