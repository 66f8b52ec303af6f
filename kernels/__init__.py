"""Triton kernel families (one per module) with typed launchers, and the CUDA C++ ones of csrc/."""


def require_power_of_two(**sizes: int) -> None:
    """A launcher's refusal of sizes its kernel cannot serve (a tl.arange extent must be a
    power of two): a clear error at the call, never a compile failure at run time."""
    for name, value in sizes.items():
        if value <= 0 or value & (value - 1):
            raise ValueError(f"{name} = {value}: must be a power of two; this kernel cannot serve")
