"""CUDA-graph capture and replay: real torch.cuda.CUDAGraph on GPU, an emulation on CPU.

Semantics both share (tests/test_cudagraph.py pins them on either device):
- during capture, host code runs once; device work is recorded, not executed, so every host
  decision (a flag's early return, a grid size) is frozen into the graph;
- replay re-runs exactly the recorded device work on the same tensors, reading their current
  contents: persistent buffers must be refreshed in place;
- tensors allocated during capture keep their storage for every replay, and hold poison (int32
  max, float32 NaN) until a replay writes them: what capture records does not run.
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


class Launcher:
    """The one door for device work: runs it, or (CPU capture) records it for replay."""

    def __init__(self) -> None:
        self.recording: list[Work] | None = None
        self.names: list[str] | None = None  # names of launches made while capturing
        self.split: Callable[[Work], None] | None = None  # set while capturing PIECEWISE

    def __call__(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        if self.names is not None:
            self.names.append(_name(fn))
        if self.recording is not None:
            self.recording.append(functools.partial(fn, *args, **kwargs))
        else:
            fn(*args, **kwargs)

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
            with poisoned_allocations():
                yield graph
    finally:
        launcher.recording = launcher.names = launcher.split = None


ForwardFn = Callable[[CUDAGraphMode], object]
AttnState = object


class CudaGraphManager:
    """Captures one graph per batch descriptor into a shared pool; dispatches and replays."""

    def __init__(self, device: str, launcher: Launcher, fixes: Variant = ALL_FIXES) -> None:
        self.device, self.fixes = device, fixes
        self.launcher = launcher
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
        largest first. Per descriptor: warm up eagerly (FULL: and run the FULL path once
        eagerly), then capture in its mode.
        `create_forward_fn(desc)` makes a forward function and its attention state;
        `create_forward_fn(desc, warmup=False)`, one for capture."""
        order = sorted(descs, key=lambda d: (d.cg_mode != CUDAGraphMode.PIECEWISE, -d.num_tokens))
        if self.device == "cuda" and self.pool is None:
            self.pool, self.primer = poisoned_pool()
        for desc in order:
            forward_fn, attn_state = create_forward_fn(desc)
            warmup_state = attn_state
            forward_fn(CUDAGraphMode.NONE)  # warm-up: allocations, lazy init, autotuning
            if desc.cg_mode == CUDAGraphMode.FULL and Fix.CAPTURE_PREWARM in self.fixes:
                # fix: capture_prewarm -- first-call work of the FULL path must not run in capture.
                create_forward_fn(desc)[0](desc.cg_mode)  # eagerly, on a disposable state
            if (
                desc.cg_mode == CUDAGraphMode.FULL
                and Fix.FRESH_ATTN_STATE_FOR_CAPTURE in self.fixes
            ):
                # fix: fresh_attn_state_for_capture -- lazy attention init must run in the graph.
                forward_fn, attn_state = create_forward_fn(desc, warmup=False)
            self.warmup_attn_states[desc] = warmup_state
            self.captured_attn_states[desc] = attn_state
            piecewise = desc.cg_mode == CUDAGraphMode.PIECEWISE
            with capturing(self.launcher, self.device, self.pool, piecewise) as graph:
                self.outputs[desc] = forward_fn(desc.cg_mode)
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
        """Replay the graph of `desc`; its outputs (buffers the replay refreshed)."""
        self.graphs[desc].replay()
        return self.outputs[desc]
