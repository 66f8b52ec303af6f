"""async_pinned_race (vLLM #24527, then #25279): under async scheduling, step N's non-blocking
upload reads a reused pinned host tensor that step N+1's host update already rewrote.

With async scheduling the host returns from a step before the device ran it and prepares the
next one meanwhile. The runner keeps per-request state in host tensors it reuses every step
(upstream V1: the input batch's CPU tensors, sampling parameters among them, pinned for
non-blocking copies) and uploads them with non-blocking copies; a copy that has not run yet
when the next step's update rewrites its source uploads the next step's values. Here the
tensor is the allowed-token-ids mask, uploaded on the copy stream (`async_output.py`): step N
samples under step N+1's mask rows. The fix part makes the host wait for the last upload before
it rewrites the tensor (upstream: `prepare_inputs_event`). Run alone: `python -m
repro.bugs.async_pinned_race`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
PART = Fix.ASYNC_PINNED_REUSE_WAIT

# the signature: step 0 sampled under another step's mask rows
SIGNATURE = r"step 0 tokens of A \(allowed .*\), B: \d+/\d+ differ"

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "the stream model forces the losing order on a copy stream, and the project chose the "
        "allowed-token-ids mask as the victim; the wrong tokens are inferred: upstream reported "
        "none (#24527: 'unlikely to cause a problem in practice')"
    ),
    evidence=(
        "#25279's description (reused CPU tensors modified and copied async from _update_states, "
        "sampling tensors); #24527's description; #32799"
    ),
    not_verified="the diffs",
)

RECORD = BugRecord(
    id="async_pinned_race",
    title="Async scheduling: a step's upload reads a reused pinned tensor the next step rewrote",
    upstream="https://github.com/vllm-project/vllm/pull/25279",
    symptom=(
        "with --async-scheduling, a step's sampling (or inputs) silently uses the next step's "
        "values of reused host tensors: here a request with allowed_token_ids samples a token "
        "it is not allowed; no error"
    ),
    root_cause=(
        "a reused (pinned) host tensor is copied to the device with a non-blocking copy each "
        "step; the host, a step ahead, rewrites it in the next step's state update before the "
        "copy has read it: nothing orders the host's write after the device's read"
    ),
    trigger=(
        "async scheduling (the host prepares step N+1 while step N is in flight), a reused "
        "host tensor that step N uploads (the allowed-token-ids mask of a restricted request) "
        "and step N+1 rewrites, the copy later than the host's update (a device behind the "
        "host: the copy stream's delay)"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "restricted_step_then_next_update",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                # 1 launched on 0 (both restricted: A, D), 2 launched on 0 and 1
                states=(
                    "two steps in flight",
                    "three steps in flight",
                    "two restricted steps in flight",
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
            "vllm/v1/worker/gpu_model_runner.py, execute_model: the synchronized section around "
            "the state update and input preparation (prepare_inputs_event synchronized before "
            "the reused CPU tensors are modified, recorded after their copies; #24527 added it, "
            "#25279 widened it over _update_states and made it a context manager, "
            "synchronize_input_prep); Model Runner V2 (vllm/v1/worker/gpu/) avoids pinning "
            "reused buffers instead (#32799)",
        ),
    ),
    history=(
        "Verified upstream (search, 2026-11): #24527 (merged; opened 2025-09-09, a follow-on of "
        "#23569, async scheduling's full overlap) added the missing synchronization for the "
        "reused CPU tensors, its review proposing multiple host buffers should the event ever "
        "block; #25279 (merged, 'take 2') widened it because the sampling tensors are modified "
        "and copied from _update_states; relatives on the same contract: #28706 and #31373 "
        "(multimodal _preprocess inside the section, lost once and re-fixed), #31841 (double "
        "buffering of the multimodal is_mm_embed tensor), #29288 (open: the EAGLE proposer's "
        "reused CPU buffer), #32799 (Model Runner V2 does not pin reused FlashInfer tensors, "
        "having no explicit synchronization), #54269 (open: MRV2 port of prepare_inputs_event). "
        "Not verified: #36013 (the reverse, a host read of a pinned device-to-host destination "
        "before the copy lands: not found by search); the diffs line by line; which tensor "
        "first showed the race in production (the PRs name sampling tensors generically). "
        "Modelled: the allowed-token-ids mask (upstream: allowed_token_ids_mask_cpu_tensor) "
        "uploaded on the copy stream (as MRV2's grammar bitmask is, #33059; upstream V1 copies "
        "on the main stream: the same order once the device is behind the host). The losing "
        "order is made certain by the stream model (harness/runner/streams.py): on both "
        "devices the copy stream's work reaches the device only when an event after it is "
        "synchronized (a spin kernel on the copy stream was not certain: CUDA's lazy module "
        "loading held the host until the spin ran out). Detectors (predicted, "
        "the lead measures): compute-sanitizer cannot see it (racecheck sees shared memory "
        "only; the memory is initialized and in bounds); PyTorch's stream sanitizer tracks "
        "device tensors between streams, not the host's write to pinned memory: not flagged."
    ),
)
