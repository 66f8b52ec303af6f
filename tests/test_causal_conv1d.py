"""The Mamba causal-conv1d kernel with conv states in slots: outputs and the final state of
chunks of 1 to 4 tokens (the short branch under width - 1 = 3, the long one from 3), from a
cached state read from another slot than the one written and from a fresh start; fixed and
buggy (vLLM #56196: the short branch stored through the slot it read)."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.reference import mixer_reference
from harness.runner.mamba_align import MambaAlignEngine
from kernels.causal_conv1d import STATE_LEN, WIDTH, causal_conv1d, causal_conv1d_reference

pytestmark = pytest.mark.conv_state_short_chunk

DIM, SLOTS, CACHED, OWN = 5, 4, 1, 2  # 5 channels: a masked tail in the kernel's block of 16


def _i32(*values: int, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _run(device: str, n: int, cached: bool, own_block: bool):
    """One chunk of `n` tokens from slot CACHED (or fresh) into slot OWN; every other slot NaN
    (poison: a slot nobody wrote). Returns (outputs, states, the initial state)."""
    gen = torch.Generator().manual_seed(n)
    x, weight = torch.randn(n, DIM, generator=gen), torch.randn(DIM, WIDTH, generator=gen)
    states = torch.full((SLOTS, DIM, STATE_LEN), float("nan"))
    initial = torch.randn(DIM, STATE_LEN, generator=gen) if cached else torch.zeros(DIM, 3)
    states[CACHED] = initial if cached else states[CACHED]
    x, weight, states = x.to(device), weight.to(device), states.to(device)
    out = torch.full_like(x, float("nan"))
    read = CACHED if cached else -1
    causal_conv1d(
        x, weight, states, _i32(0, n, device=device), _i32(read, device=device),
        _i32(OWN, device=device), out, own_block,
    )  # fmt: skip
    expected = causal_conv1d_reference(x, weight, initial)
    return out.cpu(), states.cpu(), initial, expected


@pytest.mark.parametrize("own_block", [True, False], ids=["fixed", "buggy"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "fresh"])
@pytest.mark.parametrize("n", range(1, WIDTH + 1))
def test_a_chunk_stores_its_final_state_in_its_own_slot(device, n, cached, own_block) -> None:
    """Outputs are right on every path (the initial state is read where it is). Fixed, and
    buggy for a chunk of 3 or more or a fresh start: the own slot holds the final state and
    the cached slot is untouched. Buggy, a chunk of 1 or 2 from the cached slot: the final
    state lands in the cached slot and the own slot keeps its poison."""
    out, states, initial, (ref_out, ref_state) = _run(device, n, cached, own_block)
    assert torch.allclose(out.double(), ref_out, atol=1e-5), "the outputs"
    if own_block or n >= STATE_LEN or not cached:
        assert torch.allclose(states[OWN].double(), ref_state, atol=1e-5), "the own slot"
        if cached:
            assert torch.equal(states[CACHED], initial), "the cached slot was written"
    else:
        assert states[OWN].isnan().all(), "the own slot is never written"
        assert torch.allclose(states[CACHED].double(), ref_state, atol=1e-5), "overwritten"
    assert states[0].isnan().all() and states[3].isnan().all(), "a store outside its slot"


def test_a_batch_of_chunks_in_one_launch(device) -> None:
    """Three sequences in one launch (chunks of 1, 4 and 2 tokens, the first two from cached
    slots 0 and 1, the last fresh) into slots 3, 4, 5: each as the reference, alone."""
    gen = torch.Generator().manual_seed(7)
    lens, reads, writes = (1, 4, 2), (0, 1, -1), (3, 4, 5)
    x, weight = torch.randn(sum(lens), DIM, generator=gen), torch.randn(DIM, WIDTH, generator=gen)
    states = torch.full((6, DIM, STATE_LEN), float("nan"))
    states[:2] = torch.randn(2, DIM, STATE_LEN, generator=gen)
    initial = states.clone()
    out = torch.empty_like(x)
    bounds = _i32(0, 1, 5, 7, device=device)
    dev = [t.to(device) for t in (x, weight, states, out)]
    causal_conv1d(
        dev[0], dev[1], dev[2], bounds, _i32(*reads, device=device),
        _i32(*writes, device=device), dev[3],
    )  # fmt: skip
    for i, (start, n) in enumerate(zip((0, 1, 5), lens, strict=True)):
        state = initial[reads[i]] if reads[i] >= 0 else torch.zeros(DIM, STATE_LEN)
        ref_out, ref_state = causal_conv1d_reference(x[start : start + n], weight, state)
        assert torch.allclose(dev[3][start : start + n].cpu().double(), ref_out, atol=1e-5), i
        assert torch.allclose(dev[2][writes[i]].cpu().double(), ref_state, atol=1e-5), i
    assert torch.equal(dev[2][:2].cpu(), initial[:2]), "a cached slot was written"


@pytest.mark.parametrize("fixes", [ALL_FIXES, ALL_FIXES - {Fix.CONV_STATE_OWN_BLOCK}])
def test_a_later_sequence_reads_the_cached_block_as_cached(device, fixes) -> None:
    """The engine: a producer caches its first block of 8 tokens; a consumer resumes there with
    a one-token chunk; a second consumer resumes there too. Buggy: it reads the first
    consumer's conv state (its logits differ)."""
    engine = MambaAlignEngine(device, fixes, block=8, budget=16, eagle=False)
    producer = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]
    engine.prefill({"producer": producer})
    assert engine.prefill({"first": [*producer[:8], 11]})["first"][0] == 8
    second = [*producer[:8], 9, 3, 6, 0]
    hit, logits = engine.prefill({"second": second})["second"]
    same = torch.allclose(
        logits.cpu().double(), mixer_reference(engine.weights, second), rtol=1e-4, atol=1e-4
    )
    assert hit == 8 and same == (Fix.CONV_STATE_OWN_BLOCK in fixes)
