"""The speculator's draft prefill and its persistent last_token_indices: the mechanism of vLLM
#39773, fixed and buggy. (A buggy gather past the hidden states is left to the scenario, in a
child: on a GPU its device-side assert would end this process's CUDA context.)"""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.record import Context
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import InputBuffers, Request
from harness.runner.model_runner import ModelRunner, updated
from harness.runner.speculator import DraftPrefill
from repro.bugs.spec_stale_pad_tail.scenarios import PROMPTS, checked_step, spec_config

pytestmark = pytest.mark.spec_stale_pad_tail

BUGGY = ALL_FIXES - {Fix.SPEC_PAD_LAST_TOKEN_INDICES}
HIDDEN, VOCAB = 3, 5


def _draft(device, fixes) -> DraftPrefill:
    head = torch.arange(VOCAB * HIDDEN, dtype=torch.float32, device=device).view(VOCAB, HIDDEN)
    return DraftPrefill(4, head % 3 - 1, device, fixes)


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_the_entries_past_the_live_requests_are_padded_or_stale(device, fixes) -> None:
    """3 requests of 4, 3 and 4 tokens, then 1 request of 1 token padded to 4 requests: the
    entries past it are 0 (fixed) or step 1's last-token indices 6 and 10 (buggy)."""
    buffers, draft = InputBuffers(16, 4, device), _draft(device, fixes)
    draft.prepare(buffers.prepare([Request(f"r{i}", p) for i, p in enumerate(PROMPTS)], 11, 3))
    assert draft.last_token_indices.tolist() == [3, 6, 10, 0]
    draft.prepare(buffers.prepare([Request("r0", (1,), 0, 4)], 4, 4))
    stale = [0, 0, 0, 0] if fixes == ALL_FIXES else [0, 6, 10, 0]
    assert draft.last_token_indices.tolist() == stale


def test_the_gather_reads_the_padded_requests_rows(device) -> None:
    """Fixed: a graph's 4 padded requests gather rows 3, 0, 0, 0: exact draft logits."""
    buffers, draft = InputBuffers(16, 4, device), _draft(device, ALL_FIXES)
    draft.prepare(buffers.prepare([Request("r0", (1, 2, 3, 4))], 4, 4))
    hidden = torch.arange(12, dtype=torch.float32, device=device).view(4, HIDDEN)
    draft.forward(hidden, 4, lambda fn, *a, **k: fn(*a, **k))
    rows = hidden[torch.tensor([3, 0, 0, 0], device=device)]
    assert torch.equal(draft.draft_logits[:4], rows @ draft.lm_head.T)


def test_a_piecewise_replay_gathers_the_live_requests_only(device) -> None:
    """Buggy, PIECEWISE (upstream: the prefill's gather runs eagerly on the live requests):
    after the larger step the stale entries stay, but nothing reads them: as the reference."""
    config = updated(spec_config(Context(BUGGY, device)), cudagraph_mode=CUDAGraphMode.PIECEWISE)
    runner = ModelRunner(config)
    runner.capture_model()
    first = [Request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    out, problems = checked_step(runner, first, "step 1")
    for row in (1, 2):
        runner.kv_cache.free(row)
    decode = [Request("r0", (int(out.logits[0].argmax()),), 0, len(PROMPTS[0]))]
    out, found = checked_step(runner, decode, "step 2")
    assert out.desc is not None and out.desc.cg_mode == CUDAGraphMode.PIECEWISE, out.desc
    assert not any(problems + found), problems + found
    # entries 1-2 stale from step 1; entry 3 the capture's dummy batch (4 tokens, 4 requests)
    assert runner.speculator.last_token_indices.tolist() == [0, 6, 10, 3]
