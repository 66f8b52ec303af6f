"""Scenarios of lora_graph_capture (vLLM #43314): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.record import Context
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model_runner import ModelRunner
from repro.bugs.lora_dummy_run.scenarios import (  # noqa: F401 (the capture orderings: both bugs')
    capture_after_base_batch,
    capture_and_check,
    capture_without_dummy_run,
)


def _warm_up(runner: ModelRunner) -> None:
    runner.execute_model(dummy_run=True, num_tokens=16, num_reqs=4)


def full_graphs(ctx: Context) -> str:
    """A server's start, in its order: LoRA enabled, no adapter loaded yet; the warm-up dummy
    run, then FULL capture (4, 8 tokens); only then are adapters 1 and 2 added (their weights
    into the slots the graphs read), and real LoRA batches replay.

    Batches, in a row, one per graph: all tokens on adapter 1; base + adapter 1 + adapter 2;
    adapter 2 and base. Each: replay vs the dense float64 reference (and vs eager where they
    differ), hidden states of every token and the logits of every request (LM-head LoRA
    through the prompt mapping). Fixed: the capture hook makes every LoRA kernel launch, whatever
    is loaded: all match. Buggy: the all-(-1) dummy mapping set no_lora_flag_cpu, the host
    wrappers returned during capture, replays miss every LoRA delta (wrong result) and the
    graphs hold no LoRA kernel. Also fails a fix that forces the launch only while an adapter is
    loaded at capture. With lora_dummy_mapping off too, the warm-up dummy run already fails
    with the device-side assert of lora_dummy_run. (The other scenarios load the adapters
    before they capture.)
    """
    return capture_and_check(ctx, _warm_up, adapters_after=True, cudagraph_mode=CUDAGraphMode.FULL)


def piecewise_graphs(ctx: Context) -> str:
    """The same as full_graphs with PIECEWISE graphs: attention runs eagerly between the
    captured pieces, the LoRA kernels live inside them. Buggy: they are missing from every
    piece as well (the report names PIECEWISE graphs too): wrong result."""
    return capture_and_check(ctx, _warm_up, cudagraph_mode=CUDAGraphMode.PIECEWISE)


def specialized_graphs(ctx: Context) -> str:
    """FULL graphs of 8 tokens per active-LoRA count (specialize_active_lora): the kernels
    launch num_active_loras_cpu LoRA programs, and a batch replays the graph of its count (its
    adapters plus one for the base model: 2 or 3). One size: the sizes are full_graphs' concern
    (a second size doubled this scenario's capture, 2026-11-29). Fixed: the capture hook sets
    each active meta to the case's count; all match. Buggy: no_lora_flag_cpu set, nothing
    captured: wrong result. A fix that clears the flag but leaves num_active_loras_cpu at 0
    fails here too: zero LoRA programs are captured."""
    return capture_and_check(
        ctx,
        _warm_up,
        cudagraph_mode=CUDAGraphMode.FULL,
        specialize_active_lora=True,
        cudagraph_sizes=(8,),
    )
