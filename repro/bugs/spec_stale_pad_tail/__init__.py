"""spec_stale_pad_tail (vLLM #39773): the draft prefill's padded rows gather stale indices.

Model Runner V2's speculator keeps a persistent last_token_indices buffer: before the draft
prefill it writes the index of each live request's last token, then the prefill gathers the
hidden states at those indices. A FULL prefill graph is captured for a padded number of
requests and gathers that many entries at every replay; nothing wrote the entries past the
live requests, so after a step with more requests they hold that step's indices, past the
end of a smaller step's hidden states: the gather goes out of bounds. The fix pads the
buffer past the live requests (index 0) every step. Run alone:
`python -m repro.bugs.spec_stale_pad_tail`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.SPEC_PAD_LAST_TOKEN_INDICES
# the gather's bounds check: index_select's kernel asserts on the GPU (as aten's indexing of
# upstream's gather does); on the CPU it raises "index out of range in self"
ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "the draft is the identity model sharing the LM head and its prefill gather sits in the "
        "target's FULL graph (upstream: the speculator's own prefill graph); only issue 1 of "
        "#39773 is modelled"
    ),
    evidence=(
        "#39773's description (last_token_indices not padded before prefill, stale values, an "
        "out-of-bounds gather)"
    ),
    not_verified="the diff (the pad-with-0 fix follows later code)",
)

RECORD = BugRecord(
    id="spec_stale_pad_tail",
    title="A speculator's padded draft prefill gathers stale last-token indices",
    upstream="https://github.com/vllm-project/vllm/pull/39773",
    symptom=(
        "speculative decoding with CUDA graphs in Model Runner V2 fails with an out-of-bounds "
        "gather in the speculator's prefill after a larger batch"
    ),
    root_cause=(
        "last_token_indices was not padded before the draft prefill: a graph captured for a "
        "padded number of requests gathers the entries past the live ones, which keep the "
        "indices of an earlier, larger step"
    ),
    trigger=(
        "a step with more requests (and tokens), then a step with fewer requests that replays "
        "a FULL prefill graph of a padded size"
    ),
    fix_parts=(PART,),
    buggy_outcome=ASSERT,
    scenarios=(
        Scenario(
            "fewer_requests_after_larger_batch",
            (Expect(frozenset({PART}), ASSERT),),
            axes=Axes(
                graph_modes=("FULL",),
                capture_sizes=(4,),
                steps_per_size=2,
                # step 2: 1 token in the graph of 4; step 4: 4 tokens of 2 requests in it
                states=(
                    "padded by tokens",
                    "padded by requests only",
                    "one draft",
                    "a dummy run after a larger step",
                ),
            ),
            cpu_signature=r"index out of range[\s\S]*harness/runner/cudagraph\.py:\d+ in replay\b",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py: "
            "_prepare_prefill_inputs_kernel (prepare_prefill_inputs, called by propose before "
            "the prefill) writes last_token_indices per live request and, in its last "
            "program, pads last_token_indices[num_reqs:max_num_reqs] with 0 for CUDA graphs; "
            "the eagle speculator's prefill gathers last_hidden_states[last_token_indices] "
            "(vllm/v1/worker/gpu/spec_decode/eagle/speculator.py)",
        ),
    ),
    history=(
        "Verified with search and read_file (2026-11): #39773 (merged; opened 2026-04-14, "
        "'[Model Runner V2] Disable piecewise cudagraph mode fallback for eagle draft "
        "decodes') names two issues: last_token_indices not padded before the prefill, so "
        "stale values from previous runs caused out-of-bounds errors in a gather op (this "
        "bug), and eagle draft decodes running PIECEWISE, where FlashInfer's decode metadata "
        "expects num_tokens == num_reqs (not modelled). Its diff was not read line by line: "
        "the fix is modelled on today's prepare_prefill_inputs kernel, which pads the tail "
        "with 0 every step. Stored copies also show the speculator's capture() zeroing "
        "last_token_indices and idx_mapping before capture (stale values from dummy runs); a "
        "capture-time reset alone is not the fix: the stale tail comes from the previous "
        "*step*, a buffer made at start-up, not from a capture's poison. Relatives: #47066 "
        "(merged: idx_mapping padded with -1 past num_reqs, skipped in sampling), #47596 "
        "(open, for issue #47561: zero every speculator buffer before capture), #48261 "
        "(spec_capture_state's next layer). Modelled: the draft model is the identity and "
        "shares the target's LM head; its prefill gather is part of the target's FULL graph "
        "(upstream: the speculator's own FULL prefill graph, dispatched for the same batch); "
        "eager and PIECEWISE steps gather the live requests only, as upstream's. Outcome: a "
        "stale index is an earlier step's token position, a few rows past the hidden states: "
        "an unchecked load would read it silently on a GPU (no fault inside the allocator's "
        "segment); upstream's gather is aten indexing, whose bounds assert fires, and this "
        "gather (index_select) shows the same class on both devices: a device-side assert. "
        "The graph pads a step by tokens, by requests or both: the scenario replays one padded "
        "by both (1 token, 1 request) and one padded by requests alone (4 tokens, 2 requests: "
        "no padding token), so that a padding tied to the token padding fails too. A dummy run of "
        "1 token after the first step (eager) gathers entry 0, which its own preparation must "
        "set: a runner that skips preparing dummy batches fails there the same way."
    ),
)
