"""The runner's side of async scheduling: the token rows the worker keeps per request, and the
device fill of a step's placeholders from the previous step's sampled tokens.

With a scheduler one step ahead, step N+1's inputs are prepared while step N's sampled tokens
are still on the device: the worker stamps PLACEHOLDER (-1) in a request's row where each
sampled token goes (upstream: token_ids_cpu), and fills the step's input ids on the device from
step N's sampled tokens, through the request's batch row in step N (upstream:
prev_sampled_token_ids and prev_req_id_to_index in _prepare_input_ids). The host tokens the
scheduler sends along are the engine's processed ones.

NOTE: a request that was not in step N (skipped, or resumed after a preemption) has no row
there: nothing on the device fills its placeholders (vLLM #40768), which is where the fix part
of async_placeholder_leak lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.fixes import Fix, Variant
from harness.runner.input_batch import Request

PLACEHOLDER = -1  # a token id the device fills in later (never a vocabulary id)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a step, as the scheduler sends it to the worker."""

    req_id: str
    start: int  # its first scheduled position (num_computed_tokens before the step)
    token_ids: tuple[int, ...]  # the host's tokens of the scheduled positions, PLACEHOLDER where
    # the token is still on the device (sampled by the step in flight)


@dataclass(frozen=True, slots=True)
class PrevSampled:
    """Where a step's placeholders come from: step N's sampled tokens, on the device."""

    sampled: torch.Tensor  # [num_reqs of step N] int64
    dst: torch.Tensor  # [n] int64, positions in this step's input ids
    src: torch.Tensor  # [n] int64, batch rows of step N

    def fill(self, input_ids: torch.Tensor) -> None:
        """Write the placeholders' tokens into the step's input ids (device work)."""
        input_ids.index_copy_(0, self.dst, self.sampled.index_select(0, self.src))


class TokenRows:
    """The worker's copy of each request's tokens from position 0: what the scheduler sent for
    positions it never saw, PLACEHOLDER where a step sampled a token (it stays on the device)."""

    def __init__(self, fixes: Variant, device: str) -> None:
        self.fixes, self.device = fixes, device
        self.rows: dict[str, list[int]] = {}
        self.prev_rows: dict[str, int] = {}  # req_id -> batch row in the last step

    def prepare(
        self, step: list[ScheduledRequest], sampled: torch.Tensor | None
    ) -> tuple[list[Request], PrevSampled | None]:
        """The step's requests (input ids from the rows) and the device fill of their
        placeholders from the last step's `sampled` tokens; stamps each request's next token."""
        requests, dst, src, offset = [], [], [], 0
        for s in step:
            row = self.rows.setdefault(s.req_id, [])
            end = s.start + len(s.token_ids)
            if len(row) < end:  # positions the worker never saw: the scheduler's tokens
                row.extend(s.token_ids[len(row) - s.start :])
            prev = self.prev_rows.get(s.req_id, -1)
            if prev < 0 and Fix.ASYNC_PLACEHOLDER_HOST_FILL in self.fixes:
                # fix: async_placeholder_host_fill -- no row in the last step fills them: the host's
                row[s.start : end] = s.token_ids
            ids = row[s.start : end]
            if prev >= 0 and ids[-1] == PLACEHOLDER:  # the token the last step sampled
                dst.append(offset + len(ids) - 1)
                src.append(prev)
            requests.append(Request(s.req_id, tuple(ids), 0, s.start))
            offset += len(ids)
            row[end:] = [PLACEHOLDER]  # this step's sampled token stays on the device
        self.prev_rows = {s.req_id: r for r, s in enumerate(step)}
        if not dst or sampled is None:
            return requests, None
        index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
        return requests, PrevSampled(sampled, index(dst), index(src))

    def forget(self, req_id: str) -> None:
        """A finished request's row goes."""
        self.rows.pop(req_id, None)
