"""Async scheduling's sampling and step outputs: the host returns from a step before the device
has sampled it, and runs the next step's host work meanwhile (upstream: `--async-scheduling`,
the runner's AsyncModelRunnerOutput, vLLM #23569; Model Runner V2's async_utils.AsyncOutput).

- `PinnedSamplingStates`: the allowed-token-ids mask is a reused pinned host tensor, uploaded
  on the copy stream each step it is applied (upstream V1: the input batch's reused CPU
  tensors, vLLM #24527, #25279); the next step's host update rewrites its rows. Fix part
  `async_pinned_reuse_wait` (upstream: prepare_inputs_event): the host waits for the last
  upload before it rewrites them.
- `AsyncSampler`: a step's sampled token ids are written on the main stream into an
  `OutputArena` slot and downloaded on the copy stream; `AsyncOutput.get_output()` waits for
  the download. Fix part `async_output_keep_ref` (vLLM #29623): the output keeps the device
  tensor until then; without it the slot is free when the step returns and the next step's
  sampling takes it before the download reads it.
"""

from __future__ import annotations

import weakref

import torch

from harness.fixes import Fix, Variant
from harness.runner.input_batch import Request, SamplingStates
from harness.runner.streams import Event, Streams

OUTPUT_ROWS = 8  # pinned host rows for downloads, reused round robin (see AsyncSampler)


def _masked(out: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> None:
    out.copy_(logits).masked_fill_(mask, float("-inf"))


def _argmax(out: torch.Tensor, logits: torch.Tensor) -> None:
    torch.argmax(logits, -1, out=out)


class PinnedSamplingStates(SamplingStates):
    """SamplingStates whose mask is a pinned host tensor, uploaded on the copy stream to a
    device mask that the main stream applies after the upload's event."""

    def __init__(self, max_num_reqs: int, vocab_size: int, fixes: Variant, streams: Streams):
        super().__init__(max_num_reqs, vocab_size, fixes)
        self.streams = streams
        self.mask_cpu = streams.pinned(self.mask_cpu)  # NOTE: reused every step, in place
        self.mask = torch.zeros_like(self.mask_cpu, device=streams.device)
        self.uploaded: Event | None = None  # the last upload of mask_cpu

    def add_requests(self, requests: list[Request]) -> bool:
        if Fix.ASYNC_PINNED_REUSE_WAIT in self.fixes and self.uploaded is not None:
            # fix: async_pinned_reuse_wait -- the last upload may not have read the rows yet.
            self.uploaded.synchronize()
        return super().add_requests(requests)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The masked logits, written on the main stream once this step's upload landed."""
        rows = logits.shape[0]
        self.uploaded = self.streams.h2d(self.mask[:rows], self.mask_cpu[:rows])
        masked = torch.empty_like(logits)
        self.streams.on_main(self.uploaded, _masked, masked, logits, self.mask[:rows])
        return masked


class OutputArena:
    """Device memory for sampled token ids, `slots` rows of `width`: a slot is free again when
    the last Python reference to its tensor dies, and the next `take()` gets the slot freed
    last (upstream: PyTorch's caching allocator hands a freed block to the next allocation of
    its size on the same stream; it knows nothing of the copy stream's pending read unless
    `record_stream` told it). The arena is used on both devices so that the reuse is certain."""

    def __init__(self, slots: int, width: int, device: str) -> None:
        self.rows = torch.full((slots, width), -1, dtype=torch.int64, device=device)
        self.free = list(range(slots - 1, -1, -1))  # a stack: slot 0 first

    def take(self) -> torch.Tensor:
        if not self.free:
            raise RuntimeError(f"output arena: all {self.rows.shape[0]} slots are in use")
        slot = self.free.pop()
        tensor = self.rows[slot]
        weakref.finalize(tensor, self.free.append, slot)
        return tensor


class AsyncOutput:
    """A step's output as the host first holds it: its sampled token ids are downloading."""

    def __init__(
        self,
        req_ids: tuple[str, ...],
        sampled: torch.Tensor,
        host: torch.Tensor,
        streams: Streams,
        fixes: Variant,
    ):
        self.req_ids = req_ids
        rows = len(req_ids)
        self.host = host[:rows]
        self.copied = streams.d2h(self.host, sampled[:rows])
        if Fix.ASYNC_OUTPUT_KEEP_REF in fixes:
            # fix: async_output_keep_ref -- the download reads `sampled` later, on the copy stream.
            self.sampled = sampled

    def get_output(self) -> list[int]:
        """The sampled token of each request (the host waits for the download)."""
        self.copied.synchronize()
        tokens = self.host.tolist()
        self.sampled = None
        return tokens


class AsyncSampler:
    """Greedy sampling of a step's (masked) logits into an arena slot, downloaded on the copy
    stream. NOTE: the download's host rows are pinned once and reused round robin, a row every
    OUTPUT_ROWS steps (upstream allocates a pinned tensor per step; allocating one here, between
    a step's upload and the next step's host work, could synchronize the device on a GPU)."""

    def __init__(self, max_num_reqs: int, streams: Streams, fixes: Variant) -> None:
        self.streams, self.fixes = streams, fixes
        self.arena = OutputArena(4, max_num_reqs, streams.device)
        host = torch.full((OUTPUT_ROWS, max_num_reqs), -1, dtype=torch.int64)
        self.host, self.steps = streams.pinned(host), 0

    def sample(self, logits: torch.Tensor, req_ids: tuple[str, ...]) -> AsyncOutput:
        sampled = self.arena.take()
        self.streams.on_main(None, _argmax, sampled[: len(req_ids)], logits)
        host = self.host[self.steps % OUTPUT_ROWS]
        self.steps += 1
        return AsyncOutput(req_ids, sampled, host, self.streams, self.fixes)


def async_sampling(config, vocab_size: int) -> tuple[PinnedSamplingStates, AsyncSampler]:
    """A runner's sampling states and sampler for `config` (a RunnerConfig), on its streams."""
    c = config
    streams = Streams(c.device, c.scheduler.stream_delay, late=c.scheduler.late_stream)
    states = PinnedSamplingStates(c.max_num_reqs, vocab_size, c.fixes, streams)
    return states, AsyncSampler(c.max_num_reqs, streams, c.fixes)
