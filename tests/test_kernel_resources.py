"""Resource limits seen without a GPU: every Triton kernel compiled ahead of time for sm_90 and
sm_80 at the largest and boundary shapes of its domain (kernels/resources.py) fits the shared
memory of an H100 and an A100; the check catches the one-hot tile the H100 refused; launchers
refuse sizes their kernels cannot serve with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness.isolate import ROOT
from kernels.fused_moe_lora import fused_moe_lora_shrink
from kernels.paged_attention import paged_attention

OLD_TILE = """
from kernels import resources
with resources.recorded_launches() as launches:
    resources._align(100, 6, 64, 2)  # upstream's 600 pairs over 64 experts: the small path
kernel, args, kwargs = launches[0]
kwargs = {**kwargs, "CHUNK": 1024}  # the untiled [next_pow2(600), 64] one-hot of before
print(kernel.__name__, resources.compile_launch(kernel, args, kwargs, 90).metadata.shared)
"""


def _compiled(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def cpu_only(device) -> None:
    if device == "cuda":
        pytest.skip("the CPU CI's check: on a GPU the kernels compile for real")


@pytest.mark.parametrize("arch", [90, 80], ids=["sm_90", "sm_80"])
def test_every_kernel_fits_the_target_at_its_largest_shapes(cpu_only, arch) -> None:
    done = _compiled(["-m", "kernels.resources", "--arch", str(arch)])
    assert done.returncode == 0, done.stdout + done.stderr
    for kernel in (
        "_small_batch_kernel",
        "_align_kernel",
        "_fused_moe_lora_kernel",
        "_lora_shrink_kernel",
        "_paged_attention_kernel",
        "_split_kv_kernel",
        "_combine_kernel",
        "_gather_block_tables_kernel",
    ):
        assert kernel in done.stdout, f"{kernel} not compiled:\n{done.stdout}"


@pytest.mark.moe_align_grid
def test_the_check_sees_the_tile_the_h100_refused(cpu_only) -> None:
    done = _compiled(["-c", OLD_TILE])
    assert done.returncode == 0, done.stderr
    name, shared = done.stdout.split()[-2:]
    assert name == "_small_batch_kernel" and int(shared) == 262144  # the H100's error's figure


def test_launchers_refuse_sizes_their_kernels_cannot_serve(device) -> None:
    """Head sizes, LoRA ranks and split-KV part counts are all served (their blocks padded and
    masked); refused: a MoE-LoRA align block below tl.dot's 16, grouped heads that do not
    divide the query heads."""
    i32 = dict(dtype=torch.int32, device=device)
    q = torch.zeros(2, 6, 16, device=device)
    cache = torch.zeros(1, 4, 4, 16, device=device)
    table, rows = torch.zeros(2, 1, **i32), torch.zeros(2, **i32)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="num_heads = 6 is not a multiple of num_kv_heads = 4"):
        paged_attention(q, cache, cache, table, rows, positions, q, 1.0, 4)
    x, lora_a = torch.zeros(3, 32, device=device), torch.zeros(1, 2, 4, 32, device=device)
    align = (torch.zeros(1, 24, **i32), torch.zeros(1, 3, **i32), torch.zeros(1, **i32))
    ids = torch.zeros(2, **i32)
    with pytest.raises(ValueError, match=r"block_size = 8: tl\.dot needs M >= 16"):
        fused_moe_lora_shrink(
            x, lora_a, *align, ids, ids, torch.zeros(3, 4, device=device), top_k=1, block_size=8
        )
