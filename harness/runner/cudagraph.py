"""CUDA-graph capture and replay: real torch.cuda.CUDAGraph on GPU, an emulation on CPU.

Semantics both share (tests/test_cudagraph.py pins them on either device):
- during capture, host code runs once; device work is recorded, not executed, so every host
  decision (a flag's early return, a grid size) is frozen into the graph;
- replay re-runs exactly the recorded device work on the same tensors, reading their current
  contents: persistent buffers must be refreshed in place;
- replay reads and writes the storage each tensor had at capture (a graph holds addresses, not
  Python objects): a tensor rebound after capture (`t.data = ...`, `t.set_(...)`) is not seen,
  on the CPU either, where each recorded launch is bound to aliases of its tensors' storages
  (a storage the emulation binds stays alive with its last contents; on the GPU a tensor freed
  by its owner leaves the graph reading memory the allocator may hand out again);
- tensors allocated during capture keep their storage for every replay, and hold poison (int32
  max, float32 NaN) until a replay writes them: what capture records does not run;
- the outputs of graphs whose managers share a `GraphPool` are laid at one place in it (as
  upstream's weak-referenced outputs in one pool): a replay of one overwrites another's.
All device work goes through a `Launcher`; that is how the CPU emulation records it, and how
either device reports which kernels a graph holds. PIECEWISE graphs leave out what is launched
with `launcher.outside_graph(fn, ...)` (attention): that runs, host code included, at every
replay between the captured pieces; FULL graphs capture it like everything else.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.poison import poisoned_allocations


class CUDAGraphMode(enum.Enum):
    NONE = "none"  # eager
    PIECEWISE = "piecewise"  # graphs around the attention, which runs eagerly
    FULL = "full"  # the whole forward in one graph
    FULL_AND_PIECEWISE = "full_and_piecewise"  # FULL for uniform decode batches, else PIECEWISE


@dataclass(frozen=True, slots=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode  # FULL or PIECEWISE
    num_tokens: int  # padded size the graph was captured for
    num_reqs: int  # padded requests
    uniform_decode: bool = False  # captured for one token per request
    num_active_loras: int | None = None  # the LoRA capture case (specialised LoRA only)


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


Work = Callable[[], object]


def _alias(value: object) -> object:
    """`value` with every tensor in it (lists and tuples included) replaced by a new tensor
    object on the same storage, offset, sizes and strides: rebinding the original later does
    not move the alias, as it does not move a captured graph's addresses."""
    if isinstance(value, torch.Tensor):
        alias = torch.empty(0, dtype=value.dtype, device=value.device)
        return alias.set_(
            value.untyped_storage(), value.storage_offset(), value.size(), value.stride()
        )
    if type(value) in (list, tuple):
        return type(value)(_alias(v) for v in value)
    return value


def bound_work(fn: Callable[..., object], *args: object, **kwargs: object) -> Work:
    """The launch as a graph records it: on the storages its tensors have now (a method of a
    tensor, `out.fill_`, is bound to its alias too)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor):
        fn = getattr(_alias(owner), fn.__name__)
    bound = {k: _alias(v) for k, v in kwargs.items()}
    return functools.partial(fn, *(_alias(a) for a in args), **bound)


class Launcher:
    """The one door for device work: runs it, or (CPU capture) records it for replay."""

    def __init__(self) -> None:
        self.recording: list[Work] | None = None
        self.names: list[str] | None = None  # names of launches made while capturing
        self.split: Callable[[Work], None] | None = None  # set while capturing PIECEWISE
        # set while a stream model holds the device work back (kv_offload.py: a late compute
        # stream): each launch is handed to it, bound as a graph records it
        self.queue: Callable[[Work], None] | None = None

    def __call__(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        if self.names is not None:
            self.names.append(_name(fn))
        if self.recording is not None:
            self.recording.append(bound_work(fn, *args, **kwargs))
        elif self.queue is not None:
            self.queue(bound_work(fn, *args, **kwargs))
        else:
            fn(*args, **kwargs)

    @property
    def capturing(self) -> bool:
        """Whether a graph is being captured now (upstream: the stream is capturing)."""
        return self.names is not None

    def outside_graph(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        """Host and device work a PIECEWISE graph leaves out; inline otherwise."""
        if self.split is None:
            fn(*args, **kwargs)
            return
        if self.names is not None:
            self.names.append(f"eager {_name(fn)}")
        self.split(functools.partial(fn, *args, **kwargs))


def host_sync(launcher: Launcher, device: str) -> None:
    """Wait for the device (a timing, a read-back): refused while capturing, by the driver on
    the GPU (the capture is invalidated), by the emulation on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif launcher.recording is not None:
        raise RuntimeError("operation not permitted when stream is capturing (host sync)")


@dataclass
class Graph:
    """Captured CUDA graphs (GPU) or recorded work (CPU), with eager steps between PIECEWISE
    pieces, in replay order; and the names of the launches made while capturing."""

    segments: list[torch.cuda.CUDAGraph | Work] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)
    primer: object = None  # keeps a poisoned pool of its own alive (GPU, no pool given)

    def replay(self) -> None:
        for segment in self.segments:
            if isinstance(segment, torch.cuda.CUDAGraph):
                segment.replay()
            else:
                segment()


class _CudaPieces:
    """Manual CUDA-graph capture that can stop around an eager step and start again."""

    def __init__(self, graph: Graph, pool: object | None) -> None:
        self.graph, self.pool, self.current = graph, pool, None

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.current.capture_end()
        self.graph.segments.append(self.current)

    def split(self, eager: Work) -> None:
        self.end()
        self.graph.segments.append(eager)
        self.begin()


POISON_I32 = 2**31 - 1  # as float32 bits a NaN: the poison of poisoned_allocations on both


@functools.cache
def capture_stream() -> torch.cuda.Stream:
    """The one side stream of every capture and of pool priming: the caching allocator hands a
    freed block out again only on the stream it was allocated on."""
    return torch.cuda.Stream()


def poisoned_pool() -> tuple[object, torch.cuda.CUDAGraph]:
    """A CUDA-graph memory pool whose free small blocks hold poison, and the graph that keeps
    it alive: small tensors a capture allocates from it (up to 8 MiB of them) read as the
    CPU's poison until a replay writes them, whatever the GPU held before."""
    pool, primer, stream = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph(), capture_stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        primer.capture_begin(pool=pool)
        # NOTE: 1 MiB is the caching allocator's largest small block (2 MiB segments)
        blocks = [
            torch.full((2**18,), POISON_I32, dtype=torch.int32, device="cuda") for _ in range(8)
        ]
        primer.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    primer.replay()
    torch.cuda.synchronize()
    del blocks  # free in the pool, poisoned
    return pool, primer


_ATEN = torch.ops.aten
# run as they are while the CPU emulation captures: allocation (poisoned by
# poisoned_allocations), storage binding, host reads of flags, tensors made from host data
_UNRECORDED = frozenset(
    (
        _ATEN.empty.memory_format,
        _ATEN.empty_like.default,
        _ATEN.empty_strided.default,
        _ATEN.set_.source_Storage_storage_offset,
        _ATEN.set_.source_Tensor,
        _ATEN._local_scalar_dense.default,
        _ATEN.lift_fresh.default,
        _ATEN.lift_fresh_copy.default,
    )
)


def _poison(t: torch.Tensor) -> None:
    """What capture allocates holds poison until a replay writes it (as poisoned_allocations)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _written(func, args: tuple, kwargs: dict) -> object:
    """What an in-place or out= op returns: the arguments its schema says it writes."""
    schema, values = func._schema, dict(kwargs)
    values.update((a.name, v) for a, v in zip(schema.arguments, args, strict=False))
    found = [
        values[a.name]
        for r in schema.returns
        for a in schema.arguments
        if a.alias_info and r.alias_info and a.alias_info.before_set == r.alias_info.before_set
    ]
    return found[0] if len(found) == 1 else tuple(found)


def _refill(outputs: tuple[torch.Tensor, ...], func, *args, **kwargs) -> None:
    result = func(*args, **kwargs)
    for out, value in zip(outputs, result if isinstance(result, tuple) else (result,), strict=True):
        out.copy_(value)


class _RecordOps(TorchDispatchMode):
    """CPU capture: tensor ops outside the Launcher are device work a real graph records too
    (`torch.zeros(..., device=cuda)` is a captured memset): each is recorded in order and runs
    at every replay. In place and out= ops do not run at capture; other ops allocate their
    outputs now, poisoned, and fill them at every replay. Views, allocations and host reads
    run as they are."""

    def __init__(self, recording: list[Work]) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func in _UNRECORDED:
            return func(*args, **kwargs)
        if any(a.alias_info and a.alias_info.is_write for a in func._schema.arguments):
            self.recording.append(bound_work(func, *args, **kwargs))
            return _written(func, args, kwargs)
        result = func(*args, **kwargs)
        outputs = result if isinstance(result, tuple) else (result,)
        for out in outputs:
            _poison(out)
        self.recording.append(bound_work(_refill, _alias(outputs), func, *args, **kwargs))
        return result


@contextlib.contextmanager
def capturing(
    launcher: Launcher, device: str, pool: object | None, piecewise: bool = False
) -> Iterator[Graph]:
    """Capture everything launched inside into a new Graph (into `pool`, a poisoned_pool's,
    on the GPU; a poisoned pool of its own when None)."""
    graph = Graph()
    launcher.names = graph.launches
    try:
        if device == "cuda":
            if pool is None:
                pool, graph.primer = poisoned_pool()
            pieces, stream = _CudaPieces(graph, pool), capture_stream()
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                pieces.begin()
                launcher.split = pieces.split if piecewise else None
                try:
                    yield graph
                finally:
                    pieces.end()
            torch.cuda.current_stream().wait_stream(stream)
        else:
            launcher.recording = graph.segments
            launcher.split = graph.segments.append if piecewise else None
            with poisoned_allocations(), _RecordOps(graph.segments):
                yield graph
    finally:
        launcher.recording = launcher.names = launcher.split = None


class GraphPool:
    """The memory the graphs of several managers share (upstream: one global graph pool), as
    far as their outputs go. NOTE: upstream keeps a graph's outputs as weak references (vLLM
    #9724): once captured, their memory is free in the pool, and the next graph captured
    into it is handed the same memory. Modelled alike on both devices, by construction: one
    flat arena, and every graph's outputs laid out from its start, written by the graph at
    each replay. A graph's outputs hold what it wrote until another graph of the pool
    replays: consume or copy them before that."""

    def __init__(self, numel: int, dtype: torch.dtype, device: str) -> None:
        with poisoned_allocations():
            self.arena = torch.empty(numel, dtype=dtype, device=device)

    def place(self, outputs: tuple[torch.Tensor, ...], launcher: Launcher) -> tuple:
        """Views of the arena for `outputs` (captured tensors), and the captured copies that
        fill them at every replay."""
        views, offset = [], 0
        for out in outputs:
            if out.numel() > self.arena.numel() - offset or out.dtype != self.arena.dtype:
                raise ValueError(f"graph output {tuple(out.shape)} {out.dtype} past the pool")
            view = self.arena[offset : offset + out.numel()].view(out.shape)
            launcher(view.copy_, out)
            views.append(view)
            offset += out.numel()
        return tuple(views)


ForwardFn = Callable[[CUDAGraphMode], object]
AttnState = object


class CudaGraphManager:
    """Captures one graph per batch descriptor into a shared pool; dispatches and replays."""

    def __init__(
        self,
        device: str,
        launcher: Launcher,
        fixes: Variant = ALL_FIXES,
        output_pool: GraphPool | None = None,
    ) -> None:
        self.device, self.fixes = device, fixes
        self.launcher = launcher
        self.output_pool = output_pool  # where the graphs' outputs live; None: their own
        self.pool, self.primer = None, None  # GPU: a poisoned pool, made at the first capture
        self.graphs: dict[BatchExecutionDescriptor, Graph] = {}
        self.outputs: dict[BatchExecutionDescriptor, object] = {}
        # each descriptor's attention states: the one its warm-up ran on, the one captured
        self.warmup_attn_states: dict[BatchExecutionDescriptor, AttnState] = {}
        self.captured_attn_states: dict[BatchExecutionDescriptor, AttnState] = {}

    def capture(
        self,
        descs: list[BatchExecutionDescriptor],
        create_forward_fn: Callable[..., tuple[ForwardFn, AttnState]],
    ) -> None:
        """PIECEWISE descriptors first (their activations are the larger), then FULL; each
        largest first. `create_forward_fn(desc, warmup)` makes a forward function and its
        attention state: it is called once with warmup=True for the general warm-up, then (FULL)
        twice with warmup=False: once for a disposable eager prewarm of the capture-compatible
        path, and once for the actual capture (upstream's order, vLLM #46523)."""
        order = sorted(descs, key=lambda d: (d.cg_mode != CUDAGraphMode.PIECEWISE, -d.num_tokens))
        if self.device == "cuda" and self.pool is None:
            self.pool, self.primer = poisoned_pool()
        for desc in order:
            self._capture_one(desc, create_forward_fn)

    def _capture_one(
        self,
        desc: BatchExecutionDescriptor,
        create_forward_fn: Callable[..., tuple[ForwardFn, AttnState]],
    ) -> None:
        """Warm up eagerly, then capture in the descriptor's mode (PIECEWISE: on the warm-up's
        function; FULL: the whole forward in the graph, called in mode NONE)."""
        forward_fn, attn_state = create_forward_fn(desc, warmup=True)
        warmup_state = attn_state
        forward_fn(CUDAGraphMode.NONE)  # warm-up: allocations, lazy init, autotuning
        if desc.cg_mode == CUDAGraphMode.FULL and Fix.CAPTURE_PREWARM in self.fixes:
            # fix: capture_prewarm -- the capture path's first call (its tuning) must be eager.
            create_forward_fn(desc, warmup=False)[0](CUDAGraphMode.NONE)  # a disposable state
        if desc.cg_mode == CUDAGraphMode.FULL and Fix.FRESH_ATTN_STATE_FOR_CAPTURE in self.fixes:
            # fix: fresh_attn_state_for_capture -- lazy attention init must run in the graph.
            forward_fn, attn_state = create_forward_fn(desc, warmup=False)
        self.warmup_attn_states[desc] = warmup_state
        self.captured_attn_states[desc] = attn_state
        piecewise = desc.cg_mode == CUDAGraphMode.PIECEWISE
        with capturing(self.launcher, self.device, self.pool, piecewise) as graph:
            outputs = forward_fn(desc.cg_mode if piecewise else CUDAGraphMode.NONE)
            if self.output_pool is not None:
                outputs = self.output_pool.place(outputs, self.launcher)
            self.outputs[desc] = outputs
        self.graphs[desc] = graph

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform_decode: bool, lora_case: int | None = None
    ) -> BatchExecutionDescriptor | None:
        """The smallest captured descriptor that fits: a uniform-decode one first, for a
        uniform decode batch; None: run eagerly."""
        fits = [
            d
            for d in self.graphs
            if d.num_tokens >= num_tokens
            and d.num_reqs >= num_reqs
            and d.num_active_loras == lora_case
            and (uniform_decode or not d.uniform_decode)
        ]
        best = lambda d: (not d.uniform_decode, d.num_tokens)
        return min(fits, key=best) if fits else None

    def run(self, desc: BatchExecutionDescriptor) -> object:
        """Replay the graph of `desc` (on the launcher's queue when it has one); its outputs
        (buffers the replay refreshes)."""
        if self.launcher.queue is not None:
            self.launcher(self.graphs[desc].replay)
        else:
            self.graphs[desc].replay()
        return self.outputs[desc]
