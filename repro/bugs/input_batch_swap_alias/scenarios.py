"""Scenarios of input_batch_swap_alias (vLLM #48419, open): each function's docstring is its
bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner, RunnerConfig, runner_config

# step 2's rows in the persistent batch's order: two new prefills, then two decodes; S comes
# in step 3, in Q's row
PROMPTS = {"P": (5, 9, 13), "Q": (2, 7), "D1": (11, 3, 8), "D2": (6, 1, 4, 10), "S": (4, 12)}
# requests with allowed_token_ids: step 2 swaps rows 0 <-> 3 (both restricted, differently) and
# 1 <-> 2 (a restricted prefill, a decode without); step 3 swaps 2 <-> 3 (a prefill without, a
# restricted decode)
RESTRICTED = ("P", "Q", "D2")


def swap_config(ctx: Context) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) that puts decodes before prefills by row swaps."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=8,
        num_kv_blocks=8,
        reorder_batch=True,
    )


def allowed_ids(runner: ModelRunner, seq: tuple[int, ...]) -> tuple[int, ...]:
    """Three tokens the model ranks 2nd to 4th after `seq`: the restriction changes the
    sampled token."""
    ranked = recomputed_logits(runner, [list(seq)])[0].argsort(descending=True)
    return tuple(ranked[1:4].tolist())


def sampled_problems(runner: ModelRunner, out: ModelOutput, seqs, allowed) -> list[str | None]:
    """Each request's masked logits (by req_id, in the rows the step left it) vs its own
    restriction: the masked tokens exactly, the allowed logits vs the float64 reference (its
    KV-cache row moved with it), and the sampled token (argmax) one of its allowed tokens."""
    vocab = runner.config.model.vocab_size
    expected_mask = torch.zeros(len(out.req_ids), vocab, dtype=torch.bool)
    reference = recomputed_logits(runner, [list(seqs[rid]) for rid in out.req_ids])
    for row, rid in enumerate(out.req_ids):
        if rid in allowed:
            expected_mask[row] = True
            expected_mask[row, list(allowed[rid])] = False
    rows = ", ".join(out.req_ids)
    allowed_logits = out.logits.masked_fill(out.logits.isinf(), 0.0)
    return [
        mismatch(f"disallowed tokens of rows ({rows})", out.logits.isinf(), expected_mask),
        close(
            f"allowed logits of rows ({rows}) vs reference",
            allowed_logits,
            reference.masked_fill(expected_mask, 0.0),
        ),
        mismatch(
            f"sampled tokens of rows ({rows}) allowed",
            expected_mask.gather(1, out.logits.argmax(-1).cpu()[:, None])[:, 0],
            torch.zeros(len(out.req_ids), dtype=torch.bool),
        ),
    ]


def restricted_prefill_behind_decodes(ctx: Context) -> str:
    """Step 1 prefills D1 and D2 in rows 2 and 3 (two fillers in rows 0 and 1, then freed).
    Step 2 schedules, in the persistent batch's rows, P and Q (new prefills, each with its own
    allowed_token_ids), D1's and D2's decodes (D2 with allowed_token_ids): the reorder puts
    decodes first with two swaps, rows 0 <-> 3 then 1 <-> 2, moving each request's KV-cache
    row and its row of the allowed-token-ids mask. Then Q finishes and S, a new prefill without
    allowed_token_ids, takes its row: step 3 decodes D2, D1 and P (P's restriction kept) and
    prefills S in row 2, before P's decode: one swap, 2 <-> 3. The swapped pairs are every
    kind: both restricted (P, D2), a restricted prefill with a decode without (Q, D1), a
    prefill without with a restricted decode (S, P). Each request's masked logits are checked
    against its own restriction (the model's 2nd-4th ranked tokens, so that a lost mask changes
    the sampled token) and the float64 reference, in both steps.

    Fixed: the mask rows trade places: every request samples from its own allowed tokens.
    Buggy: the swap writes row 0 from row 3, then row 3 from row 0's view, which already holds
    row 3: P, now in row 3, samples under D2's restriction (and swap 1 <-> 2 leaves Q, in
    row 2, unrestricted). A wrong token, no error (both devices: the mask is a host tensor, as
    upstream's CPU staging tensor is).
    """
    runner = ModelRunner(swap_config(ctx))
    seqs = {rid: list(p) for rid, p in PROMPTS.items()}
    fillers = [Request("X0", (1, 2)), Request("X1", (3,))]
    first = runner.execute_model([*fillers, *(Request(r, PROMPTS[r]) for r in ("D1", "D2"))])
    for rid, logits in zip(first.req_ids[2:], first.logits[2:], strict=True):
        seqs[rid].append(int(logits.argmax()))
    for row in (0, 1):
        runner.kv_cache.free(row)
    allowed = {rid: allowed_ids(runner, tuple(seqs[rid])) for rid in RESTRICTED}
    step = [
        Request("P", PROMPTS["P"], allowed_token_ids=allowed["P"]),
        Request("Q", PROMPTS["Q"], allowed_token_ids=allowed["Q"]),
        Request("D1", (seqs["D1"][-1],), 0, len(PROMPTS["D1"])),
        Request("D2", (seqs["D2"][-1],), 0, len(PROMPTS["D2"]), allowed["D2"]),
    ]
    out = runner.execute_model(step)
    assert out.req_ids == ("D2", "D1", "Q", "P"), f"trigger not reached: rows {out.req_ids}"
    expect_all(sampled_problems(runner, out, seqs, allowed))
    rows = ", ".join(out.req_ids)
    for rid, logits in zip(out.req_ids, out.logits, strict=True):
        seqs[rid].append(int(logits.argmax()))
    runner.kv_cache.free(2)  # Q finished: S takes its row
    step = [
        Request("D2", (seqs["D2"][-1],), 0, len(seqs["D2"]) - 1, allowed["D2"]),
        Request("D1", (seqs["D1"][-1],), 0, len(seqs["D1"]) - 1),
        Request("S", PROMPTS["S"]),
        Request("P", (seqs["P"][-1],), 0, len(PROMPTS["P"]), allowed["P"]),
    ]
    out = runner.execute_model(step)
    assert out.req_ids == ("D2", "D1", "P", "S"), f"trigger not reached: rows {out.req_ids}"
    expect_all(sampled_problems(runner, out, seqs, allowed))
    return (
        f"rows {rows} after two swaps, then {', '.join(out.req_ids)} after one: each samples "
        "under its own mask"
    )
