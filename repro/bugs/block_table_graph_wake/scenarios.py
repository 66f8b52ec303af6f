"""Scenarios of block_table_graph_wake (the hazard of vLLM #53197): each function's docstring is
its bug report. The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.worker import Worker

PROMPTS = ([1, 2, 3, 4, 5], [7], [9, 8, 7, 6])  # 10 tokens: the PIECEWISE 16 graph
NEW_TOKENS = 3  # then decode steps of 3 requests: the FULL 4 graph
STAGED = (["weights"], ["kv_cache"])  # an RL trainer's order: weights first, then the KV cache
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(1) -> wake_up([weights]) -> wake_up([kv_cache])", 1, STAGED),
    ("sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])", 2, STAGED),
    ("sleep(2) -> wake_up()", 2, (None,)),
)
LAYOUT = ("block_table_ptrs", "input_block_table_ptrs", "block_table_strides", "block_sizes_tensor")


def _generate(runner: ModelRunner, label: str) -> tuple[list[list[int]], list[str | None]]:
    """Greedy tokens, every step from a graph; each step's logits vs the dense reference."""
    runner.kv_cache.reset()
    seqs, problems = [list(p) for p in PROMPTS], []
    for step in range(NEW_TOKENS):
        requests = [
            Request(
                f"r{row}",
                tuple(seq if step == 0 else seq[-1:]),
                0,
                0 if step == 0 else len(seq) - 1,
            )
            for row, seq in enumerate(seqs)
        ]
        out = runner.execute_model(requests)
        if out.desc is None:
            problems.append(f"{label}: step {step} ran eagerly, not from a graph")
        graph = f"{out.desc.cg_mode.value} {out.desc.num_tokens}" if out.desc else "eager"
        reference = step_reference(runner, requests)[1]
        problems.append(
            close(f"{label}: step {step} ({graph}) logits vs reference", out.logits, reference)
        )
        for row, token in enumerate(out.logits.argmax(-1).tolist()):
            seqs[row].append(token)
    return [seq[len(p) :] for seq, p in zip(seqs, PROMPTS, strict=True)], problems


def graph_replay_after_wake(ctx: Context) -> str:
    """Graphs that gather the step's block tables and compute its slot mappings themselves
    (FULL_AND_PIECEWISE: a PIECEWISE graph for the prefill, FULL decode graphs), captured
    once; generate, then for each cycle: sleep, wake, generate again, every step replayed.
    Cycles: levels 1 and 2, each woken at once (`wake_up()`) and staged (the weights, then the
    KV cache).

    Each step's logits vs the dense float64 reference; the tokens must not change; the layout
    tensors' data_ptr()s must not change across a wake (a graph holds them). Fixed: the
    layout tensors are refreshed in place on wake, the graphs read the live ones. Buggy (they
    are rebuilt as new tensors, #40648's way): the first replay after wake reads the old
    tensors, whose memory wake discarded (0xFF bytes, or by then another layout tensor's
    values), and follows a wild table address: illegal address on the GPU; on the CPU the
    interpreter's wild read kills the child with SIGSEGV. A refresh that rebinds the layout
    tensors' storages (`.data = ...`) keeps the objects but not the addresses: the same fault.
    """
    return _replay_after_wake(ctx, CUDAGraphMode.FULL_AND_PIECEWISE, CYCLES)


def piecewise_replay_after_wake(ctx: Context) -> str:
    """The same hazard with PIECEWISE graphs alone: every step (prefill and decode) replays a
    piece that gathers the tables, though attention runs eagerly between the pieces. A refresh
    that treats PIECEWISE as graph-free (attention is eager there, so it rebuilds the layout
    tensors) leaves those pieces on the old addresses. Two cycles: level 1 woken at once,
    level 2 staged. Buggy: illegal address (CPU: SIGSEGV of the interpreter's wild read).
    """
    return _replay_after_wake(ctx, CUDAGraphMode.PIECEWISE, (CYCLES[0], CYCLES[2]))


def _replay_after_wake(ctx: Context, mode: CUDAGraphMode, cycles) -> str:
    config = runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=mode,
        tables_in_graph=True,
    )
    worker = Worker(config)
    runner = worker.model_runner
    runner.capture_model()
    expected, problems = _generate(runner, "before sleeping")
    tables = runner.kv_cache.block_tables
    addresses = {name: getattr(tables, name).data_ptr() for name in LAYOUT}
    for label, level, wakes in cycles:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)
        moved = {
            n: hex(getattr(tables, n).data_ptr())
            for n, a in addresses.items()
            if getattr(tables, n).data_ptr() != a
        }
        if moved:  # reported after the replays, which show the failure first
            problems.append(
                f"{label}: layout tensors moved (graphs hold the old addresses): {moved}"
            )
        got, found = _generate(runner, label)
        problems += found
        if got != expected:
            problems.append(f"{label}: generated {got}, before sleeping {expected}")
    expect_all(problems)
    cycles_run = f"{len(cycles)} sleep/wake cycles ({mode.value})"
    return f"{cycles_run}, every step replayed: tokens {expected} as reference"
