"""Scenarios of lora_slot_memo (vLLM #47725): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model import ModelConfig
from harness.runner.model_runner import ModelRunner, runner_config

# the phases: (LoRA slots, the prompts (request a decodes on adapter 1, b on adapter 2), steps,
# {step: the adapters add_lora'd before it}). Two slots, both in flight: adapter 3 hot-added
# before step 2 evicts 1; step 2 reloads 1 over 2 and 2 over 3: (1, 2) becomes (2, 1), the two
# adapters swap slots. Three slots, the third free, prompts of one token (the prefill's
# LoRAMapping is the decode's): before step 1, adapter 1 is added again (loaded: upstream's
# add_adapter only touches it, the most recently used), 3 takes the free slot and 4 evicts 2,
# now the least recently used; step 1 reloads 2 over 3: (1, 2, -) becomes (1, 4, 2), 2 moves
# from slot 1 to slot 2 while 1 stays in slot 0
SWAP = (2, (("a", (3, 5, 7), 1), ("b", (11, 2), 2)), 4, {2: (3,)})
ONE_MOVES = (3, (("a", (3,), 1), ("b", (11,), 2)), 2, {1: (1, 3, 4)})


def _runner(ctx: Context, mode: CUDAGraphMode, slots: int) -> ModelRunner:
    """`slots` LoRA slots, adapters 1 and 2 in the first two; a FULL graph of 2 tokens (the
    decode steps' size) if asked: the prefill runs eagerly."""
    config = runner_config(
        ctx.device,
        ctx.fixes,
        model=ModelConfig(max_loras=slots),
        dtype=ctx.dtype,
        cudagraph_mode=mode,
        cudagraph_sizes=(2,),
        max_model_len=16,
    )
    runner = ModelRunner(config)
    for lora_id in (1, 2):
        runner.add_lora(lora_id, seed=ctx.seed + 10 + lora_id, experts=False)
    if mode != CUDAGraphMode.NONE:
        runner.capture_model()
    return runner


def _serve(ctx: Context, mode: CUDAGraphMode, phase) -> tuple[str, list]:
    """A prefill step, then decode steps of the same two requests; before a step the phase
    names, adapters are added (hot adds between decode steps: the batch, and so its
    LoRAMapping, unchanged). Every step's hidden states and logits vs the dense float64
    reference, which reads each request's adapter from its slot now."""
    slots, prompts, steps, adds = phase
    runner = _runner(ctx, mode, slots)
    manager = runner.lora_manager._adapter_manager
    seqs = {name: list(prompt) for name, prompt, _ in prompts}
    problems, layouts, graphs = [], [], []
    for step in range(steps):
        for lora_id in adds.get(step, ()):
            runner.add_lora(lora_id, seed=ctx.seed + 10 + lora_id, experts=False)
        starts = {name: 0 if step == 0 else len(seq) - 1 for name, seq in seqs.items()}
        requests = [
            Request(name, tuple(seqs[name][starts[name] :]), lora, starts[name])
            for name, _, lora in prompts
        ]
        out = runner.execute_model(requests)
        layouts.append(tuple(-1 if i is None else i for i in manager.lora_index_to_id))
        graphs.append(f"{out.desc.cg_mode.value} {out.desc.num_tokens}" if out.desc else "eager")
        hidden, logits = step_reference(runner, requests)
        label = f"{slots} slots, step {step} ({graphs[-1]}, slots {layouts[-1]})"
        problems += [
            close(f"{label}: hidden states vs reference", out.hidden_states, hidden),
            close(f"{label}: logits vs reference", out.logits, logits),
        ]
        for (name, _, _), token in zip(prompts, logits.argmax(-1).tolist(), strict=True):
            seqs[name].append(token)
    return f"{slots} slots: {steps} steps ({', '.join(graphs)}), slots {layouts}", problems


def _phases(ctx: Context, mode: CUDAGraphMode) -> str:
    """The swap, then (a runner of three slots) the one adapter moved: every step as the
    reference."""
    swap, problems = _serve(ctx, mode, SWAP)
    one, found = _serve(ctx, mode, ONE_MOVES)
    expect_all(problems + found)
    return f"{swap}; {one}: every step as the reference"


def adapter_added_between_decode_steps(ctx: Context) -> str:
    """Two requests decode on adapters 1 and 2, which fill both LoRA slots, in an eager runner
    (graph mode NONE); between two decode steps adapter 3 is added (upstream: add_lora on a
    live engine, vLLM issue #47724): it is activated at once and evicts the least recently
    used adapter, 1, from slot 0. The next step activates the batch's adapters again: 1
    evicts 2 from slot 1, 2 evicts 3 from slot 0, and the slots go from (1, 2) to (2, 1). The
    batch is the same, so its LoRAMapping is the same as the step before. Then a runner of
    three slots, the third free, runs two requests of one token each on adapters 1 and 2
    (their prefill's LoRAMapping is their decode's); between the prefill and the decode
    adapter 1 is added again (loaded already: upstream's worker add_adapter only touches it,
    now the most recently used), adapter 3 takes the free slot and adapter 4 evicts 2, the
    least recently used, from slot 1. The decode reloads 2 over 3 (slot 2): the slots go from
    (1, 2, -) to (1, 4, 2), one adapter's slot changes while the other's stays.

    Fixed: the memo is keyed on the slot layout too; the metadata is refreshed; every step's
    hidden states and logits match the dense float64 reference. Buggy: the memo hits, the
    punica metadata still maps request a to slot 0 and b to slot 1: from that step on each
    request decodes with the other's adapter (wrong result, silent, on both devices); with
    three slots request a stays right and b decodes with adapter 4's weights.
    """
    return _phases(ctx, CUDAGraphMode.NONE)


def adapter_added_between_graph_replays(ctx: Context) -> str:
    """The same hot adds (two slots swapped, then on three slots one adapter moved) with a
    FULL graph of 2 tokens: the prefill runs eagerly, the decode steps replay the graph, whose
    LoRA kernels read the punica metadata in the buffers that set_adapter_mapping refreshes in
    place (or, memoised, does not).

    Fixed: every replay as the reference. Buggy: from the step after the hot add on, the
    replays read the stale slots: each request decodes with the other's adapter, on three
    slots request b with adapter 4's (wrong result, silent, on both devices).
    """
    return _phases(ctx, CUDAGraphMode.FULL)
