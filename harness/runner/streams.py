"""The stream model: a copy stream beside the main stream, and events, as async scheduling uses
them (upstream: the runner's copy stream for the sampled tokens' device-to-host copies, MRV2's
for host-to-device uploads such as the grammar bitmask, vLLM #33059).

`Streams(device, delay)` gives copies on the copy stream (`h2d`, `d2h`: each after the main
stream's work so far), main-stream work after one of their events (`on_main`), and events the
host can `synchronize()` on or `query()`.

Each stream is a host queue in front of its device stream. The delay makes a race's losing order
certain, the same way on both devices: the copy stream's items are queued and reach the device
only when the host waits for an event after them (or synchronizes), the main stream first
enqueueing all it can before each of them (and, on a GPU, the copy waits for the main stream's
work so far: it runs after it, as a late copy does). Main-stream work runs (is enqueued) at once
unless it waits on a queued copy (then it queues too, in stream order, as a GPU's main stream
stalls). So what the host does before it waits (rewrite a copy's pinned source, hand the copy's
device source to the next step's kernels) comes first. Queued items are bound to aliases of
their tensors' storages (cudagraph.bound_work): a queued copy does not keep its source tensor
alive. Without the delay every item is enqueued at once: on the CPU the winning order, on a GPU
the real race.

Why not a delay on the device (a spin kernel before each copy): a host that blocks while the
copy stream spins lets the spin run out before its next write, and a host blocks where no code
of ours asks it to. Measured on an H100 (a kernel polling a pinned flag for at most ~2.3 s): the
first masked apply of a process held the host 2.2 s, CUDA's lazy module loading waiting for the
running spin kernel, and the copy then read the old bytes (the winning order).
NOTE: a host sync (a synchronous copy, `.item()`) enqueues nothing: work queued behind a copy is
not run by it, on either device. Scenarios put their racing host write before any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.runner.cudagraph import Work, bound_work


@dataclass(eq=False, slots=True)
class _Stream:
    """A host queue of work for `device` (a CUDA stream; None: the CPU runs items as they are
    dequeued), `done` items of it dequeued. A delayed stream dequeues only on demand, and lets
    its `peer` (the other stream) dequeue all it can before each of its items."""

    delayed: bool
    device: torch.cuda.Stream | None = None
    peer: _Stream | None = None
    work: list[Work | Event] = field(default_factory=list)
    done: int = 0
    marks: dict[int, torch.cuda.Event] = field(default_factory=dict)  # GPU: after item n

    def _step(self) -> None:
        item = self.work[self.done]
        if isinstance(item, Event):  # this stream waits for another's event
            # NOTE: dequeued once the wait is met: a peer that runs meanwhile sees it waiting
            item.stream.run_until(item.position)
            mark = item.mark()
            if mark is not None:
                self.device.wait_event(mark)
        elif self.device is None:
            item()
        else:
            if self.delayed and self.peer is not None:
                self.device.wait_stream(self.peer.device)  # after the peer's work so far
            with torch.cuda.stream(self.device):
                item()
        self.done += 1
        if self.device is not None:
            self.marks[self.done] = self.device.record_event()

    def run_until(self, position: int) -> None:
        """Dequeue items up to `position` (a waited event first runs its own stream)."""
        while self.done < position:
            if self.delayed and self.peer is not None:
                self.peer.advance()  # the delay: whatever else can run, runs first
            self._step()

    def advance(self) -> None:
        """Dequeue items until one waits on an event not yet dequeued."""
        while self.done < len(self.work):
            item = self.work[self.done]
            if isinstance(item, Event) and item.stream.done < item.position:
                return
            self._step()

    def submit(self, item: Work | Event) -> None:
        self.work.append(item)
        if not self.delayed:
            self.advance()


@dataclass(eq=False, slots=True)
class Event:
    """A point in a stream: complete once the stream's work before it has run."""

    stream: _Stream
    position: int  # items of the stream's queue before it
    cuda: torch.cuda.Event | None = None  # GPU, an event of a drained queue: recorded then

    def mark(self) -> torch.cuda.Event | None:
        """GPU: the device event, once the items before it are enqueued; None on the CPU."""
        return self.cuda if self.cuda is not None else self.stream.marks.get(self.position)

    def query(self) -> bool:
        """Complete? (never waits)"""
        if self.stream.done < self.position:
            return False
        mark = self.mark()
        return mark is None or mark.query()

    def synchronize(self) -> None:
        """The host waits until the event is complete (its stream's queue is run up to it)."""
        self.stream.run_until(self.position)
        mark = self.mark()
        if mark is not None:
            mark.synchronize()


class Streams:
    """The main stream and one copy stream of `device`; `delay`: the `late` stream runs late:
    the copy stream (its copies after the main stream's work), or "main" (the device behind
    the host: the main stream's work reaches the device only at a host wait, after the copy
    stream's so far, as a side stream's copy that waits for nothing runs ahead of it)."""

    def __init__(self, device: str, delay: bool = False, late: str = "copy") -> None:
        if late not in ("copy", "main"):
            raise ValueError(f"late: copy or main, got {late!r}")
        self.device, self.delay = device, delay
        cuda = device == "cuda"
        self.main = _Stream(delay and late == "main", torch.cuda.current_stream() if cuda else None)
        self.copy = _Stream(delay and late == "copy", torch.cuda.Stream() if cuda else None)
        if late == "copy":
            self.copy.peer = self.main
        else:
            self.main.peer = self.copy

    @staticmethod
    def _record(stream: _Stream) -> Event:
        """The event after `stream`'s work so far: on a GPU with nothing queued, also after
        what was launched on it directly (the model's kernels), recorded now."""
        position = len(stream.work)
        if stream.device is None or stream.done < position:
            return Event(stream, position)
        return Event(stream, position, stream.device.record_event())

    def _on_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """dst <- src on the copy stream (after the main stream's work so far); its event."""
        self.wait(self.copy, self._record(self.main))
        self.copy.submit(bound_work(dst.copy_, src, non_blocking=True))
        return self._record(self.copy)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Upload a host tensor (pinned on a GPU) into device memory, non-blocking: after the
        main stream's work so far (the destination's earlier users)."""
        return self._on_copy(dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Download device memory into a host tensor (pinned on a GPU), non-blocking: after the
        main stream's work so far (upstream: copy_stream.wait_stream(main_stream))."""
        return self._on_copy(dst, src)

    def copy_after(self, after: Event | None, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """dst <- src on the copy stream after `after` only (None: whatever the main stream
        has queued); its event."""
        if after is not None:
            self.wait(self.copy, after)
        self.copy.submit(bound_work(dst.copy_, src, non_blocking=True))
        return self._record(self.copy)

    def record_main(self) -> Event:
        """The event after the main stream's work so far (upstream: recorded on the compute
        stream)."""
        return self._record(self.main)

    def on_main(self, after: Event | None, fn: Callable[..., object], *args: object) -> Event:
        """`fn(*args)` on the main stream, after `after` (a device-side wait: the host does not
        block); the event after it."""
        if after is not None:
            self.wait(self.main, after)
        self.main.submit(bound_work(fn, *args))
        return self._record(self.main)

    def wait(self, stream: _Stream, event: Event) -> None:
        """`stream` waits for `event` on the device; the host goes on."""
        stream.submit(event)

    def synchronize(self) -> None:
        """The host waits for both streams' work."""
        for stream in (self.copy, self.main, self.copy):
            stream.run_until(len(stream.work))
        if self.device == "cuda":
            torch.cuda.synchronize()

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor for non-blocking copies (pinned on a GPU)."""
        return tensor.pin_memory() if self.device == "cuda" else tensor
