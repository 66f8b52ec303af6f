"""CUDA-graph capture and replay: real torch.cuda.CUDAGraph on GPU, an emulation on CPU.

Semantics both share (tests/test_cudagraph.py pins them on either device):
- during capture, host code runs once; device work is recorded, not executed, so every host
  decision (a flag's early return, a grid size) is frozen into the graph;
- replay re-runs exactly the recorded device work on the same tensors, reading their current
  contents: persistent buffers must be refreshed in place;
- tensors allocated during capture keep their storage for every replay.
All device work goes through a `Launcher`; that is how the CPU emulation records it, and how
either device reports which kernels a graph holds.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


class CUDAGraphMode(enum.Enum):
    NONE = "none"  # eager
    FULL = "full"  # the whole forward in one graph


@dataclass(frozen=True, slots=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int  # padded size the graph was captured for
    num_reqs: int


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class Launcher:
    """The one door for device work: runs it, or (CPU capture) records it for replay."""

    def __init__(self) -> None:
        self.recording: list[Callable[[], object]] | None = None
        self.names: list[str] | None = None  # names of launches made while capturing

    def __call__(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        if self.names is not None:
            self.names.append(_name(fn))
        if self.recording is not None:
            self.recording.append(functools.partial(fn, *args, **kwargs))
        else:
            fn(*args, **kwargs)


@dataclass
class Graph:
    """One captured graph: the CUDA graph (GPU) or the recorded work (CPU), and its launches."""

    cuda_graph: torch.cuda.CUDAGraph | None = None
    recorded: list[Callable[[], object]] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)

    def replay(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return
        for work in self.recorded:
            work()


@contextlib.contextmanager
def capturing(launcher: Launcher, device: str, pool: object | None) -> Iterator[Graph]:
    """Capture everything launched inside into a new Graph."""
    graph = Graph()
    launcher.names = graph.launches
    try:
        if device == "cuda":
            graph.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.cuda_graph, pool=pool):
                yield graph
        else:
            launcher.recording = graph.recorded
            yield graph
    finally:
        launcher.recording = launcher.names = None


ForwardFn = Callable[[CUDAGraphMode], torch.Tensor]
AttnState = object


class CudaGraphManager:
    """Captures one FULL graph per batch descriptor into a shared pool; replays on dispatch."""

    def __init__(self, device: str, launcher: Launcher) -> None:
        self.device = device
        self.launcher = launcher
        self.pool = torch.cuda.graph_pool_handle() if device == "cuda" else None
        self.graphs: dict[BatchExecutionDescriptor, Graph] = {}
        self.outputs: dict[BatchExecutionDescriptor, torch.Tensor] = {}
        self.captured_attn_states: dict[BatchExecutionDescriptor, AttnState] = {}

    def capture(
        self,
        descs: list[BatchExecutionDescriptor],
        create_forward_fn: Callable[[BatchExecutionDescriptor], tuple[ForwardFn, AttnState]],
    ) -> None:
        """Per descriptor, largest first: warm up eagerly, then capture."""
        for desc in sorted(descs, key=lambda d: -d.num_tokens):
            forward_fn, attn_state = create_forward_fn(desc)
            forward_fn(CUDAGraphMode.NONE)  # warm-up: allocations, lazy init, autotuning
            self.captured_attn_states[desc] = attn_state
            if self.device == "cuda":
                torch.cuda.synchronize()
            with capturing(self.launcher, self.device, self.pool) as graph:
                self.outputs[desc] = forward_fn(CUDAGraphMode.FULL)
            self.graphs[desc] = graph

    def dispatch(self, num_tokens: int) -> BatchExecutionDescriptor | None:
        """The smallest captured descriptor that fits, or None (run eagerly)."""
        fits = [d for d in self.graphs if d.num_tokens >= num_tokens]
        return min(fits, key=lambda d: d.num_tokens) if fits else None

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> torch.Tensor:
        self.graphs[desc].replay()
        return self.outputs[desc]
