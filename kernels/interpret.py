"""Triton's interpreter (every CPU run) without its largest overhead.

The interpreter re-patches `triton.language` on every call of a @triton.jit helper: tl.sum,
tl.max and tl.zeros are such helpers, as are the project's own (attend_positions, _lora_rows).
Each patch walks the language's modules with inspect.getmembers, about a millisecond; a
scenario makes thousands of such calls, and measured on lora_graph_capture's full_graphs the
patching was a third of its time (cProfile: 6.2 s of 17 s, 6112 patches).

Within one launch the patch is idempotent: the launch patches the modules its kernel sees and
undoes that at its end, and a helper's patch (never undone, Triton's own behaviour) leaves its
modules patched until then. `install()` skips a helper's patch when every module it would patch
was already patched in the same launch. The same code runs on the same values: only the
repeated walks go (tests/test_interpret.py checks equal results and the count of patches).

Two more of its costs go, neither changing a value:
- Integer overflow checks. The interpreter computes one for every int32 add, sub and mul (a cast
  to int64, the operation again, two compares: six interpreted operations), then drops it: its
  device_assert does nothing without `debug`, and its options never have `debug`, TRITON_DEBUG
  or not. Compiled Triton without debug drops the check too (int32 wraps). `install()` turns the
  computation off (measured: a sixth of lora_graph_capture's kernel time).
- The numpy dtype of a Triton type, looked up by building a dict of 19 types per call; it is
  memoized per scalar type (a block's is its element's, as in the lookup).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import triton.language as tl


class _Kept:
    """A skipped patch's scope: there is nothing of its own to undo."""

    def restore(self) -> None:
        pass


_undo: list[Callable[[], None]] = []  # how to put Triton's functions back, while installed


def install() -> bool:
    """Skip the repeated patches (idempotent). False: this Triton's interpreter is not the one
    this was written for, and nothing was changed."""
    if _undo:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None:
        return False
    launch = executor.__call__
    patched: list[set[int]] = []  # per running launch: the modules already patched in it

    def run_launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs and langs <= patched[-1]:
            return _Kept()
        scope = patch(fn)
        if patched:
            patched[-1] |= langs
        return scope

    def undo() -> None:
        interpreter._patch_lang, executor.__call__ = patch, launch

    interpreter._patch_lang, executor.__call__ = patch_once, run_launch
    _undo.append(undo)
    _skip_dropped_overflow_checks(interpreter)
    _memoize_np_dtype(interpreter)
    return True


def _skip_dropped_overflow_checks(interpreter) -> None:
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not getattr(options, "sanitize_overflow", False):
        return
    if getattr(options, "debug", True):  # its checks would assert: keep them
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)

    def undo() -> None:
        builder.options = options

    _undo.append(undo)


def _memoize_np_dtype(interpreter) -> None:
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):  # unhashable; pointers are uint64 addresses
            return lookup(scalar)
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = lookup(scalar)
            return found

    def undo() -> None:
        interpreter._get_np_dtype = lookup

    interpreter._get_np_dtype = np_dtype
    _undo.append(undo)


def uninstall() -> None:
    """Triton's interpreter as shipped (tests compare the two)."""
    while _undo:
        _undo.pop()()
