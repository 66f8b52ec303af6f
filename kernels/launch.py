"""What every launcher shares: the dtypes a kernel serves, and a launcher's refusals of sizes and
dtypes it cannot serve. Importing it installs the interpreter's patches for CPU runs
(kernels.interpret): every kernel module imports it, so the package itself stays free of torch
and Triton (the client of a cuda check imports kernels.csrc and must never pay for torch)."""

from __future__ import annotations

import torch

from kernels import interpret

interpret.install()  # CPU runs: Triton's interpreter without its repeated patches

# The dtypes of upstream's inputs, weights and outputs; every kernel accumulates in float32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require_power_of_two(**sizes: int) -> None:
    """A launcher's refusal of sizes its kernel cannot serve (a tl.arange extent must be a
    power of two): a clear error at the call, never a compile failure at run time."""
    for name, value in sizes.items():
        if value <= 0 or value & (value - 1):
            raise ValueError(f"{name} = {value}: must be a power of two; this kernel cannot serve")


def require_dtype(allowed: tuple[torch.dtype, ...], **tensors: torch.Tensor) -> None:
    """A launcher's refusal of tensors in a dtype its kernel does not serve, naming them."""
    for name, tensor in tensors.items():
        if tensor.dtype not in allowed:
            raise ValueError(f"{name}: {tensor.dtype}; this kernel serves {allowed}")
