"""Scenarios of mamba_align_prefix_poison (vLLM #51113): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import mixer_reference
from harness.runner.mamba_align import MambaAlignEngine, aligned_split

BLOCK, BUDGET = 8, 16  # every prompt fits one step's budget: a prefill alone is never split
FIRST = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # 10 tokens: scheduled first, it leaves 6 of the budget
PROMPT = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]  # the producer's, cut to each length
TAIL = [11, 12, 13]  # the consumer: the producer's first block, then tokens of its own
# an unrelated request run alone after the producer's wave finished, before the consumer: its
# 24 tokens take two new entries (with or without the back-off), from the free list's end
OTHER = [15, 0, 14, 6, 10, 3, 12, 9, 7, 13, 4, 11, 1, 8, 5, 2, 15, 9, 6, 0, 10, 14, 3, 12]
LONG = [*PROMPT, 3, 9, 7, 1, 0, 6, 2, 5, 8, 4, 1, 7, 3, 6]  # 30 tokens: a session's turns
TURN = 11  # the session's first turn ends mid-block: its next turn resumes at token 11
RESUMES = (("no EAGLE, a next turn to 30 tokens", False, 30), ("EAGLE, to 20", True, 20))
# (label, EAGLE back-off, the producer's length, whether a first prefill shares its budget)
CASES = (
    *(("EAGLE, two prefills", True, n, True) for n in (9, 12, 15, 16)),
    ("EAGLE, one prefill", True, 15, False),
    ("no EAGLE, two prefills", False, 15, True),
)


def _mid_block_ends(what: str, engine: MambaAlignEngine, prompts: dict, since=0) -> list[str]:
    """Upstream's invariant (its test_mamba_align_chunk_split.py): every chunk of a prefill but
    its last ends on a block boundary, the position its entry is hashed at."""
    return [
        f"{what}: {c.req}'s chunk [{c.start}, {c.end}) ends mid-block, not at its prompt's end"
        for step in engine.chunks[since:]
        for c in step
        if c.req in prompts and c.end % BLOCK and c.end < len(prompts[c.req])
    ]


def _split_grid(fixes) -> tuple[int, list[str]]:
    """The split itself (the code under test, as upstream's test_mamba_align_chunk_split.py
    checks it) over every start of every prompt of 1 to 3 blocks + 1 tokens, mid-block starts
    included (upstream: a prefix hit finer than a block; the engine here: only a session's
    next turn), every budget up to the prompt's end, EAGLE on and off. The invariants a
    cached state needs, not the fixed code: a chunk that is not its prompt's last ends on a block
    boundary (the position its entry is hashed at); a chunk resuming mid-block ends at or
    before its block's end (else that entry keeps the state at its start); a request is
    scheduled when its budget is a whole block or reaches its prompt's end (progress); and never
    more than its budget. Returns the number of splits and the first violations of each."""
    found: dict[str, list[str]] = {}
    grid = [
        (eagle, n, start, budget)
        for eagle in (True, False)
        for n in range(1, 3 * BLOCK + 2)
        for start in range(n)
        for budget in range(1, n - start + 1)
    ]
    for eagle, n, start, budget in grid:
        got = aligned_split(start, budget, n, BLOCK, eagle, fixes)
        end, block_end = start + got, (start // BLOCK + 1) * BLOCK
        rules = (
            ("more than the budget", not 0 <= got <= budget),
            ("a non-final chunk ends mid-block", got and end < n and end % BLOCK),
            ("a mid-block resume crosses its block's end", start % BLOCK and end > block_end),
            ("no progress", not got and (budget >= BLOCK or start + budget == n)),
        )
        case = f"aligned_split(start {start}, budget {budget}, prompt {n}, eagle {eagle})"
        for rule, broken in rules:
            if broken:
                found.setdefault(rule, []).append(f"{case} = {got}: {rule}")
    return len(grid), [line for lines in found.values() for line in lines[:3]]


def shared_budget_resume(ctx: Context) -> str:
    """A Mamba layer in align mode (blocks of 8 tokens, prefix caching on, a step's budget 16
    tokens: every prompt fits in one step alone). Per case: a first wave of prefills, the
    producer after a 10-token prompt that takes part of the budget (or alone), then a consumer
    whose prompt is the producer's first block and 3 tokens of its own, which resumes from the
    state cached at token 8 when there is one; between them an unrelated 24-token request runs
    alone and finishes, its two new entries taking slots from the free list's end, where the
    wave's finished requests put theirs. Cases: producer prompts of 9, 12, 15 and 16
    tokens with the EAGLE back-off of the last cache position (under two blocks it is 0), one
    prefill alone, and two prefills without the back-off. Then a session whose first turn (11
    tokens) ends mid-block and whose next turn (30 tokens without the back-off, 20 with it)
    resumes at token 11 from the state its own entry holds (upstream's mid-block starts come
    from prefix hits finer than a block), then a consumer sharing its first two blocks. Every
    request's last logits must
    match a reference that runs its whole prompt from a zero state, and every chunk but a
    prompt's last must end on a block boundary (upstream's invariant). Then the split itself,
    as upstream's test of #51113 checks it, over every start (mid-block ones too: upstream a
    prefix hit finer than a block; this engine: only a session's next turn) of every prompt of
    1 to 25 tokens, every budget up to the prompt's end, EAGLE on and off: a chunk that is not its
    prompt's last ends on a block boundary; a chunk resuming mid-block ends at or before its
    block's end (else its entry keeps the state at its start, hashed as the boundary's); a
    budget of a whole block or one reaching the prompt's end schedules something; never more
    than the budget.

    Fixed: a chunk past the last cache position still ends on a block boundary or at the
    prompt's end: the producer's 6-token share is deferred, its prompt runs in one chunk and
    its first entry stays null (no hit for the consumer), or with 16 tokens or without the
    back-off the chunk stops at token 8 and the consumer's hit is right: the unrelated request
    reuses freed slots but never a cached one (a finished request's cached slots stay cached,
    out of the free list). A finish that frees cached slots too hands the producer's entry at 8
    to the unrelated request, which writes its own state there, still hashed as the producer's
    state at 8: the consumer restores it, its logits differ. Buggy: with the
    back-off and two prefills, the producer's first chunk ends mid-block (tokens 0-6, or 0-4),
    the next crosses token 8 and the entry holding the state at token 6 is hashed as the state
    at 8; the consumer resumes from it: its logits differ, and the producer's first chunk ends
    mid-block; the session's resumed chunk runs past token 16 (to 24, or to its end 20), the
    entry holding the state at 11 is hashed as the state at 16 and the consumer resuming there
    differs too; on the grid, chunks past the last cache position end mid-block, with the
    back-off or without it, and mid-block resumes cross their block's end (wrong result, both
    devices)."""
    problems, hits = [], []
    for label, eagle, length, shared in CASES:
        engine = MambaAlignEngine(ctx.device, ctx.fixes, block=BLOCK, budget=BUDGET, eagle=eagle)
        producer = PROMPT[:length]
        first = {"first": FIRST} if shared else {}
        wave = engine.prefill({**first, "producer": producer})
        freed = {c.slot for step in engine.chunks for c in step}  # the wave's, now finished
        since = len(engine.chunks)
        _, other = engine.prefill({"other": OTHER})["other"]
        took = {c.slot for step in engine.chunks[since:] for c in step}
        assert took & freed, f"trigger not reached: the other request took slots {took}"
        consumer = [*producer[:BLOCK], *TAIL]
        (hit, logits) = engine.prefill({"consumer": consumer})["consumer"]
        hits.append(hit)
        what = f"{label}, producer of {length} tokens"
        for req, prompt in (*first.items(), ("producer", producer)):
            ref = mixer_reference(engine.weights, prompt)
            problems.append(close(f"{what}: {req} logits vs reference", wave[req][1], ref))
        ref = mixer_reference(engine.weights, OTHER)
        problems.append(close(f"{what}: other logits vs reference", other, ref))
        ref = mixer_reference(engine.weights, consumer)
        problems.append(
            close(f"{what}: consumer (hit {hit} tokens) logits vs reference", logits, ref)
        )
        problems += _mid_block_ends(what, engine, {**first, "producer": producer})
    for label, eagle, length in RESUMES:
        engine = MambaAlignEngine(ctx.device, ctx.fixes, block=BLOCK, budget=BUDGET, eagle=eagle)
        engine.prefill({"session": LONG[:TURN]}, keep=True)
        session, since = LONG[:length], len(engine.chunks)
        _, logits = engine.prefill({"session": session})["session"]
        what = f"{label}, resumed at {TURN}"
        ref = mixer_reference(engine.weights, session)
        problems.append(close(f"{what}: session logits vs reference", logits, ref))
        problems += _mid_block_ends(what, engine, {"session": session}, since)
        consumer = [*LONG[: 2 * BLOCK], *TAIL]
        (hit, logits) = engine.prefill({"consumer": consumer})["consumer"]
        hits.append(hit)
        ref = mixer_reference(engine.weights, consumer)
        problems.append(
            close(f"{what}: consumer (hit {hit} tokens) logits vs reference", logits, ref)
        )
    splits, broken = _split_grid(ctx.fixes)
    expect_all(problems + broken)
    return (
        f"{len(CASES) + len(RESUMES)} cases: every request's logits as the reference "
        f"(consumer hits {hits}); "
        f"{splits} splits keep the invariants"
    )
