"""Scenarios of grammar_bitmask_fill (vLLM #22896, #22963; vllm-gaudi #1199, #1200): each
function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.structured_output import ToyGrammar, grammar_bitmask

STEPS = 3  # a prefill, then two decode steps
PROMPTS = ((5, 9, 13), (2, 7), (11, 4, 6, 1), (8, 3))  # a request per batch row
# (label, each row's grammar or None (a free request), the scheduler's order of the guided
# rows, the step from which each row is free (None: guided to the end)): guided and free mixed
# (a guided row after a free one, free rows first and between), guided first with a free row
# last, every row guided, one guided row alone, three of four guided and one of them done with
# its grammar after the prefill (its row guided, then free in the same persistent mask); the
# scheduler's order of two or more rows is never the batch's
BATCHES = (
    ("free, guided, free, guided", (None, ToyGrammar(3), None, ToyGrammar(4, 1)), (3, 1), None),
    ("guided, guided, free", (ToyGrammar(5, 2), ToyGrammar(2, 1), None), (1, 0), None),
    ("every row guided", (ToyGrammar(3, 2), ToyGrammar(4)), (1, 0), None),
    ("one guided row of three", (None, None, ToyGrammar(3, 1)), (2,), None),
    (
        "three guided of four, row 0 free after the prefill",
        (ToyGrammar(3), ToyGrammar(4, 1), None, ToyGrammar(5, 2)),
        (3, 0, 1),
        (1, None, None, None),
    ),
)


def guided_and_free_rows(ctx: Context) -> str:
    """Five batches, each on a fresh eager runner, of a prefill and two decode steps: four rows
    (free, guided, free, guided), three rows (guided, guided, free), two rows (both guided),
    three rows with one guided, and four rows with three guided of which row 0 is done with its
    grammar after the prefill (guided at step 0, free at steps 1 and 2, in the same mask).
    A guided request follows a toy grammar (an automaton over the 64 token ids: in state s the
    tokens t with t % m == s are allowed; each sampled token moves the state). Each step the
    scheduler sends its compact bitmask: one packed int32 row per guided request, in its own
    order (never the batch's: 3 before 1, 1 before 0). The runner's worker scatters the rows
    into a batch-sized mask and the Triton kernel masks every logits row by its mask row. Each
    step's logits vs the float64 reference: a free row exactly the model's logits, a guided row
    -inf outside its grammar's tokens; the next tokens are the reference's greedy picks.

    Fixed: the mask's rows start neutral (every bit set) and only the guided requests' rows
    are written: the free rows are untouched, each guided row allows exactly its grammar's
    tokens.
    Buggy (either part off): without `grammar_neutral_fill` the free rows of the mask are zeros
    (as allocated): every token of a free request is forbidden, its logits all -inf, its
    softmax NaN; the runner's greedy sampler (argmax, ModelRunner.generate) then picks token 0
    every step (vllm-gaudi #1199: '!' repeatedly, token 0 of common vocabularies; upstream's
    sampling kernels read the NaN probabilities: #22963 met an illegal memory access there).
    Without `grammar_guided_row_count` the scatter writes as many rows as the batch has: past
    the scheduler's rows it copies the staging buffers' stale entries (as allocated: a zero row
    to batch row 0), so row 0 forbids every token. No error: the same on both devices.
    """
    problems: list[str | None] = []
    for label, grammars, order, free_from in BATCHES:
        assert [g is not None for g in grammars].count(True) == len(order), "trigger not reached"
        assert len(order) < 2 or list(order) != sorted(order), f"trigger not reached ({label})"
        problems += _serve(ctx, label, grammars, order, free_from or (None,) * len(grammars))
    expect_all(problems)
    labels = "; ".join(label for label, *_ in BATCHES)
    return f"{labels}: {STEPS} steps each as the reference"


def _serve(ctx: Context, label: str, grammars, order, free_from) -> list[str | None]:
    """One batch on a fresh runner: each step's logits vs the grammar-masked reference (a row
    from its `free_from` step on is a free request)."""
    rows = len(grammars)
    runner = ModelRunner(
        runner_config(
            ctx.device,
            ctx.fixes,
            dtype=ctx.dtype,
            enable_lora=False,
            cudagraph_mode=CUDAGraphMode.NONE,
            max_num_reqs=4,
            max_num_tokens=16,
            max_model_len=16,
        )
    )
    vocab = runner.config.model.vocab_size
    seqs = [list(PROMPTS[r]) for r in range(rows)]
    states = [g.start if g is not None else None for g in grammars]
    problems: list[str | None] = []
    for step in range(STEPS):
        start = [0 if step == 0 else len(seqs[r]) - 1 for r in range(rows)]
        requests = [Request(f"r{r}", tuple(seqs[r][start[r] :]), 0, start[r]) for r in range(rows)]
        now = [g if free_from[r] is None or step < free_from[r] else None
               for r, g in enumerate(grammars)]  # fmt: skip
        guided = [(f"r{r}", now[r], states[r]) for r in order if now[r] is not None]
        out = runner.execute_model(
            requests, use_cudagraph=False, grammar=grammar_bitmask(guided, vocab)
        )
        want = recomputed_logits(runner, seqs)
        for r, grammar in enumerate(now):
            if grammar is not None:
                allowed = torch.zeros(vocab, dtype=torch.bool)
                allowed[grammar.allowed(states[r], vocab)] = True
                want[r] = want[r].masked_fill(~allowed, float("-inf"))
        problems += _compare(f"{label}, step {step}", out.logits, want)
        for r, token in enumerate(want.argmax(-1).tolist()):
            if now[r] is not None:
                states[r] = grammars[r].advance(states[r], token)
            seqs[r].append(token)
    return problems


def _compare(label: str, logits: torch.Tensor, want: torch.Tensor) -> list[str | None]:
    """The forbidden tokens exactly, the others' logits to the dtype's rounding; a row with
    every token forbidden is named with what the sampler makes of it."""
    got = logits.detach().double().cpu()
    what = f"{label}: forbidden tokens (-inf) vs the grammar's"
    forbidden = mismatch(what, got.isneginf(), want.isneginf())
    if forbidden:
        dead = got.isneginf().all(-1).nonzero().flatten().tolist()
        if dead:
            nan = torch.softmax(got[dead], -1).isnan().all().item()
            forbidden += (
                f"; rows {dead} forbid every token (softmax NaN: {nan}; the greedy sampler "
                f"picks token {got[dead].argmax(-1).tolist()})"
            )
    finite = close(
        f"{label}: allowed logits vs reference",
        logits.detach().cpu().nan_to_num(neginf=0.0),
        want.nan_to_num(neginf=0.0),
    )
    return [forbidden, finite]
