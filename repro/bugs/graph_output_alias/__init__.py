"""graph_output_alias (vLLM #53520, open; issue #53488): a padded drafter's graph replay
overwrites the target's graph outputs before prompt logprobs read them.

Every CUDA graph is captured into one shared pool, and a graph's outputs are kept as weak
references: once captured their memory is free in the pool, and the next graph captured
into it (the drafter's) is handed the same memory. The V1 runner samples from the target's
logits, runs the padded GPU drafter (its graph replay writes its outputs there), and only
then, in bookkeeping, computes prompt logprobs from the target's hidden states: the drafter's
numbers. Generation is unaffected (the logits were consumed first), and steps past the
capture size (eager outputs) are right. The fix part copies the target's outputs out of the
pool before the drafter replays. Run alone: `python -m repro.bugs.graph_output_alias`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
PART = Fix.GRAPH_OUTPUT_COPY_BEFORE_DRAFT


def _axes(mode: str) -> Axes:
    return Axes(
        graph_modes=(mode,),
        capture_sizes=(8,),
        steps_per_size=2,
        # the prefill: 8 tokens of 2 requests in the graph of 8 (4 requests); the decode: 2
        # tokens in it; the drafter proposes one token a request; both replayed with prompt
        # logprobs on, then on a second runner with them off
        states=(
            "padded by requests only",
            "padded by tokens",
            "prompt logprobs on",
            "prompt logprobs off",
            "one draft",
        ),
    )


# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what="the shared graph pool is an arena the runner builds, not the caching allocator's reuse",
    evidence=(
        "#53520's description (target forward, sample, padded drafter forward, then prompt "
        "logprobs; all CUDA graphs share one pool; PIECEWISE prompts corrupted); issue #53488"
    ),
    not_verified="the diff; PIECEWISE against FULL drafter graphs",
)

RECORD = BugRecord(
    id="graph_output_alias",
    title="Padded drafter's graph replay overwrites the target's graph outputs",
    upstream="https://github.com/vllm-project/vllm/pull/53520",
    symptom=(
        "prompt_logprobs silently corrupted with speculative decoding (MTP) for prompts within "
        "the CUDA-graph capture size; larger prompts (eager) and generation are right "
        "(issue #53488)"
    ),
    root_cause=(
        "graph outputs live in the one shared graph pool as weak references; the padded "
        "drafter's graph, captured into the same pool, replays before bookkeeping computes "
        "prompt logprobs from the target's hidden states and writes its outputs over them"
    ),
    trigger=(
        "speculative decoding with a padded drafter that replays graphs, prompt logprobs, a "
        "step replayed from a graph (a prompt within the capture size)"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "piecewise_prefill_then_drafter",
            (Expect(frozenset({PART}), WRONG),),
            axes=_axes("PIECEWISE"),
            signature="hidden states vs reference: \\d+/\\d+ differ",
        ),
        Scenario(
            "full_graph_then_drafter",
            (Expect(frozenset({PART}), WRONG),),
            axes=_axes("FULL"),
            signature="hidden states vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py, execute_model and sample_tokens: the padded "
            "drafter (propose_draft_token_ids) runs before _bookkeeping_sync, whose "
            "_get_prompt_logprobs_dict reads the target's hidden_states (PR #53520's account; "
            "its diff not read); the outputs as weak references in the shared pool: "
            "vllm/compilation (weak_ref_tensor, vLLM #9724)",
        ),
    ),
    history=(
        "Verified upstream (search, 2026-11): PR #53520 (open) names the order (target "
        "forward, sample, padded drafter forward, bookkeeping's prompt logprobs), the shared "
        "global pool and the boundary at the capture limit (PIECEWISE prompts corrupted, "
        "eager ones clean, generation unaffected); issue #53488 (open; Qwen3.5-family MTP, "
        "chunked prefill) with the reporters' sweeps (the boundary follows "
        "max_cudagraph_capture_size); #9724 (merged) made graph outputs weak references in a "
        "shared pool. Not verified: #53520's diff (here the fix copies the hidden states "
        "before the drafter; consuming them first is the same contract) and whether the "
        "drafter's graphs were PIECEWISE or FULL in the reports (both modelled). The pool is "
        "modelled by construction (cudagraph.GraphPool: every graph's outputs laid from the "
        "start of one arena), not by the caching allocator's reuse. Relatives: sglang #35546 "
        "(draft-extend outputs cloned out of the graph buffer), sglang #29779 and sfllm #44 "
        "(one logits buffer shared by every graph runner, by design)."
    ),
)
