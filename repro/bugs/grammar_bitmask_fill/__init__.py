"""grammar_bitmask_fill (vLLM #22896, #22963; vllm-gaudi #1199, #1200): the worker's grammar
bitmask forbids every token of the requests without a grammar.

Structured outputs: the scheduler sends one packed bitmask row per guided request, in its own
order; the worker reorders them into a mask of the batch's rows and masks the logits before
sampling. After #21862 moved that reordering, the batch-sized mask was created full of zeros
(every token forbidden) and the rows applied were counted from the mask's length, not from the
guided requests' indices: in a batch that mixes guided and free requests, the free requests'
logits became all -inf (softmax NaN). Fixed upstream by filling the mask with -1 (every token
allowed) and counting the guided rows. Run alone: `python -m repro.bugs.grammar_bitmask_fill`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

FILL, COUNT = Fix.GRAMMAR_NEUTRAL_FILL, Fix.GRAMMAR_GUIDED_ROW_COUNT
# all -inf rows: the runner's greedy sampler picks token 0, no fault, on both devices
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#22963's description (the number of bitmasks derived from the pre-initialized sorted "
        "mask instead of the indices requiring masking; non-structured requests masked, their "
        "logits NaN, an illegal memory access in sampling); vllm-gaudi #1199 and #1200's "
        "descriptions (the same two defects diverged from upstream: the sorted mask "
        "initialized with zeros, rows of non-structured requests blocking every token so the "
        "sampler emits '!' repeatedly; the skip-indices check on the mask's rows, always the "
        "logits' rows, so the mask applied to every row; fixed by fill -1 and len(out_indices));"
        " the current vllm/v1/structured_output/utils.py apply_grammar_bitmask (np.full with "
        "-1, out_indices, skip_out_indices = len(out_indices) == logits rows); #32102 (Model "
        "Runner V2's Triton apply kernel over logits indices)"
    ),
    not_verified=(
        "#22896 and #21862 themselves (not found by search: #22896 as the neutral fill and "
        "#21862 as the regression's origin are the brief's survey and the Gaudi PRs' "
        "'diverged from upstream'); #31332 (not found: its relation is unknown); the diffs"
    ),
    what=(
        "upstream's two defects corrupt a free row only together (a zero row harms only when "
        "applied; applying every row harms only a zero row); here the apply kernel always "
        "masks every row (xgrammar's aligned path, indices None), so the neutral fill is "
        "needed on its own, and the count defect is modelled in the scatter: rows past the "
        "scheduler's are copied from persistent staging buffers (stale or as allocated), so "
        "it is needed on its own too. The sampler is greedy argmax (token 0 for an all -inf "
        "row), not a sampling kernel: no fault"
    ),
)

RECORD = BugRecord(
    id="grammar_bitmask_fill",
    title="A batch-sized grammar bitmask forbids every token of the requests without a grammar",
    upstream="https://github.com/vllm-project/vllm/pull/22963",
    symptom=(
        "requests without structured output batched with guided ones (tool calls, plain text "
        "beside json_schema requests) produce garbage: the same token repeated ('!', token 0, "
        "vllm-gaudi #1199) or NaN logits that crash sampling with an illegal memory access "
        "(#22963)"
    ),
    root_cause=(
        "the worker's reordered bitmask (one row per logits row) was created with zeros, "
        "forbidding every token in the rows no guided request fills, and the rows applied "
        "were counted from that mask's length rather than from the guided requests' indices"
    ),
    trigger=(
        "a batch with at least one guided and one free request (a guided request alone, or "
        "every row guided, is unaffected); any order"
    ),
    fix_parts=(FILL, COUNT),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "guided_and_free_rows",
            (Expect(frozenset({FILL, COUNT}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "guided and free rows in one batch",
                    "guided rows after free rows",
                    "every row guided",
                    "the scheduler's order unlike the batch's",
                    "one guided row",
                    "three guided rows",
                    "a request guided, then free in the same mask",
                ),
            ),
            signature="forbidden tokens \\(-inf\\) vs the grammar's: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            FILL,
            "vllm/v1/structured_output/utils.py apply_grammar_bitmask: the reordered mask is "
            "np.full(..., fill_value=-1) of the logits' rows (earlier in the runner, "
            "gpu_model_runner.py); vllm-gaudi's hpu_model_runner.py apply_grammar_bitmask "
            "(#1199, #1200)",
        ),
        (
            COUNT,
            "vllm/v1/structured_output/utils.py apply_grammar_bitmask: skip_out_indices is "
            "len(out_indices) == logits.shape[0], so the kernel gets the guided rows' indices "
            "unless every row is guided (#22963); Model Runner V2 applies through logits "
            "indices in a Triton kernel (#32102)",
        ),
    ),
    history=(
        "Verified with search (2026-11), from PR descriptions and the current upstream file, "
        "not the diffs: #22963 '[Structured Outputs] [Bug] Fix misalignment in "
        "apply_grammar_bitmask causing unintended masking and NaN logits' (merged, opened "
        "2025-08-15): the count of bitmask rows came from the pre-initialized sorted mask, "
        "not from the indices; non-structured requests were masked and their NaN logits led "
        "to illegal memory accesses (a tester still met one on the branch, in sampling). "
        "vllm-gaudi #1199 and #1200 (merged, 2026-03-19): the zero fill and the skip check "
        "on the mask's rows diverged from upstream in the HPU runner (#1199 also passed a "
        "tensor where xgrammar's CPU path wants a list). Relatives: #29821 (async scheduling "
        "+ spec decode + structured outputs: -1 padded drafts, per-request invalid counts), "
        "#44292 and #54442 (rows after a -1 draft filled unconstrained), #49738 (bitmask "
        "offsets after draft trimming), #50952 (missing draft rows), vllm-tt-plugin #59 (an "
        "unmatched row silently unconstrained: the neutral fill's other face). Not found: "
        "#22896, #21862, #31332."
    ),
)
