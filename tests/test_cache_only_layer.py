"""The cache-only layer (extract_hidden_states) and graph padding's slot -1: the mechanism of
vLLM #43810 (fix proposed in #43869), fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.oracle import close
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.extract_hidden_states import CacheOnlyLayer
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner
from harness.runner.sleep_mode import make_pools
from repro.bugs.pad_slot_negative_index.scenarios import (
    POOL,
    PROMPT,
    extract_config,
    serve_and_extract,
)

pytestmark = pytest.mark.pad_slot_negative_index

BUGGY = ALL_FIXES - {Fix.CACHE_ONLY_SKIP_PAD_SLOTS}
SENTINEL = -7.0  # no hidden state: small integers below


def _layer(device, fixes) -> CacheOnlyLayer:
    layer = CacheOnlyLayer(3, 4, 5, torch.float32, make_pools(device), fixes)
    layer.kv_cache.fill_(SENTINEL)
    return layer


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_a_padding_row_writes_nowhere_or_the_last_slot_of_the_last_block(device, fixes) -> None:
    """Rows at slots 6 and -1 (padding): slot 6 is written either way; the padding row is
    skipped (fixed) or lands at block -1, offset 3: slot 11, the pool's last (buggy)."""
    layer = _layer(device, fixes)
    hidden = torch.arange(10, dtype=torch.float32, device=device).view(2, 5)
    slots = torch.tensor([6, -1], device=device)
    layer.forward(hidden, slots, lambda fn, *a, **k: fn(*a, **k))
    cache = layer.kv_cache.view(-1, 5).cpu()
    written = {s for s in range(12) if not (cache[s] == SENTINEL).all()}
    assert cache[6].tolist() == hidden[0].tolist()
    assert written == ({6} if fixes == ALL_FIXES else {6, 11}), written
    if fixes == BUGGY:
        assert cache[11].tolist() == hidden[1].tolist()


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_without_graphs_nothing_is_padded(device, fixes) -> None:
    """Eager steps (graph mode NONE) run the live tokens only: no slot -1, A's extracted
    states match the reference either way (the bug needs a batch padded to a graph's size)."""
    runner = ModelRunner(extract_config(Context(fixes, device), CUDAGraphMode.NONE))
    seq = list(PROMPT)
    seq.append(int(runner.execute_model([Request("A", PROMPT)]).logits[0].argmax()))
    decode = runner.execute_model([Request("A", (seq[-1],), 0, len(PROMPT))])
    kv = runner.kv_cache
    assert decode.desc is None and kv.blocks[0][0][0] == POOL - 1
    slots = [kv.slot(0, 0, p) for p in range(len(seq))]
    reference = step_reference(runner, [Request("ref", tuple(seq))])[0]
    assert close("extracted", runner.cache_only.extract(slots), reference) is None


def test_the_padding_rows_state_replaces_the_last_slots_in_a_graph(device) -> None:
    """Buggy, FULL graph of 4: after A's decode step the pool's last slot (A's position 3)
    holds exactly the state the replay computed for a padding row."""
    runner = ModelRunner(extract_config(Context(BUGGY, device), CUDAGraphMode.FULL))
    runner.capture_model()
    problems = serve_and_extract(runner, "full")
    assert problems[0] is not None and problems[1] is None, problems
    desc = next(iter(runner.cudagraph_manager.graphs))
    padding_rows = runner.cudagraph_manager.outputs[desc][0][1:].cpu()
    last = runner.cache_only.extract([POOL * 4 - 1]).cpu()
    assert (padding_rows == padding_rows[0]).all(), "padding rows differ"
    assert torch.equal(last[0], padding_rows[0])
