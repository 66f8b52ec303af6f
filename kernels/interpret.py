"""Triton's interpreter (every CPU run) without its largest overhead, and with a GPU's slack
around small tensors.

A kernel that strays a few elements past a small tensor reads and writes its GPU allocator
segment silently; on the CPU the same stores corrupted the host's heap, and a run crashed or
did not. Each launch runs on copies of its small CPU tensors' storages with poison on both
sides (`_with_slack`, 8 KiB); what the kernel wrote through a copy is written back after it.
A wild address still faults (SIGSEGV, illegal_address), as on a GPU.

The interpreter re-patches `triton.language` on every call of a @triton.jit helper: tl.sum,
tl.max and tl.zeros are such helpers, as are the project's own (attend_positions, _lora_rows).
Each patch walks the language's modules with inspect.getmembers, about a millisecond; a
scenario makes thousands of such calls, and measured on lora_graph_capture's full_graphs the
patching was a third of its time (cProfile: 6.2 s of 17 s, 6112 patches).

The patch is idempotent: a launch patches the modules its kernel sees and undoes that at its
end, and a helper's patch is never undone (Triton's own behaviour), so its modules stay patched
after the launch. `install()` patches each module once in the process and keeps it patched,
as a helper's patch is kept, until `uninstall()`: a launch or helper whose modules are patched
already patches nothing (a launch's patch and undo were 6% of lora_graph_capture's children in
cProfile). The same code runs on the same values: only the repeated walks go
(tests/test_interpret.py checks equal results and the count of patches).

Two more of its costs go, neither changing a value:
- Integer overflow checks. The interpreter computes one for every int32 add, sub and mul (a cast
  to int64, the operation again, two compares: six interpreted operations), then drops it: its
  device_assert does nothing without `debug`, and its options never have `debug`, TRITON_DEBUG
  or not. Compiled Triton without debug drops the check too (int32 wraps). `install()` turns the
  computation off (measured: a sixth of lora_graph_capture's kernel time).
- The numpy dtype of a Triton type, looked up by building a dict of 19 types per call; it is
  memoized per scalar type (a block's is its element's, as in the lookup).

And two more of its costs, the largest left (measured on lora_graph_capture: a fifth, and a
fourteenth, of its time):
- Its type layer: every operation builds a new block type (a shape validated, a name formatted,
  a `tl.tuple` of constexprs made for its tensor) and compares types field by field. Block
  types are interned: one object per element type and shape, made once, its tensor shape with
  it; a type equals itself at once, and operands of one type need no broadcast. Values and
  types stay what they were; only their making is shared. Only while Triton interprets: the
  compiler shares this layer, and is left as shipped.
- Each launch's patch lists the language's builtins with inspect.getmembers (a walk of every
  member); their names are listed once per module, and each launch patches those that are
  builtins at the time, as the walk would.

And three more (2026-11-29; lora_graph_capture's and lazy_attn_state's checks on the 2-CPU VM
about a fifth shorter together), none changing a value:
- A binary operation's type check (the pointer checks, the computation type, the casts to it)
  and its broadcast's shape logic are Python over the operands' types. Both are decided once
  per pair of types (and flags), and replayed: the same casts and the same builder calls on
  the same handles. A Python number's type is its value's, found each time, and its range is
  checked each time, as Triton does; a scalar pointer's type, made anew for each launch, is
  keyed by its value.
- Each @triton.jit function is rewritten from its source at its first call in a process (its source
  read, parsed, transformed, compiled: 22 functions, 8% of lora_graph_capture's full_graphs child
  in cProfile). The compiled rewrite is kept under the user's cache, keyed by its file's path and
  bytes, its name and its first line; a file that cannot be read is rewritten as Triton does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import marshal
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.csrc import cache_root


class _Kept:
    """The scope a launch or helper gets back: nothing to undo at its end (install() keeps
    every patch it made, and uninstall() undoes them)."""

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
    patched: set[int] = set()  # the modules patched in this process (until uninstall)
    kept: list = []  # their patches' scopes

    def run_launch(self, *args, **kwargs):
        copies: dict[int, tuple] = {}
        args = tuple(_with_slack(a, copies) for a in args)
        kwargs = {k: _with_slack(v, copies) for k, v in kwargs.items()}
        try:
            return launch(self, *args, **kwargs)
        finally:
            # back: only the bytes the launch wrote through each copy (a kernel may also
            # write through addresses it was given in a table: those are in the original)
            for original, before, padded in copies.values():
                after = padded[SLACK : SLACK + original.size]
                written = after != before
                original[written] = after[written]

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if langs and langs <= patched:
            return _Kept()
        kept.append(patch(fn))
        patched.update(langs)
        return _Kept()  # kept patched: a launch's end does not undo it

    def undo() -> None:
        while kept:
            kept.pop().restore()
        patched.clear()
        interpreter._patch_lang, executor.__call__ = patch, launch

    interpreter._patch_lang, executor.__call__ = patch_once, run_launch
    _undo.append(undo)
    _skip_dropped_overflow_checks(interpreter)
    _memoize_np_dtype(interpreter)
    _list_builtins_once(interpreter)
    _cache_rewrites(interpreter)
    if isinstance(tl.sum, getattr(interpreter, "InterpretedFunction", ())):  # interpreting:
        _intern_block_types()  # the compiler, which shares the type layer, is left as shipped
    return True


# Bytes of poison before and after each small tensor argument's storage while a kernel
# interprets. Storages larger than LARGE run in place: the KV and weight pools (copying them
# every launch made the CPU matrix 2.3x slower), and anything whose copy would reach torch's
# parallel grain (32768 elements: the interpreter copies each storage back with torch, and a
# parallel copy starts OpenMP threads, after which a child this process forks hangs).
SLACK, LARGE = 1 << 13, 1 << 14
POISON_BYTE = 0x7F  # int32 0x7F7F7F7F, float32 3.4e38: no index or value a kernel expects


def _with_slack(arg, copies: dict[int, tuple]):
    """A CPU tensor argument as the same view of a copy of its storage that has SLACK bytes of
    poison on each side (one copy per storage, so views of one storage stay views of one); why:
    the module's docstring."""
    if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu":
        return arg
    storage = arg.untyped_storage()
    if storage.nbytes() > LARGE:
        return arg
    found = copies.get(storage.data_ptr())
    if found is None:
        # NOTE: numpy, not torch, for the same reason (torch's fill and compare go parallel)
        original = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        padded = np.full(original.size + 2 * SLACK, POISON_BYTE, dtype=np.uint8)
        padded[SLACK : SLACK + original.size] = original
        copies[storage.data_ptr()] = found = (original, original.copy(), padded)
    offset = SLACK // arg.element_size() + arg.storage_offset()
    view = torch.empty(0, dtype=arg.dtype)
    storage = torch.from_numpy(found[2]).untyped_storage()
    return view.set_(storage, offset, arg.size(), arg.stride())


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


def _list_builtins_once(interpreter) -> None:
    walk, patch_attr = (
        getattr(interpreter, "_patch_builtin", None),
        getattr(interpreter, "_patch_attr", None),
    )
    if walk is None or patch_attr is None:
        return
    names: dict[int, tuple[object, list[str]]] = {}  # per module (or class): its builtins' names

    def patch_builtins(pkg, builder, scope) -> None:
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            listed = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            names[id(pkg)] = known = (pkg, listed)
        for name in known[1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):  # as the walk: what is patched already is skipped
                patch_attr(pkg, name, member, builder, scope)

    def undo() -> None:
        interpreter._patch_builtin = walk

    interpreter._patch_builtin = patch_builtins
    _undo.append(undo)


def _cache_rewrites(interpreter) -> None:
    rewriter = getattr(interpreter, "FunctionRewriter", None)
    needed = ("rewrite_ast", "_compile_and_exec", "_transform_ast")
    if rewriter is None or not all(name in vars(rewriter) for name in needed):
        return
    rewrite, compile_and_exec = rewriter.rewrite_ast, rewriter._compile_and_exec
    tag = f"{sys.implementation.cache_tag}-triton-{triton.__version__}"
    where = cache_root() / "interpreted" / tag
    entries: dict[int, Path] = {}  # per rewriter being rewritten: its cache entry

    def run(self, code):
        """What Triton's _compile_and_exec does with the code it compiled."""
        namespace = {**self.kwargs}
        fn_globals = self.fn.__globals__
        for name, value in vars(interpreter).items():
            fn_globals.setdefault(name, value)
        exec(code, fn_globals, namespace)
        return namespace[self.fn.__name__]

    def rewrite_cached(self):
        entry = _rewrite_entry(self.fn, where)
        if entry is None:
            return rewrite(self)
        try:
            code = marshal.loads(entry.read_bytes())
        except (OSError, EOFError, ValueError, TypeError):
            entries[id(self)] = entry
            try:
                return rewrite(self)
            finally:
                entries.pop(id(self), None)
        return run(self, code)

    def compile_kept(self, transformed_ast):
        entry = entries.get(id(self))
        if entry is None:
            return compile_and_exec(self, transformed_ast)
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        temporary = entry.with_name(f"{entry.name}.{os.getpid()}")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(marshal.dumps(code))
            temporary.replace(entry)
        except OSError:  # not writable: rewritten each time
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
        return run(self, code)

    def undo() -> None:
        rewriter.rewrite_ast, rewriter._compile_and_exec = rewrite, compile_and_exec

    rewriter.rewrite_ast, rewriter._compile_and_exec = rewrite_cached, compile_kept
    _undo.append(undo)


def _rewrite_entry(fn, where: Path) -> Path | None:
    """The cache entry of `fn`'s rewrite: keyed by its file (path and bytes), its name and its
    first line; None where it has no file to read."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    try:
        source = Path(code.co_filename).read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(source)
    key.update(f"\0{code.co_filename}\0{fn.__qualname__}\0{code.co_firstlineno}".encode())
    return where / f"{key.hexdigest()[:40]}.code"


def _made_anew(cls, *args, **kwargs):
    """A block type's __new__ once uninstalled: object's, as before install."""
    return object.__new__(cls)


def _intern_block_types() -> None:
    core = tl.core
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return
    block_type, tensor = core.block_type, core.tensor
    if vars(block_type).get("__new__", _made_anew) is not _made_anew:
        return  # not Triton's own
    needed = ("broadcast_impl_value", "binary_op_type_checking_impl", "cast", "to_tensor")
    needed += ("to_tensor_type", "_cast_to_computation_type")
    if not all(hasattr(TritonSemantic, name) for name in needed):
        return
    make, equal, tensor_init = block_type.__init__, block_type.__eq__, tensor.__init__
    broadcast = TritonSemantic.broadcast_impl_value
    constexpr, shapes = core.constexpr, core.tuple
    interned: dict[tuple, object] = {}
    scalar_shape = (constexpr(1), shapes([]))  # a tensor's numel and shape of a scalar type

    def key(element_ty, shape) -> tuple:
        dims = shape.values if type(shape) is shapes else shape
        return (
            type(element_ty),
            element_ty.name,
            getattr(element_ty, "address_space", None),
            tuple(d.value if type(d) is constexpr else d for d in dims),
        )

    def new(cls, *args, **kwargs):
        if cls is block_type and len(args) == 2 and not kwargs:
            try:
                found = interned.get(key(*args))
            except (AttributeError, TypeError):  # not a type and shape to intern: made anew
                found = None
            if found is not None:
                return found
        return _made_anew(cls)

    def init(self, *args, **kwargs):
        if "_tensor_shape" in vars(self):  # interned: made already, from the same values
            return
        make(self, *args, **kwargs)
        if type(self) is block_type:
            with contextlib.suppress(AttributeError, TypeError):
                interned.setdefault(key(self.element_ty, self.shape), self)
        self._tensor_shape = (constexpr(self.numel), shapes([constexpr(d) for d in self.shape]))

    def eq(self, other) -> bool:
        return self is other or equal(self, other)

    def init_tensor(self, handle, type):
        if type.is_block():
            cached = vars(type).get("_tensor_shape")
            if cached is None:
                return tensor_init(self, handle, type)
        else:
            cached = scalar_shape
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = cached

    # what broadcast did, per pair of operand types; the types' computation type, per pair and
    # flags. An entry holds its types: an id in a key is not reused while the entry lives.
    plans: dict[tuple, tuple] = {}
    checked: dict[tuple, tuple] = {}

    def broadcast_same(self, lhs, rhs):
        if lhs.type is rhs.type:  # one type: one shape, nothing to broadcast
            return lhs, rhs
        key = (_type_key(lhs.type), _type_key(rhs.type))
        plan = plans.get(key)
        if plan is None:
            out = broadcast(self, lhs, rhs)
            if len(plans) >= MAX_PLANS:  # types made anew: keep to a few
                plans.clear()
            steps = (
                _broadcast_step(lhs, out[0], self.builder),
                _broadcast_step(rhs, out[1], self.builder),
            )
            plans[key] = ((lhs.type, rhs.type), self.builder, *steps)
            return out
        if plan[1] is not self.builder:
            return broadcast(self, lhs, rhs)
        return _broadcast_as(self, lhs, plan[2]), _broadcast_as(self, rhs, plan[3])

    def type_checked(self, lhs, rhs, *flags, **named):
        """Triton's binary type check (its casts to the computation type, then the broadcast):
        what the operands' types and the flags decide is decided once per pair. A Python
        number's type is its value's (Triton's to_tensor_type, each time), and it is cast as
        Triton casts it (its range checked against the computation type, each time)."""
        lt, rt = _operand_type(self, lhs, tensor), _operand_type(self, rhs, tensor)
        if lt is None or rt is None or (type(lhs) is not tensor and type(rhs) is not tensor):
            return type_check(self, lhs, rhs, *flags, **named)  # two numbers, or other values
        flags = _binary_flags(*flags, **named)
        key = (_type_key(lt), _type_key(rt), type(lhs) is tensor, type(rhs) is tensor, flags)
        found = checked.get(key)
        if found is None:
            out = type_check(self, lhs, rhs, *flags)
            if len(checked) >= MAX_PLANS:
                checked.clear()
            arithmetic = flags[2] and not lt.scalar.is_ptr() and not rt.scalar.is_ptr()
            checked[key] = ((lt, rt), out[0].type.scalar if arithmetic else None)
            return out
        computed = found[1]
        lhs = _computation_operand(self, lhs, computed, tensor)
        rhs = _computation_operand(self, rhs, computed, tensor)
        return self.broadcast_impl_value(lhs, rhs)

    def undo() -> None:
        # NOTE: not deleted: CPython then keeps a __new__ slot that refuses __init__'s arguments
        block_type.__new__ = _made_anew
        block_type.__init__, block_type.__eq__, tensor.__init__ = make, equal, tensor_init
        TritonSemantic.broadcast_impl_value = broadcast
        TritonSemantic.binary_op_type_checking_impl = type_check
        interned.clear()
        plans.clear()
        checked.clear()

    type_check = TritonSemantic.binary_op_type_checking_impl
    block_type.__new__, block_type.__init__, block_type.__eq__ = new, init, eq
    tensor.__init__ = init_tensor
    TritonSemantic.broadcast_impl_value = broadcast_same
    TritonSemantic.binary_op_type_checking_impl = type_checked
    _undo.append(undo)


MAX_PLANS = 4096  # broadcast plans and type checks kept (a pair of types each)


def _type_key(ty):
    """A type as a memo's key: a scalar pointer's by its value (Triton makes one anew for each
    launch's pointer arguments), any other by its identity (block types are interned here;
    scalar types are Triton's own objects)."""
    if isinstance(ty, tl.pointer_type):
        return (type(ty), ty.name, ty.address_space)
    return id(ty)


def _operand_type(semantic, value, tensor):
    """A binary operand's type as Triton's type check sees it: a tensor's, a Python number's
    by its value; None for anything else (left to Triton)."""
    if type(value) is tensor:
        return value.type
    if type(value) in (int, float, bool):
        return semantic.to_tensor_type(value)
    return None


def _computation_operand(semantic, value, computed, tensor):
    """An operand as Triton's type check passes it to the broadcast: cast to the computation
    type `computed` (a number: made a tensor of it, its range checked); with none (no
    arithmetic check, or a pointer), a number made a tensor of its own type."""
    if type(value) is not tensor:
        if computed is None:
            return semantic.to_tensor(value)
        return semantic._cast_to_computation_type(value, computed)
    if computed is not None and value.type.scalar is not computed:
        return semantic.cast(value, computed)
    return value


def _binary_flags(
    allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False
) -> tuple:
    """Triton's binary type check's flags, as its signature defaults them (in its order)."""
    return (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)


def _broadcast_step(before, after, builder) -> tuple | None:
    """What Triton's broadcast did to one operand, `before` to `after`: nothing (None), a
    scalar splat to `after`'s type (its IR type made once), or for a block: k leading axes
    added, then a broadcast to `after`'s shape where the expanded shape differs."""
    if after is before:
        return None
    if not before.type.is_block():
        return ("splat", after.type, after.type.to_ir(builder))
    shape, target = tuple(before.type.shape), tuple(after.type.shape)
    k = len(target) - len(shape)
    return ("block", after.type, k, (1,) * k + shape != target, target)


def _broadcast_as(semantic, value, step):
    """`value` broadcast by a step of _broadcast_step: the same builder calls Triton's
    broadcast makes for it, on the same handles (so the same values)."""
    if step is None:
        return value
    builder = semantic.builder
    if step[0] == "splat":
        return semantic.make_tensor(builder.create_splat(step[2], value.handle), step[1])
    _, ty, k, widen, target = step
    handle = value.handle
    for _ in range(k):
        handle = builder.create_expand_dims(handle, 0)
    if widen:
        handle = builder.create_broadcast(handle, target)
    return semantic.make_tensor(handle, ty)


def uninstall() -> None:
    """Triton's interpreter as shipped (tests compare the two)."""
    while _undo:
        _undo.pop()()
