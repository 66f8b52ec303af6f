"""Upstream's LoRA shrink/expand kernel test as a regression test of the project's launchers.

Source: vLLM's tests/lora/test_punica_ops.py (data built by generate_data_for_nslices in
tests/lora/utils.py); the test is written here. Upstream runs two test functions over the same
axes, each crossing op (shrink, expand) x dtype (float16, bfloat16) x nslices (1, 2, 3):
- test_kernels (varies everything but the hidden size): hidden 2049; batches 1, 4, 16, 32;
  num_loras 1, 8, 32, 128; ranks 1, 4, 8, 16, 32, 64, 128, 256: 4 * 4 * 8 * 12 = 1536 cases;
- test_kernels_hidden_size: batches 4, num_loras 4, rank 32, over the hidden sizes of the models
  vLLM serves (74 sizes) divided by the tensor-parallel sizes 1, 2, 8, 16 and 64 (floor
  division, duplicates merged): 228 sizes from 2 to 128256, * 12 = 2736 cases.
Here the same two functions over the same products: 4272 cases, a GPU runs all of them; the
interpreter runs the four in CPU_CASES. Upstream's other axes are single values: seed 0 (here
torch.Generators seeded 0: upstream's distributions, not its draws), one device (the `device`
fixture), sequence length 128 (every batch entry is 128 tokens), scaling 0.5, expand with
add_inputs=True at offset_start 0 (the project's expand always accumulates into y at column 0;
upstream never tests otherwise), and the unspecialised launch (specialize_active_lora=False, the
launchers' default).

Upstream's data, kept: uniform [0, 1) inputs, weights and (expand) y in the test's dtype; each
batch entry maps to one LoRA drawn from [0, num_loras - 1), 0 when num_loras is 1 (the last slot
is never drawn; no token is without a LoRA); metadata for max_loras = num_loras and exactly the
batch's tokens; the shrink writes a float32 buffer [nslices, tokens, rank]; the expand reads a
buffer in the test's dtype. Upstream passes one weight tensor per slice; the project's launchers
take them stacked on a leading slice axis (lora_a [nslices, loras, rank, hidden], lora_b
[nslices, loras, hidden, rank]): the same values, no layout is left out.

Upstream's assertion (utils.py assert_close), kept: rtol = atol by the compared tensor's dtype,
1e-2 for the shrink's float32 buffer, 6e-2 for the expand's float16/bfloat16 y (loose: an expand
whose buffer is scaled by 1.05 passes it; one that reads the wrong LoRA fails). Changed: the
reference is float64 on the test's device (upstream's multiplies in the output's dtype on the
CPU); the shrink's buffer starts as NaN, not zeros (every token has a LoRA, so every row must be
written; the project's shrink stores, it never accumulates). The interpreter stores bfloat16 by
truncation (tests/dtypes.py): one unit in the last place, far inside 6e-2, so the CPU cases keep
upstream's random inputs.

Not verified: "216 upstream cases" from an earlier measurement; upstream's file at both stored
commits read (046d2b1f, 81d92e04) collects 4272 kernel cases, and 216 is not a sub-product of
its axes. Not ported: its test_add_lora_fused_moe_early_exit (PunicaWrapperGPU; the project's
early exit is test_lora_ops.py::test_no_lora_flag_returns_before_launching) and its three CPU
tests of torch_ops' bgmv references (no project counterpart)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.lora_ops import lora_expand, lora_shrink
from tests.dtypes import NAMES, collapse_gpu_cases
from tests.test_lora_ops import make_meta

SEED, SEQ_LEN, SCALE = 0, 128, 0.5
OPS, DTYPES, NSLICES = ("shrink", "expand"), (torch.float16, torch.bfloat16), (1, 2, 3)
# upstream's assert_close: rtol = atol, keyed by the dtype of the tensor the kernel wrote
TOLERANCE = {torch.float32: 1e-2, torch.float16: 6e-2, torch.bfloat16: 6e-2}

MODEL_HIDDEN_SIZES = (
    *(128, 256, 512, 896, 1024, 1152, 1216, 1280, 1536, 1664, 2048, 2240, 2304, 2368, 2432),
    *(2560, 2752, 3072, 3328, 3456, 3584, 3712, 4096, 4480, 4608, 4736, 4864, 5120, 5504),
    *(5632, 5888, 6144, 6400, 6848, 6912, 7168, 7424, 8192, 8960, 9216, 9472, 10240, 11008),
    *(11264, 13824, 14336, 14784, 14848, 15360, 18944, 22016, 22528, 24576, 27392, 27648),
    *(29568, 29696, 32000, 32256, 32512, 32768, 33024, 36864, 43264, 49152, 49408, 60544),
    *(60672, 64000, 64256, 102400, 102656, 128000, 128256),
)
TP_SIZES = (1, 2, 8, 16, 64)
# (batches, num_loras, ranks, hidden sizes) of each upstream test function
VARIATION = ((1, 4, 16, 32), (1, 8, 32, 128), (1, 4, 8, 16, 32, 64, 128, 256), (2049,))
HIDDEN_SWEEP = ((4,), (4,), (32,), sorted({h // tp for h in MODEL_HIDDEN_SIZES for tp in TP_SIZES}))
ARGS = ("op", "dtype", "nslices", "batches", "num_loras", "rank", "hidden")
# The interpreter's cases (a second or so each; an expand at hidden 2049 takes 3 s and more):
# ranks 4 and 32 (below and above the 16-wide block), both dtypes and ops, 1 to 3 slices, one
# LoRA and two, hidden sizes that are not multiples of 16, one below the 32-wide k block
CPU_CASES = {
    ("shrink", torch.float16, 1, 1, 1, 4, 2049),
    ("shrink", torch.bfloat16, 2, 4, 4, 32, 26),
    ("expand", torch.float16, 3, 4, 4, 32, 14),
    ("expand", torch.bfloat16, 1, 4, 4, 32, 2),
}


def _cases(axes: tuple) -> list:
    """pytest params of OPS x DTYPES x NSLICES x axes; those outside CPU_CASES marked gpu (on a
    CPU run, one skipped item for them all)."""
    params = []
    for case in itertools.product(OPS, DTYPES, NSLICES, *axes):
        op, dtype, nslices, batches, loras, rank, hidden = case
        name = f"{op}-{NAMES[dtype]}-s{nslices}-b{batches}-l{loras}-r{rank}-h{hidden}"
        marks = () if case in CPU_CASES else pytest.mark.gpu
        params.append(pytest.param(*case, id=name, marks=marks))
    return collapse_gpu_cases(params)


def _shrink_reference(x, lora_a, slots, scale: float) -> torch.Tensor:
    """[nslices, tokens, rank] float64: scale * x[t] @ lora_a[s, slot(t)].T, one LoRA at a time."""
    nslices, _, rank, _ = lora_a.shape
    out = torch.zeros(nslices, x.shape[0], rank, dtype=torch.float64, device=x.device)
    for lora in slots.unique().tolist():
        rows = slots == lora
        out[:, rows] = scale * (x[rows].double() @ lora_a[:, lora].double().transpose(1, 2))
    return out


def _expand_reference(y, buffer, lora_b, slots) -> torch.Tensor:
    """y + buffer[s, t] @ lora_b[s, slot(t)].T in the columns of slice s, float64."""
    out = y.double()
    for lora in slots.unique().tolist():
        rows = slots == lora
        delta = torch.bmm(buffer[:, rows].double(), lora_b[:, lora].double().transpose(1, 2))
        out[rows] += delta.permute(1, 0, 2).reshape(int(rows.sum()), -1)
    return out


def _check(device, op, dtype, nslices, batches, num_loras, rank, hidden) -> None:
    if device == "cuda":  # the earlier cases' sizes (228 of them) fragment the cache: tens of GB
        torch.cuda.empty_cache()
    gen = torch.Generator(device=device).manual_seed(SEED)
    rand = lambda *shape: torch.rand(shape, generator=gen, device=device, dtype=dtype)
    # one LoRA per batch entry, upstream's draw (the last slot never drawn), 128 tokens each
    per_entry = torch.randint(
        0, max(num_loras - 1, 1), (batches,), generator=torch.Generator().manual_seed(SEED)
    )
    slots = per_entry.repeat_interleave(SEQ_LEN)
    meta = make_meta(slots.tolist(), num_loras, device)
    slots, tokens = slots.to(device), batches * SEQ_LEN
    if op == "shrink":
        x, lora_a = rand(tokens, hidden), rand(nslices, num_loras, rank, hidden)
        out = torch.full((nslices, tokens, rank), float("nan"), device=device)
        lora_shrink(x, lora_a, out, meta, SCALE)
        expected = _shrink_reference(x, lora_a, slots, SCALE)
    else:
        buffer, lora_b = rand(nslices, tokens, rank), rand(nslices, num_loras, hidden, rank)
        y = rand(tokens, nslices * hidden)
        out = y.clone()
        lora_expand(buffer, lora_b, out, meta)
        expected = _expand_reference(y, buffer, lora_b, slots)
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(ARGS, _cases(VARIATION))
def test_kernels(device, op, dtype, nslices, batches, num_loras, rank, hidden) -> None:
    _check(device, op, dtype, nslices, batches, num_loras, rank, hidden)


@pytest.mark.parametrize(ARGS, _cases(HIDDEN_SWEEP))
def test_kernels_hidden_size(device, op, dtype, nslices, batches, num_loras, rank, hidden):
    _check(device, op, dtype, nslices, batches, num_loras, rank, hidden)


def test_cpu_cases_are_upstream_cases() -> None:
    """Each interpreter case is one of upstream's (a typo would silently drop it)."""
    upstream = {
        case
        for axes in (VARIATION, HIDDEN_SWEEP)
        for case in itertools.product(OPS, DTYPES, NSLICES, *axes)
    }
    assert len(upstream) == 4272 and CPU_CASES.issubset(upstream)
