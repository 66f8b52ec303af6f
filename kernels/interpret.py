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
"""

from __future__ import annotations

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
    return True


def uninstall() -> None:
    """Triton's interpreter as shipped (tests compare the two)."""
    while _undo:
        _undo.pop()()
