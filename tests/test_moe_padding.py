"""Padding rows of graph replays through the learned gate's MoE (the fixed runner): where they
hold NaN, and where the gate marks them -1 on the live step's count.

The buggy variants fault (the scenarios show it in a child); these tests pin the conditions
the scenarios rely on: a PIECEWISE replay's padding rows are NaN (attention computes the real
tokens only), a FULL replay's are numbers, and with skip-padding the gate reads the real-token
count at every replay, so a padding row's MoE output is exactly 0.
"""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES
from harness.record import Context
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from repro.bugs.moe_pad_nan_topk.scenarios import STEPS, padded_runner


def _padded_hidden(device, mode: CUDAGraphMode, skip_padding: bool) -> list[torch.Tensor]:
    """Each step's hidden states of all 4 rows of the graph (padding included)."""
    runner = padded_runner(Context(ALL_FIXES, device), mode, skip_padding)
    runner.capture_model()
    hidden = []
    for step in STEPS:
        requests = [Request(f"r{row}", (t,), 0, n - 1) for row, (t, n) in enumerate(step)]
        out = runner.execute_model(requests)
        assert out.desc is not None and out.desc.num_tokens == 4, out.desc
        hidden.append(runner.cudagraph_manager.outputs[out.desc][0].cpu().clone())
    return hidden


@pytest.mark.moe_pad_nan_topk
def test_piecewise_padding_rows_are_nan_full_ones_are_not(device) -> None:
    """vLLM #39593's measurement, here by construction: PIECEWISE replays run attention on the
    real tokens, the padding rows keep the poison (NaN) through the layers; FULL graphs attend
    padding tokens as token 0 of row 0: numbers."""
    piecewise = _padded_hidden(device, CUDAGraphMode.PIECEWISE, False)
    for step, hidden in zip(STEPS, piecewise, strict=True):
        real = len(step)
        assert hidden[:real].isfinite().all() and hidden[real:].isnan().all(), hidden
    for hidden in _padded_hidden(device, CUDAGraphMode.FULL, False):
        assert hidden.isfinite().all(), hidden


@pytest.mark.moe_pad_sentinel
@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE])
def test_skip_padding_marks_the_live_steps_padding_rows(device, mode) -> None:
    """With skip-padding the gate marks rows at or past the live step's real-token count -1 (3
    then 2 real tokens in one graph), and the guarded finalize gives them exactly 0."""
    for step, hidden in zip(STEPS, _padded_hidden(device, mode, True), strict=True):
        real = len(step)
        assert hidden[:real].isfinite().all() and (hidden[:real] != 0).any(), hidden
        assert (hidden[real:] == 0).all(), f"{mode.value}, {real} real tokens: {hidden}"
