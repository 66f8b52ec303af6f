"""Scenarios of lora_slot_memo (vLLM #47725): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config

# request a decodes on adapter 1, b on adapter 2; adapter 3 arrives out of band before ADD_AT
PROMPTS = (("a", (3, 5, 7), 1), ("b", (11, 2), 2))
NEW_TOKENS, ADD_AT, HOT_ADAPTER = 4, 2, 3


def _runner(ctx: Context, mode: CUDAGraphMode) -> ModelRunner:
    """Two slots, both taken (adapters 1 and 2); a FULL graph of 2 tokens (the decode steps'
    size) if asked: the prefill runs eagerly."""
    config = runner_config(
        ctx.device,
        ctx.fixes,
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


def _serve(ctx: Context, mode: CUDAGraphMode) -> str:
    """A prefill step, then decode steps of the same two requests; adapter 3 is added between
    decode steps ADD_AT - 1 and ADD_AT. Every step's hidden states and logits vs the dense
    float64 reference, which reads each request's adapter from its slot now."""
    runner = _runner(ctx, mode)
    manager = runner.lora_manager._adapter_manager
    seqs = {name: list(prompt) for name, prompt, _ in PROMPTS}
    problems, layouts, graphs = [], [], []
    for step in range(NEW_TOKENS):
        if step == ADD_AT:
            runner.add_lora(HOT_ADAPTER, seed=ctx.seed + 10 + HOT_ADAPTER, experts=False)
        starts = {name: 0 if step == 0 else len(seq) - 1 for name, seq in seqs.items()}
        requests = [
            Request(name, tuple(seqs[name][starts[name] :]), lora, starts[name])
            for name, _, lora in PROMPTS
        ]
        out = runner.execute_model(requests)
        layouts.append(tuple(manager.lora_index_to_id))
        graphs.append(f"{out.desc.cg_mode.value} {out.desc.num_tokens}" if out.desc else "eager")
        hidden, logits = step_reference(runner, requests)
        label = f"step {step} ({graphs[-1]}, slots {layouts[-1]})"
        problems += [
            close(f"{label}: hidden states vs reference", out.hidden_states, hidden),
            close(f"{label}: logits vs reference", out.logits, logits),
        ]
        for (name, _, _), token in zip(PROMPTS, logits.argmax(-1).tolist(), strict=True):
            seqs[name].append(token)
    expect_all(problems)
    return f"{NEW_TOKENS} steps ({', '.join(graphs)}), slots {layouts}: every step as reference"


def adapter_added_between_decode_steps(ctx: Context) -> str:
    """Two requests decode on adapters 1 and 2, which fill both LoRA slots, in an eager runner
    (graph mode NONE); between two decode steps adapter 3 is added (upstream: add_lora on a
    live engine, vLLM issue #47724): it is activated at once and evicts the least recently
    used adapter, 1, from slot 0. The next step activates the batch's adapters again: 1
    evicts 2 from slot 1, 2 evicts 3 from slot 0, and the slots go from (1, 2) to (2, 1). The
    batch is the same, so its LoRAMapping is the same as the step before.

    Fixed: the memo is keyed on the slot layout too; the metadata is refreshed; every step's
    hidden states and logits match the dense float64 reference. Buggy: the memo hits, the
    punica metadata still maps request a to slot 0 and b to slot 1: from that step on each
    request decodes with the other's adapter (wrong result, silent, on both devices).
    """
    return _serve(ctx, CUDAGraphMode.NONE)


def adapter_added_between_graph_replays(ctx: Context) -> str:
    """The same hot add with a FULL graph of 2 tokens: the prefill runs eagerly, the decode
    steps replay the graph, whose LoRA kernels read the punica metadata in the buffers that
    set_adapter_mapping refreshes in place (or, memoised, does not).

    Fixed: every replay as the reference. Buggy: from the step after the hot add on, the
    replays read the stale slots: each request decodes with the other's adapter (wrong
    result, silent, on both devices).
    """
    return _serve(ctx, CUDAGraphMode.FULL)
