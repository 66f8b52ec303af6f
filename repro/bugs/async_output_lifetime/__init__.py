"""async_output_lifetime (vLLM #29623, Model Runner V2): a step's sampled token ids are freed
while their device-to-host copy on the copy stream has yet to read them.

Under async scheduling a step's output is an AsyncOutput: the sampled token ids, computed on
the main stream, are downloaded on a copy stream, and the host reads them later, after issuing
the next step. If nothing keeps the device tensor alive, its last Python reference dies when
the step returns; the caching allocator, which knows of uses on the allocating stream only,
hands its block to the next step's sampling, which writes its own tokens there before the copy
stream reads: a step reports the next step's tokens. The fix part keeps the references in the
AsyncOutput until the copy's event completes (upstream's alternative: `record_stream`). Run
alone: `python -m repro.bugs.async_output_lifetime`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
PART = Fix.ASYNC_OUTPUT_KEEP_REF

# the signature: step 0 read another step's tokens
SIGNATURE = r"step 0 tokens of A, B: \d+/\d+ differ"

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "an arena makes the reuse certain and the stream model forces the order; the wrong tokens"
        " are inferred: #29623's description is a thank-you and reports no symptom"
    ),
    evidence=(
        "#29623's description; #25266's review (AsyncOutput keeps references because the copies "
        "run on another stream)"
    ),
    not_verified="the diff; any user report",
)

RECORD = BugRecord(
    id="async_output_lifetime",
    title="Async output: sampled tokens freed before their copy-stream download reads them",
    upstream="https://github.com/vllm-project/vllm/pull/29623",
    symptom=(
        "with async scheduling in Model Runner V2, a step's sampled tokens can be another "
        "step's: silently wrong outputs, no error (a race on the device-to-host copy)"
    ),
    root_cause=(
        "the sampled token ids are copied to the host on a side stream while their last Python "
        "reference dies when the step returns; the caching allocator reuses the block for the "
        "next step's allocation on the main stream, whose kernels write it before the side "
        "stream's copy reads it"
    ),
    trigger=(
        "async scheduling with two steps in flight (the next step issued before the last one's "
        "tokens are read), the device-to-host copy on the copy stream later than the next "
        "step's sampling (the copy stream's delay), a next allocation of the same size"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "steps_in_flight_back_to_back",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                # 1 launched on 0; 3 launched on 1 and 2; the walk once with each stream late
                states=(
                    "two steps in flight",
                    "three steps in flight",
                    "copy stream late",
                    "main stream late",
                ),
            ),
            signature=SIGNATURE,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu/async_utils.py, AsyncOutput.__init__: the model runner output, "
            "sampler output and num_sampled_tokens kept as attributes while the copies to "
            "numpy run on the copy stream (after copy_stream.wait_stream(main_stream)); "
            "get_output synchronizes the copy event before reading them",
        ),
    ),
    history=(
        "Verified upstream (search and read_file, 2026-11): #29623 (merged; opened 2025-11-27, "
        "'[Model Runner V2][BugFix] Keep reference to GPU tensors in AsyncOutput', crediting "
        "a heads-up on the race); today's async_utils.AsyncOutput keeps the sampler output "
        "with a note that the copies run on another stream than the tensors' own, and records "
        "a blocking copy event that get_output synchronizes. Relatives: #23569's review "
        "(V1's async output copy: record_stream on the copy stream proposed, weighed against "
        "holding the reference for its cost), #31584 (the pooling output's copy moved to a "
        "dedicated stream), #33059 "
        "(MRV2's grammar-bitmask upload on another stream: a tensor allocated on the copy "
        "stream and used on the main one needed a wait), #29288 (open). Not verified: the "
        "diff of #29623 line by line, and any user report of wrong tokens it fixed (the PR "
        "has no description beyond the credit). Modelled: the device memory of the sampled "
        "tokens comes from an arena (harness/runner/async_output.OutputArena) that returns a "
        "slot when the last reference to its tensor dies and hands the slot freed last to the "
        "next take, on both devices: PyTorch's caching allocator would reuse the block too "
        "(same size, same stream, freed just before), but with several free blocks of a size "
        "its choice is by size and address, not by recency, so the arena makes the reuse "
        "certain; the losing order by the stream model (on both devices the copy stream's work "
        "reaches the device only at the host's next wait on it); the scenario walks the same steps "
        "again with the main stream late (the device behind the host: a copy's wait is met "
        "before the main stream's later work reaches the device), the order in which a "
        "download issued before its step's sampling (not after it, as upstream's AsyncOutput "
        "is built once the sampler's work is queued) reads the slot's earlier contents. Detectors "
        "(predicted, the lead measures): compute-sanitizer cannot see it (in-bounds, "
        "initialized memory; racecheck is shared memory only); PyTorch's stream sanitizer "
        "(TORCH_CUDA_SANITIZER=1) should flag the buggy variant (the main stream's write of "
        "the next step's tokens and the copy stream's read of the same address with no event "
        "between them) and not the fixed one (a distinct slot; the download waits for the "
        "main stream)."
    ),
)
