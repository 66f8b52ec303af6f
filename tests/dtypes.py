"""Dtype variants of the kernel tests. The first variant of a family (float32, its cache in
float32) runs on every shape, as before; upstream's float16 and bfloat16 inputs and its fp8 KV
cache run on a CPU subset of the shapes (the interpreter is slow) and on all of them on a GPU
(the `gpu` marker).

Triton's interpreter (3.9) loads, stores and widens all three exactly; narrowing float32 it
rounds float16 as a GPU does, truncates bfloat16 (at most one unit in the last place, inside
every tolerance here), and rounds to e4m3 wrongly (1.9375 -> 1.0: a rounded-up mantissa is not
carried into the exponent; 1.0625 -> 1.125: ties away from even). The inputs are therefore
values every one of these dtypes holds exactly, fp8 cache entries included (small_values); a
GPU-only test rounds arbitrary values to e4m3 (test_paged_attention.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch

from kernels.paged_attention import FP8_KV_CACHE

NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
LORA_DTYPES = [(torch.float32,), (torch.float16,), (torch.bfloat16,)]
# (model dtype, kv_cache_dtype) as upstream names them (test_cache.py, test_attention.py)
KV_DTYPES = [(dtype, cache) for cache in ("auto", "fp8") for dtype in NAMES]
# upstream's fp8 test scales (test_attention.py: k_scale 0.5, v_scale 0.25): powers of two
K_SCALE, V_SCALE = 0.5, 0.25
# float32 as before; float16 and bfloat16 as upstream's Triton attention test
# (test_triton_unified_attention.py: atol 1.5e-2, rtol 1e-2 in bfloat16). An fp8 cache adds no
# error here: the references read the same e4m3 entries times the same scales (upstream's fp8
# tolerance, 1.5e-1 there, covers quantization against the unquantized cache)
ATTENTION_TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1.5e-2),
    torch.bfloat16: dict(rtol=1e-2, atol=1.5e-2),
}


def cases(
    shapes: Sequence[tuple],
    variants: Sequence[tuple],
    cpu: Sequence[int],
    gpu_only: Sequence[tuple] = (),
) -> list:
    """pytest params (*shape, *variant) with ids "<shape>-<variant>": variants[0] on every
    shape of `shapes`; the other variants on the shapes indexed by `cpu` on any device, on the
    rest only on a GPU; every variant of a `gpu_only` shape only on a GPU."""
    params = []
    for i, shape in enumerate([*shapes, *gpu_only]):
        for j, variant in enumerate(variants):
            name = "-".join(NAMES.get(v, str(v)) for v in variant)
            on_cpu = i < len(shapes) and (j == 0 or i in cpu)
            marks = () if on_cpu else pytest.mark.gpu
            params.append(pytest.param(*shape, *variant, id=f"{i}-{name}", marks=marks))
    return params


def collapse_gpu_cases(params: list) -> list:
    """`params` as they are on a GPU run; on a CPU run (TRITON_INTERPRET=1: conftest sets it
    before collection) the gpu-marked ones become one skipped item that says how many, so that
    the CPU job does not collect and skip thousands of upstream cases one by one."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return params
    gpu = [p for p in params if any(m.name == "gpu" for m in p.marks)]
    kept = [p for p in params if p not in gpu]
    if gpu:
        blank = [None] * len(gpu[0].values)
        kept.append(pytest.param(*blank, marks=pytest.mark.gpu, id=f"{len(gpu)}-gpu-cases"))
    return kept


def small_values(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2]: exact in float16 and bfloat16, and in e4m3 after dividing
    by K_SCALE or V_SCALE, so cache writes compare with == in every dtype."""
    return torch.randint(-8, 9, shape, generator=gen) / 4


def kv_cache(values: torch.Tensor, dtype: torch.dtype, cache: str, scale: float) -> torch.Tensor:
    """`values` as a cache holds them: in the model's dtype ("auto"), or values / scale in e4m3
    ("fp8")."""
    return (values / scale).to(FP8_KV_CACHE) if cache == "fp8" else values.to(dtype)


def kv_scales(cache: str, device: str) -> dict[str, torch.Tensor]:
    """The launchers' k_scale and v_scale keywords: an fp8 cache's, as upstream holds them
    (float32 tensors of one element); none for a cache in the model's dtype."""
    if cache != "fp8":
        return {}
    scale = lambda s: torch.tensor([s], dtype=torch.float32, device=device)
    return dict(k_scale=scale(K_SCALE), v_scale=scale(V_SCALE))


def reference_scales(cache: str) -> dict[str, float]:
    """The float64 references' k_scale and v_scale keywords for the same cache."""
    return dict(k_scale=K_SCALE, v_scale=V_SCALE) if cache == "fp8" else {}
