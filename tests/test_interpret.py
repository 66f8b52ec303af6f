"""kernels.interpret: Triton's interpreter without its repeated patches gives the same values,
and patches each module once per launch instead of once per helper call. Runs where Triton
interprets (CPU runs); skipped where it compiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import interpret

interpreter = pytest.importorskip("triton.runtime.interpreter")
if not isinstance(tl.sum, interpreter.InterpretedFunction):
    pytest.skip("Triton was imported to compile (TRITON_INTERPRET unset)", allow_module_level=True)

ROWS, TILES, COLS = 3, 4, 8


@triton.jit
def _scaled_max(x, scale):
    return tl.max(x, axis=0) * scale


@triton.jit
def _rows(x_ptr, out_ptr, COLS: tl.constexpr, TILES: tl.constexpr):
    """Per program (a row), over its tiles: the sum of each tile's doubled max and its sum;
    helpers (tl.zeros, tl.sum, tl.max, and _scaled_max of this file) called in a loop."""
    r = tl.program_id(0)
    acc = tl.zeros([], tl.float32)
    for i in range(TILES):
        tile = tl.load(x_ptr + (r * TILES + i) * COLS + tl.arange(0, COLS))
        acc += _scaled_max(tile, 2.0) + tl.sum(tile, axis=0)
    tl.store(out_ptr + r, acc)


def _launch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, TILES, COLS, generator=torch.Generator().manual_seed(0))
    out = torch.full((ROWS,), float("nan"))
    _rows[(ROWS,)](x, out, COLS=COLS, TILES=TILES)
    return out, (x.amax(-1) * 2 + x.sum(-1)).sum(-1)


def _counted_launch(calls: list[str]) -> torch.Tensor:
    calls.clear()
    out, expected = _launch()
    torch.testing.assert_close(out, expected)
    return out


def test_same_values_with_one_patch_per_module_per_launch() -> None:
    assert interpret.install(), "kernels.interpret does not fit this Triton's interpreter"
    calls: list[str] = []
    interpret.uninstall()
    original = interpreter._patch_lang
    interpreter._patch_lang = lambda fn: calls.append(fn.__name__) or original(fn)
    try:
        shipped = _counted_launch(calls)
        shipped_patches = len(calls)
        interpret.install()  # over the counting patch
        fast = _counted_launch(calls)
        fast_patches = len(calls)
    finally:
        interpret.uninstall()
        interpreter._patch_lang = original
        interpret.install()
    assert torch.equal(shipped, fast)
    # shipped: the launch, then per program tl.zeros and per tile _scaled_max, tl.max, tl.sum
    assert shipped_patches == 1 + ROWS * (1 + TILES * 3)
    # the launch (its kernel sees tl), the first helper that sees tl.core (standard.py's)
    assert fast_patches == 2, calls


def test_install_is_idempotent_and_uninstall_restores() -> None:
    assert interpret.install() and interpret.install()
    installed, walk = interpreter._patch_lang, interpreter._patch_builtin
    interpret.uninstall()
    try:
        assert interpreter._patch_lang is not installed
        assert interpreter._patch_builtin is not walk
        out, expected = _launch()
        torch.testing.assert_close(out, expected)
    finally:
        interpret.install()
    assert interpreter._patch_lang is not installed  # a fresh closure, same behaviour


@triton.jit
def _wrap_and_copy(ints_ptr, out_ptr, x_ptr, y_ptr, N: tl.constexpr):
    """int32 arithmetic that overflows (it wraps, as compiled Triton's does without debug), and
    a copy through the load and store of x's dtype."""
    i = tl.arange(0, N)
    v = tl.load(ints_ptr + i)
    tl.store(out_ptr + i, v * 3 + 2_000_000_000 - v)
    tl.store(y_ptr + i, tl.load(x_ptr + i))


def _wrapped(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ints = torch.tensor([0, 1, 2**30, -(2**31), 2**31 - 1, 7, -5, 123456789], dtype=torch.int32)
    x = torch.linspace(-3, 3, ints.numel()).to(dtype)
    out, y = torch.zeros_like(ints), torch.zeros_like(x)
    _wrap_and_copy[(1,)](ints, out, x, y, N=ints.numel())
    return out, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_overflow_checks_off_and_dtype_memo_keep_values(dtype: torch.dtype) -> None:
    builder = interpreter.interpreter_builder
    interpret.uninstall()
    try:
        assert builder.options.sanitize_overflow and not builder.options.debug
        shipped = _wrapped(dtype)
        interpret.install()
        assert not builder.options.sanitize_overflow, "the dropped checks are still computed"
        fast = _wrapped(dtype)
    finally:
        interpret.install()
    ints = torch.tensor([0, 1, 2**30, -(2**31), 2**31 - 1, 7, -5, 123456789], dtype=torch.int64)
    wrapped = (ints * 2 + 2_000_000_000 + 2**31) % 2**32 - 2**31  # int32 two's complement
    assert torch.equal(shipped[0], wrapped.to(torch.int32))
    assert torch.equal(fast[0], shipped[0]) and torch.equal(fast[1].float(), shipped[1].float())
    interpret.uninstall()
    assert builder.options.sanitize_overflow, "uninstall did not restore the options"
    interpret.install()


@triton.jit
def _broadcasts(x_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr):
    """Operands of one type, a scalar and a block, [N, 1] and [1, M], int and float mixed."""
    rows, cols = tl.arange(0, N), tl.arange(0, M)
    x = tl.load(x_ptr + rows[:, None] * M + cols[None, :])
    y = x + x * 2.0 - rows[:, None] + cols[None, :] * tl.program_id(0)
    z = tl.where(y > 0, y, -y)[None, :, :] + tl.sum(x, axis=1)[None, :, None]
    tl.store(out_ptr + rows[:, None] * M + cols[None, :], tl.sum(z, axis=0))


def _broadcast_launch() -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = torch.full_like(x, float("nan"))
    _broadcasts[(1,)](x, out, N=4, M=8)
    return out


def test_interned_block_types_keep_values_and_equality() -> None:
    interpret.uninstall()
    try:
        shipped = _broadcast_launch()
        made = tl.block_type(tl.float32, [16, 8])
        assert made is not tl.block_type(tl.float32, [16, 8]), "uninstall left types interned"
        interpret.install()
        fast = _broadcast_launch()
        one = tl.block_type(tl.float32, [16, 8])
        assert one is tl.block_type(tl.float32, [tl.constexpr(16), 8])
        assert one is one.with_element_ty(tl.float32) and one == made and made == one
        assert one is not tl.block_type(tl.float16, [16, 8])
        assert one is not tl.block_type(tl.float32, [8, 16])
        pointers = [tl.pointer_type(tl.float32), tl.pointer_type(tl.float32, const=True)]
        assert tl.block_type(pointers[0], [4]) is not tl.block_type(pointers[1], [4])
        assert tl.block_type(pointers[0], [4]) != tl.block_type(pointers[1], [4])
    finally:
        interpret.install()
    assert torch.equal(shipped, fast)


def test_a_broadcast_seen_once_is_replayed_with_the_same_values() -> None:
    """A pair of operand types broadcast once is broadcast again from its plan (the same
    builder calls on the same handles), not through Triton's shape logic: a second launch of
    the same kernel (its pointer arguments' types made anew, equal to the first's) asks
    Triton's broadcast nothing and stores the same values."""
    from triton.language.semantic import TritonSemantic

    interpret.uninstall()
    shipped_broadcast, asked = TritonSemantic.broadcast_impl_value, []

    def counted(self, lhs, rhs):
        asked.append((lhs.type, rhs.type))
        return shipped_broadcast(self, lhs, rhs)

    try:
        shipped = _broadcast_launch()
        TritonSemantic.broadcast_impl_value = counted
        interpret.install()  # over the counting broadcast
        first = _broadcast_launch()
        first_asked = len(asked)
        again = _broadcast_launch()
    finally:
        interpret.uninstall()
        TritonSemantic.broadcast_impl_value = shipped_broadcast
        interpret.install()
    assert first_asked > 0 and len(asked) == first_asked, asked[first_asked:]
    assert torch.equal(first, shipped) and torch.equal(again, shipped)


@triton.jit
def _unsigned_plus(out_ptr, K: tl.constexpr):
    i = tl.arange(0, 4).to(tl.uint32)
    tl.store(out_ptr + tl.arange(0, 4), (i + K).to(tl.int32))


def test_a_numbers_range_is_checked_each_time_its_types_were_seen() -> None:
    """An operation of a tensor and a Python number is type-checked once per pair of types
    (the number's by its value), but the number's own checks stay each time's: -1 added to
    an unsigned tensor fails as Triton fails it, after 3 was added."""
    assert interpret.install()
    out = torch.zeros(4, dtype=torch.int32)
    _unsigned_plus[(1,)](out, K=3)
    assert out.tolist() == [3, 4, 5, 6]
    with pytest.raises(Exception, match="unsigned tensor and a negative scalar"):
        _unsigned_plus[(1,)](out, K=-1)


def test_the_compiler_keeps_the_shipped_type_layer() -> None:
    """Without TRITON_INTERPRET (GPU runs) the type layer, which the compiler uses, is Triton's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = "import triton.language as tl, kernels; print('__new__' in vars(tl.core.block_type))"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    assert "__new__" in vars(tl.core.block_type)  # this process interprets: interned


@triton.jit
def _stray(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    """Reads the 4 ints past x's N and writes 99 over them; copies y[0] to y[1] (one storage
    with x when y is a view of it)."""
    past = N + tl.arange(0, 4)
    tl.store(out_ptr + tl.arange(0, 4), tl.load(x_ptr + past))
    tl.store(x_ptr + past, tl.full([4], 99, tl.int32))
    tl.store(y_ptr + 1, tl.load(y_ptr))


def test_a_stray_access_past_a_small_tensor_reads_poison_and_writes_nothing() -> None:
    """As on a GPU, where memory past a small tensor is its allocator segment's: a kernel that
    strays a few elements out reads garbage (poison here, every run) and its stores there hit
    nothing the program owns. Views of one storage stay one memory within the launch."""
    assert interpret.install()
    base = torch.arange(8, dtype=torch.int32)
    x, y, out = base[:4], base[4:], torch.zeros(4, dtype=torch.int32)
    _stray[(1,)](x, y, out, N=8)  # past the whole storage (x's storage is base's, 8 ints)
    poison = int.from_bytes(bytes([interpret.POISON_BYTE] * 4), "little", signed=True)
    assert out.tolist() == [poison] * 4
    assert base.tolist() == [0, 1, 2, 3, 4, 4, 6, 7], "the stores past it land nowhere; y[1]=y[0]"
    big = torch.zeros(interpret.LARGE // 4 + 8, dtype=torch.int32)  # a pool: run in place
    _stray[(1,)](big[:4], big[4:], out, N=4)
    assert big[4:8].tolist() == [99, 99, 99, 99] and out.tolist() == [0, 0, 0, 0]


FORK_AFTER_A_LAUNCH = """
import os, signal, torch
from kernels import launch, interpret
from tests.test_interpret import _stray
base, out = torch.arange(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
_stray[(1,)](base[:4], base[4:], out, N=8)
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    torch.zeros(1 << 20).fill_(3)  # large enough for torch's parallel path
    os._exit(0)
print(os.waitpid(pid, 0)[1])
"""


def test_a_launch_leaves_a_process_that_can_still_fork() -> None:
    """The isolator forks children from processes that ran kernels. Had the slack's copies gone
    through torch's parallel path, their OpenMP threads would hang every forked child's first
    parallel op (the first version did, with 64 KiB of slack)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_A_LAUNCH], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stdout + done.stderr
