"""The stream model: a copy stream beside the main stream, and events, as async scheduling uses
them (upstream: the runner's copy stream for the sampled tokens' device-to-host copies, MRV2's
for host-to-device uploads such as the grammar bitmask, vLLM #33059).

`Streams(device, delay)` gives copies on the copy stream (`h2d`, `d2h`: each after the main
stream's work so far), main-stream work after one of their events (`on_main`), and events the
host can `synchronize()` on or `query()`.

The delay makes a race's losing order certain, on both devices:
- GPU: a gate (kernels/host_gate.py: a kernel that spins until the host writes its number into
  a pinned flag) is enqueued on the copy stream before each copy, so what the host does next
  (rewrite the copy's pinned source, hand the copy's device source to the next step's kernels)
  comes first. The host opens a copy's gate when it waits for an event after it, as the CPU
  runs the copy then, and first lets the main stream finish what it can (all its work, or up to
  its first wait on a copy not yet opened): the GPU's order is the CPU's, not a race of times;
- CPU: the copy stream's work is queued as closures and runs only when an event after it is
  synchronized, the main stream first running all it can before each of its items; main-stream
  work runs at once unless it waits on queued copy-stream work (then it queues too, in stream
  order, as a GPU's main stream stalls). Closures are bound to aliases of their tensors'
  storages (cudagraph.bound_work): a queued copy does not keep its source tensor alive.
Without the delay the CPU runs everything at once: the winning order.
NOTE: the CPU does not model the host syncs a GPU makes on its own (a synchronous host-to-device
copy_ synchronizes the main stream): scenarios put their racing host write before any of them.
A GPU host that syncs a main stream waiting on a closed gate waits until the gate's poll bound
runs out (some seconds), then goes on: late, not stuck.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.runner.cudagraph import Work, bound_work
from kernels.host_gate import wait_for_host


@dataclass(eq=False, slots=True)
class _Stream:
    """A CPU stream: its work in order, `done` items of it run. A delayed stream runs only on
    demand, and lets its `peer` (the main stream) run all it can before each of its items."""

    delayed: bool
    peer: _Stream | None = None
    work: list[Work | Event] = field(default_factory=list)
    done: int = 0

    def _step(self) -> None:
        item = self.work[self.done]
        self.done += 1
        if isinstance(item, Event):
            item.synchronize()
        else:
            item()

    def run_until(self, position: int) -> None:
        """Run queued items up to `position` (a waited event first runs its own stream)."""
        while self.done < position:
            if self.delayed and self.peer is not None:
                self.peer.advance()  # the delay: whatever else can run, runs first
            self._step()

    def advance(self) -> None:
        """Run queued items until one waits on an event not yet complete."""
        while self.done < len(self.work):
            item = self.work[self.done]
            if isinstance(item, Event) and not item.query():
                return
            self._step()

    def submit(self, item: Work | Event) -> None:
        self.work.append(item)
        if not self.delayed:
            self.advance()


@dataclass(eq=False, slots=True)
class Event:
    """A point in a stream: complete once the stream's work before it has run."""

    stream: _Stream | None = None  # CPU
    position: int = 0
    cuda: torch.cuda.Event | None = None  # GPU
    gate: tuple[Streams, int] | None = None  # GPU: the copies' gates it needs opened

    def query(self) -> bool:
        """Complete? (never waits)"""
        if self.cuda is not None:
            return self.cuda.query()
        return self.stream.done >= self.position

    def synchronize(self) -> None:
        """The host waits until the event is complete (the CPU runs the work before it)."""
        if self.cuda is not None:
            if self.gate is not None:
                self.gate[0].open_gates(self.gate[1])
            self.cuda.synchronize()
        else:
            self.stream.run_until(self.position)


class Streams:
    """The main stream and one copy stream of `device`; `delay`: the copy stream runs late."""

    def __init__(self, device: str, delay: bool = False) -> None:
        self.device, self.delay = device, delay
        if device == "cuda":
            self.main, self.copy = torch.cuda.current_stream(), torch.cuda.Stream()
            self.flag = torch.zeros(1, dtype=torch.int32).pin_memory()  # the gates opened
            self.gates = 0  # gates enqueued, one per copy (with the delay)
            # per main-stream wait on a copy: its gate, and the main stream's event before it
            self.main_waits: list[tuple[int, torch.cuda.Event]] = []
        else:
            self.main = _Stream(False)
            self.copy = _Stream(delay, peer=self.main)

    def _record(self, stream) -> Event:
        if self.device != "cuda":
            return Event(stream, len(stream.work))
        event = torch.cuda.Event()
        event.record(stream)
        gated = stream is self.copy and self.gates > 0
        return Event(cuda=event, gate=(self, self.gates) if gated else None)

    def open_gates(self, upto: int) -> None:
        """GPU: open the copies' gates up to number `upto`, each after the main stream ran what
        it can before that copy (as the CPU's delayed stream lets its peer advance)."""
        while int(self.flag[0]) < upto:
            gate = int(self.flag[0]) + 1
            self.main_waits = [(g, e) for g, e in self.main_waits if g >= gate]
            before = [e for _, e in self.main_waits]
            if before:
                before[0].synchronize()  # main is held at a wait on this copy, or a later one
            else:
                self.main.synchronize()
            self.flag[0] = gate

    def _on_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """dst <- src on the copy stream, after the delay when on; the event after it."""
        if self.device != "cuda":
            self.copy.submit(bound_work(dst.copy_, src))
            return self._record(self.copy)
        with torch.cuda.stream(self.copy):
            if self.delay:
                self.gates += 1
                wait_for_host(self.flag, self.gates)
            dst.copy_(src, non_blocking=True)
        return self._record(self.copy)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Upload a host tensor (pinned on a GPU) into device memory, non-blocking: after the
        main stream's work so far (the destination's earlier users)."""
        self.wait(self.copy, self._record(self.main))
        return self._on_copy(dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Download device memory into a host tensor (pinned on a GPU), non-blocking: after the
        main stream's work so far (upstream: copy_stream.wait_stream(main_stream))."""
        self.wait(self.copy, self._record(self.main))
        return self._on_copy(dst, src)

    def on_main(self, after: Event | None, fn: Callable[..., object], *args: object) -> Event:
        """`fn(*args)` on the main stream, after `after` (a device-side wait: the host does not
        block); the event after it."""
        if after is not None:
            if after.gate is not None:
                self.main_waits.append((after.gate[1], self._record(self.main).cuda))
            self.wait(self.main, after)
        if self.device == "cuda":
            fn(*args)
        else:
            self.main.submit(bound_work(fn, *args))
        return self._record(self.main)

    def wait(self, stream, event: Event) -> None:
        """`stream` waits for `event` on the device; the host goes on."""
        if self.device == "cuda":
            stream.wait_event(event.cuda)
        else:
            stream.submit(event)

    def synchronize(self) -> None:
        """The host waits for both streams' work."""
        if self.device == "cuda":
            if self.delay:
                self.open_gates(self.gates)
            torch.cuda.synchronize()
            return
        for stream in (self.copy, self.main, self.copy):
            stream.run_until(len(stream.work))

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor for non-blocking copies (pinned on a GPU)."""
        return tensor.pin_memory() if self.device == "cuda" else tensor
