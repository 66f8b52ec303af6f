"""input_batch_swap_alias (vLLM #48419, open): a tuple swap of two tensor rows copies one row.

InputBatch.swap_states swaps the two rows of the allowed-token-ids mask with a tuple assignment
on row views (`m[i1], m[i2] = m[i2], m[i1]`): indexing a tensor by an integer is a view, so the
first write overwrites row i1 with row i2, and the second writes row i2 from the view of row i1,
which already holds row i2 (PyTorch #17008). Both rows end up as row i2. The attention
backends that split decodes from prefills reorder every mixed batch by such swaps, so a request
with allowed_token_ids loses its restriction or inherits another's: a wrong token, no error.
The fix swaps through a copy (list indexing on the right-hand side).
Run alone: `python -m repro.bugs.input_batch_swap_alias`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.INPUT_BATCH_SWAP_COPY
# the mask is a host tensor on both devices (upstream's CPU staging tensor): the same copy
WRONG = ByDevice.both(Outcome.WRONG_RESULT)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#48419's description (a tuple swap of row views collapses both rows; reorder_batch as "
        "the caller; the fix by fancy indexing)"
    ),
    not_verified=(
        "the diff; no field report found: 'wrong output, no error' is the PR's own reasoning"
    ),
)

RECORD = BugRecord(
    id="input_batch_swap_alias",
    title="A tuple swap of two allowed-token-ids mask rows leaves both rows equal",
    upstream="https://github.com/vllm-project/vllm/pull/48419",
    symptom=(
        "a request with SamplingParams.allowed_token_ids samples tokens outside its allowed set "
        "(or a request without one is restricted to another's set) when the batch mixes "
        "decodes and prefills on a backend that reorders them (MLA, Mamba, GDN, FlashInfer); "
        "no error"
    ),
    root_cause=(
        "InputBatch.swap_states swaps allowed_token_ids_mask_cpu_tensor[i1] and [i2] with a "
        "tuple assignment of two row views: the first write overwrites row i1 with row i2, the "
        "second copies the view of row i1, already overwritten, into row i2; both rows become "
        "row i2's (the other per-request tensors are swapped through copies)"
    ),
    trigger=(
        "an attention backend that reorders the batch decodes-first by swaps; a step with a "
        "prefill in a row before a decode, one of the swapped pair restricted by "
        "allowed_token_ids and the other not (or restricted differently)"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "restricted_prefill_behind_decodes",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                # step 2: Q <-> D1 and P <-> D2; step 3: S <-> P
                states=("restricted/unrestricted swap", "restricted/restricted swap"),
            ),
            signature="disallowed tokens of rows .*: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_input_batch.py: InputBatch.swap_states swaps the rows of "
            "allowed_token_ids_mask_cpu_tensor (the host staging tensor that "
            "_make_sampling_metadata copies to the device every step); called by "
            "reorder_batch_to_split_decodes_and_prefills in vllm/v1/attention/backends/"
            "utils.py, which swaps the i-th prefill from the front with the i-th decode from "
            "the back; #48419 swaps the rows with list indexing, which copies the right-hand side",
        ),
    ),
    history=(
        "Verified with search and find_string (2026-11): PR #48419 (open, 2026-07) describes "
        "the tuple assignment on row views in InputBatch.swap_states, both rows collapsing to "
        "row i2's contents, reorder_batch (vllm/v1/attention/backends/utils.py) on the MLA / "
        "Mamba / GDN / FlashInfer decode-prefill split as the caller, and a fix by list "
        "indexing (as the is_token_ids swap beside it does); only the CPU staging tensor needs "
        "the swap. Stored copies of gpu_input_batch.py (several versions and forks) show the "
        "tuple assignment; stored copies of reorder_batch_to_split_decodes_and_prefills pair "
        "the i-th prefill with the i-th decode from the back (modelled: decode_first_swaps), "
        "later ones split four regions (decode, short and long extend, prefill), not modelled. "
        "PyTorch issue #17008 (open since 2019) is the root: `x[i], x[j] = x[j], x[i]` on a "
        "tensor writes x[i] into both; #78874 is its strided twin. Relatives: #36255 (merged) "
        "and issue #34731 (swap_states copies only the active token prefix), the TPU input "
        "batch's copy of swap_states (tpu-inference #2232). Not verified: the PR's diff line "
        "by line, and whether Model Runner V2 (which keeps request state in rows reached "
        "through idx_mapping, not by swaps) has the same site. Modelled: this runner keeps "
        "no request across steps, so the mask rows are written from each step's requests in "
        "the persistent batch's order and then reordered with the requests and their KV-cache "
        "rows (RunnerConfig.attention.reorder_batch); sampling is argmax over the masked "
        "logits. Both "
        "devices show it alike: the mask is a host tensor, copied to the logits' device."
    ),
)
