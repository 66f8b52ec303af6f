"""Scenarios of conv_state_short_chunk (vLLM #56196): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import conv_state_reference, mixer_reference
from harness.runner.mamba_align import MambaAlignEngine
from kernels.causal_conv1d import WIDTH

BLOCK, BUDGET = 8, 16
PROMPT = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # the producer's: its first block is cached
TAIL = [11, 12, 13, 14]  # the first consumer's tokens after the prefix, cut to 1..WIDTH
OTHER = [9, 3, 6, 0]  # the second consumer's: a chunk of WIDTH tokens after the prefix
# (label, the producer's length, the first consumer's tokens after the prefix: 0, none)
CASES = (
    *((f"cached start, a chunk of {n}", len(PROMPT), n) for n in range(1, WIDTH + 1)),
    ("the producer's own last chunk of 2, from the block it cached", BLOCK + 2, 0),
)
FRESH = ([5], [5, 6], [5, 6, 7])  # fresh starts: 1 and 2 tokens (short), 3 (long)


def _own_slots(what: str, engine: MambaAlignEngine, prompts: dict, since: int) -> list[str]:
    """The state a later step (a decode, a next chunk) would read: after a wave, every slot a
    chunk of it wrote last holds the conv state at that chunk's end, as the float64 reference
    computes it from the whole prompt."""
    last = {c.slot: c for step in engine.chunks[since:] for c in step}
    return [
        close(
            f"{what}: {c.req}'s own slot {c.slot} (conv state at {c.end}) vs reference",
            engine.states.conv[c.slot],
            conv_state_reference(engine.weights, list(prompts[c.req][: c.end])),
        )
        for c in last.values()
    ]


def short_chunk_after_prefix_hit(ctx: Context) -> str:
    """A Mamba layer in align mode (blocks of 8 tokens, prefix caching on, no EAGLE back-off:
    a prompt of 9 to 15 tokens stops a chunk at token 8, whose state is cached), its width-4
    convolution a Triton kernel that reads a chunk's initial conv state from one slot and
    writes the final one to the request's own. Per case: a producer caches its first block;
    a first consumer sharing it resumes there (a prefix hit) with a chunk of 1, 2, 3 or 4 tokens
    of its own (or the producer's own last chunk is 2 tokens after the block it cached); then a
    second consumer sharing the same block resumes there too. Then fresh prompts of 1, 2 and 3
    tokens (no initial state). Every request's last logits must match a reference that runs its
    whole prompt from a zero state, and after each prefill every slot one of its chunks wrote
    last (the request's own, which a later step, a decode or a next chunk, would read; this
    engine models no decode) must hold the float64 reference conv state at that chunk's end.

    Fixed: every chunk stores its conv state in its own slot; the cached block keeps the state
    at token 8. Buggy: a chunk shorter than 3 tokens stores its shifted conv state through the
    slot it read, the cached block: the second consumer resumes from the first's conv state
    (its logits differ; wrong result, both devices), and the short chunk's own slot keeps what
    it held (NaN poison, or a freed slot's earlier state); chunks of 3 or 4, and fresh starts
    (read and written slot the same), pass."""
    problems, hits = [], []
    for label, length, tail in CASES:
        engine = MambaAlignEngine(ctx.device, ctx.fixes, block=BLOCK, budget=BUDGET, eagle=False)
        producer = PROMPT[:length]
        sequences = {"producer": producer}
        if tail:
            sequences["first consumer"] = [*producer[:BLOCK], *TAIL[:tail]]
        sequences["second consumer"] = [*producer[:BLOCK], *OTHER]
        for req, prompt in sequences.items():  # one after another: each a wave of its own
            since = len(engine.chunks)
            hit, logits = engine.prefill({req: prompt})[req]
            hits.append(hit)
            ref = mixer_reference(engine.weights, prompt)
            problems.append(close(f"{label}: {req} (hit {hit}) logits vs reference", logits, ref))
            problems += _own_slots(label, engine, {req: prompt}, since)
    engine = MambaAlignEngine(ctx.device, ctx.fixes, block=BLOCK, budget=BUDGET, eagle=False)
    for prompt in FRESH:
        since = len(engine.chunks)
        _, logits = engine.prefill({"fresh": prompt})["fresh"]
        what = f"fresh start of {len(prompt)}"
        ref = mixer_reference(engine.weights, prompt)
        problems.append(close(f"{what}: logits vs reference", logits, ref))
        problems += _own_slots(what, engine, {"fresh": prompt}, since)
    expect_all(problems)
    return f"{len(CASES)} cases and {len(FRESH)} fresh starts as the reference (hits {hits})"
