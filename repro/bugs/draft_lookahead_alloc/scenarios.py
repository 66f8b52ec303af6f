"""Scenarios of draft_lookahead_alloc (vLLM #42971, #43733): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.lookahead import mask_values
from harness.runner.model_runner import ModelRunner, runner_config

SIZE = 4  # tokens per block, both groups
SHARED = (5, 9, 13, 2, 7, 11, 4, 6, 1, 8, 3, 10)  # X's prompt: three full blocks, cached
OTHER = (12, 14, 15, 16)  # Y's prompt: one full block, cached
# (label, num_speculative_tokens, graph mode, B's prompt: no prefix hit, or Y's block first)
EPISODES = (
    ("one draft, B's prompt 3 tokens, FULL graphs", 1, CUDAGraphMode.FULL, (21, 22, 23)),
    (
        "two drafts, B's prompt 8 tokens after a prefix hit, eager",
        2,
        CUDAGraphMode.NONE,
        (*OTHER, 24, 25, 26, 27),
    ),
)
STEPS = 3  # D's and B's first step, then two decode steps


def lookahead_past_allocation(ctx: Context) -> str:
    """A drafter that writes its KV in the target's step, past the sequence: after each step
    every request's drafter pass writes its own KV layer (group 0's blocks) at the step's
    tokens and at k + 1 positions past them (the bonus token and k mask tokens: DFlash's query
    block), then drafts from the sum of every position's values; each slot comes from the
    request's row of the block table. Prefix caching, blocks of 4 tokens. Request X (row 1,
    12 tokens) and Y (row 2, 4 tokens) run a step and finish: their full blocks stay cached,
    row 1's table still names X's blocks. Then one batch: D (row 0) whose prompt extends X's
    (a prefix hit on X's three blocks: D holds them now) and B (row 1, X's old row), then two
    decode steps. Two episodes: one draft with B's prompt 3 tokens (just before a block
    boundary; no prefix hit), FULL graphs for the target; two drafts with B's prompt 8 tokens
    (at a boundary) of which Y's cached block is a hit, eager. Each step: the target's logits vs
    the float64 reference, and each request's draft logits vs the drafter's on its own tokens.
    Then a third episode (`_late_join`): B joins in a step replayed in a FULL graph, after an
    eager step without its row, in X's old row; and a fourth (`_no_prefix_caching`): prefix
    caching off, a pool the first step takes whole, so D takes X's freed blocks and B, in X's
    old row, writes through its stale entries into D's context; and a fifth (`_at_max_model_len`):
    a sequence of max_model_len - k beside a running request, where the drafter must not run
    (its query block would end at position max_model_len, past any allocation).

    Fixed: each step allocates k + 1 lookahead slots past the step's tokens, the first step's
    too: every position the drafter writes is in a block of its own request; D's drafts read
    X's cached blocks as X's drafter wrote them.
    Buggy (either part off): without `draft_lookahead_on_prefill` B's first step gets no
    lookahead: its query block past its last block goes through row 1's stale entries into
    X's blocks, now D's (a shared prefix): D's next drafts read B's mask tokens (upstream: the
    drafts' acceptance degrades, #42971's falling mean generated length). Without
    `draft_lookahead_bonus_slot` only k slots: when the sequence plus k ends at a block
    boundary (3 + 1), the query block's last position is past the allocation: the same. (A
    lookahead set on eager steps only would give B, joining in a replayed step, the last eager
    step's: none for its row: the same again, in the third episode.)
    No error: the writes stay in the pool (stale ids are real blocks): the same on both
    devices. The target's own KV is untouched (the drafter's layer is its own).
    """
    problems: list[str | None] = []
    for label, k, mode, prompt in EPISODES:
        problems += _episode(ctx, label, k, mode, prompt)
    problems += _late_join(ctx)
    problems += _no_prefix_caching(ctx)
    problems += _at_max_model_len(ctx)
    expect_all(problems)
    labels = "; ".join([*(e[0] for e in EPISODES), LATE, UNCACHED, AT_LIMIT])
    return f"{labels}: every step's drafts as the reference"


UNCACHED = "one draft, prefix caching off, the pool's blocks reused"


def _no_prefix_caching(ctx: Context) -> list[str | None]:
    """Prefix caching off, a pool of 8 blocks of each group, exactly what the first step takes:
    W (row 0, 1 token), X (row 1, 12 tokens) and Z (row 2, 8 tokens) run an eager step and
    finish, X first (freed blocks queue up behind the free ones: X's are taken first). Then D
    (row 0, 12 new tokens) takes X's four blocks, and B (row 1, X's old row, its entries still
    X's block ids) joins with 3 tokens: its query block past its first block needs a block of
    its own, else its bonus position writes through row 1's stale second entry into D's
    context (positions 8-11). Three steps, every step's target and draft logits vs the
    reference: the lookahead does not depend on prefix caching."""
    label, k = UNCACHED, 1
    runner = _runner(ctx, k, CUDAGraphMode.NONE, blocks=8, caching=False)
    kv = runner.kv_cache
    seqs = {0: [19], 1: list(SHARED), 2: [30, 31, 32, 33, 34, 35, 36, 37]}
    problems = _step(runner, label, "first", seqs, {r: 0 for r in seqs}, k)
    held_by_x = list(kv.blocks[1][0])
    for row in (1, 0, 2):
        kv.free(row)
    stale = kv.block_tables.block_tables[0][1, 1].item()
    assert stale == held_by_x[1], f"trigger not reached ({label}): row 1 names {stale}"
    seqs = {0: [*range(40, 52)], 1: [21, 22, 23]}
    starts = {0: 0, 1: 0}
    for step in ("D and B's first", "decode 1", "decode 2"):
        problems += _step(runner, label, step, seqs, starts, k)
        starts = {r: len(seq) - 1 for r, seq in seqs.items()}
    return problems


AT_LIMIT = "one draft, a sequence of max_model_len - 1 beside a running request"


def _at_max_model_len(ctx: Context) -> list[str | None]:
    """The drafter's max_model_len guard: a batch drafts only if each sequence plus its query
    block (k + 1 positions) fits in max_model_len. Prefix caching off, a pool of 14 blocks of
    each group: V (row 0, 2 tokens) runs a step alone and takes block 0. Then V decodes beside
    L (row 1, 23 tokens: max_model_len 24 - k), then L finishes and V decodes once more. Every
    step's target logits vs the reference, V's draft logits in its steps alone. Rows are 32
    blocks wide (max_model_len's 6 rounded up to 128 tokens, as upstream's since vLLM #39324):
    the entries past 6 are never a request's and stay 0, block 0, V's here. L's step drafts
    nothing (23 + k + 1 > 24); a guard that counts k positions, not k + 1, lets it draft: its
    mask token at position 24 goes through row 1's column 6 into V's block 0 (V's position 0),
    and V's next drafts read it: wrong_result on both devices (an in-bounds column of a real
    block; with rows of max_model_len's blocks alone the lookup would index past the row: an
    IndexError on the CPU, a device assert on a GPU). (Upstream's entry 0 is the null block;
    where max_model_len is a multiple of 128 tokens a row has no spare column, and the slot
    kernels' unchecked row offsets read the next row's first block.)"""
    label, k = AT_LIMIT, 1
    runner = _runner(ctx, k, CUDAGraphMode.NONE, blocks=14, caching=False)
    kv = runner.kv_cache
    seqs, starts = {0: [50, 51]}, {0: 0}
    problems = _step(runner, label, "V's first", seqs, starts, k)
    table = kv.block_tables.block_tables[0]
    assert kv.blocks[0][0] == [0], f"trigger not reached ({label}): V holds {kv.blocks[0][0]}"
    seqs[1], starts = list(range(33, 56)), {0: 2, 1: 0}
    problems += _step(runner, label, "L's first, 23 tokens", seqs, starts, k, drafts=False)
    past = table[1, 6:].tolist()  # the columns past max_model_len's 6 blocks
    assert past[:1] == [0], f"trigger not reached ({label}): row 1 past its 6 blocks: {past}"
    kv.free(1)
    del seqs[1]
    problems += _step(runner, label, "V decodes after L", seqs, {0: len(seqs[0]) - 1}, k)
    return problems


LATE = "one draft, B joins in a FULL graph replay after an eager step without its row"


def _late_join(ctx: Context) -> list[str | None]:
    """Rows 0-3: W (1 token), C and E (2 tokens each, running on), X (12 tokens, cached) run an
    eager step; W and X finish. An eager step: D (row 0) extends X's prompt by 7 tokens (a hit
    on X's three blocks), C and E decode. Then a step replayed in a FULL graph (6 tokens): D, C
    and E decode and B joins in row 3 (X's old row) with 3 tokens, its first step; then two more
    steps. Every step's target and draft logits vs the reference. The lookahead is the step's
    own, a replayed step's too: B's query block past its 3 tokens needs the slots of its own
    next block (else it writes through row 3's stale entries into X's blocks, D's now)."""
    label, k = LATE, 1
    runner = _runner(ctx, k, CUDAGraphMode.FULL)
    runner.capture_model()
    kv = runner.kv_cache
    seqs = {0: [19], 1: [30, 31], 2: [32, 33], 3: list(SHARED)}
    problems = _step(runner, label, "first", seqs, {r: 0 for r in seqs}, k)
    held_by_x = list(kv.blocks[3][0])
    for row in (0, 3):
        kv.free(row)
        del seqs[row]
    seqs[0] = [*SHARED, *range(40, 47)]
    starts = {0: kv.get_computed_blocks(0, seqs[0]), 1: len(seqs[1]) - 1, 2: len(seqs[2]) - 1}
    assert kv.blocks[0][0] == held_by_x[:3], f"trigger not reached ({label}): D's hit"
    problems += _step(runner, label, "D's prefill", seqs, starts, k)
    seqs[3] = [21, 22, 23]
    row_three = kv.block_tables.block_tables[0][3, :3].tolist()
    assert row_three == held_by_x[:3], f"trigger not reached ({label}): row 3 names {row_three}"
    starts = {r: len(seq) - 1 for r, seq in seqs.items()} | {3: 0}
    for step in ("B joins", "decode 1", "decode 2"):
        problems += _step(runner, label, step, seqs, starts, k)
        starts = {r: len(seq) - 1 for r, seq in seqs.items()}
    return problems


def _step(
    runner, label: str, step: str, seqs: dict, starts: dict, k: int, drafts: bool = True
) -> list[str | None]:
    """One step of rows 0..n-1 (each scheduling its tokens from `starts`): the target's and
    (`drafts`: a step the batch drafts in) the drafter's logits vs the reference; each row's
    sequence grows by its greedy token."""
    rows = sorted(seqs)
    assert rows == list(range(len(rows))), "rows 0..n-1: the batch's row r is request row r"
    out = runner.execute_model(
        [Request(f"r{r}", tuple(seqs[r][starts[r] :]), 0, starts[r]) for r in rows]
    )
    want = recomputed_logits(runner, [seqs[r] for r in rows])
    where = f"{label}, {step}"
    problems = [close(f"{where}: target logits vs reference", out.logits, want)]
    bonus = want.argmax(-1).tolist()
    for r in rows:
        if drafts:
            problems.append(
                close(
                    f"{where}: row {r}'s draft logits vs reference",
                    runner.drafter.draft_logits[r],
                    draft_reference(runner, seqs[r], bonus[r], k),
                )
            )
        seqs[r].append(bonus[r])
    return problems


def _runner(ctx: Context, k: int, mode, blocks: int = 32, caching: bool = True) -> ModelRunner:
    return ModelRunner(
        runner_config(
            ctx.device,
            ctx.fixes,
            dtype=ctx.dtype,
            enable_lora=False,
            cudagraph_mode=mode,
            cudagraph_sizes=(8,),
            block_sizes=(SIZE, SIZE),
            num_kv_blocks=blocks,
            enable_prefix_caching=caching,
            max_num_reqs=4,
            max_num_tokens=24,
            max_model_len=24,
            num_speculative_tokens=k,
            parallel_drafting=True,
        )
    )


def _episode(ctx: Context, label: str, k: int, mode, prompt) -> list[str | None]:
    runner = _runner(ctx, k, mode)
    if mode != CUDAGraphMode.NONE:
        runner.capture_model()
    kv, problems = runner.kv_cache, []
    # X and Y: a step each, then finished: their full blocks stay in the prefix cache
    runner.execute_model([Request("W", (19,)), Request("X", SHARED), Request("Y", OTHER)])
    held_by_x = list(kv.blocks[1][0])
    for row in (0, 1, 2):
        kv.free(row)
    # D (row 0) extends X's prompt: a hit on X's three blocks; B (row 1: X's old row)
    seqs = [[*SHARED, 17, 18], list(prompt)]
    starts = [kv.get_computed_blocks(row, seq) for row, seq in enumerate(seqs)]
    assert kv.blocks[0][0] == held_by_x[:3], f"trigger not reached ({label}): D's hit"
    row_one = kv.block_tables.block_tables[0][1, :3].tolist()
    assert row_one == held_by_x[:3], f"trigger not reached ({label}): row 1 names {row_one}"
    for step in range(STEPS):
        requests = [
            Request(f"r{row}", tuple(seq[start:]), 0, start)
            for row, (seq, start) in enumerate(zip(seqs, starts, strict=True))
        ]
        out = runner.execute_model(requests)
        want = recomputed_logits(runner, seqs)
        where = f"{label}, step {step}"
        problems.append(close(f"{where}: target logits vs reference", out.logits, want))
        bonus = want.argmax(-1).tolist()
        for row, seq in enumerate(seqs):
            problems.append(
                close(
                    f"{where}: request {'DB'[row]}'s draft logits vs reference",
                    runner.drafter.draft_logits[row],
                    draft_reference(runner, seq, bonus[row], k),
                )
            )
        starts = [len(seq) for seq in seqs]
        for row, token in enumerate(bonus):
            seqs[row].append(token)
    return problems


def draft_reference(runner: ModelRunner, seq: list[int], bonus: int, k: int) -> torch.Tensor:
    """[k, vocab] float64: the drafter's scores over `seq`, its bonus token and k mask tokens."""
    embed = runner.model.embed.detach().double().cpu()
    head = runner.model.head.detach().double().cpu()
    masks = mask_values(k, embed.shape[1])
    values = torch.cat([embed[list(seq)], embed[bonus : bonus + 1], masks])
    return (values.sum(0) + masks) @ head.T
