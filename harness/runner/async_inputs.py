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
from harness.runner.input_batch import InputBatch, Request

PLACEHOLDER = -1  # a token id the device fills in later (never a vocabulary id)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a step, as the scheduler sends it to the worker."""

    req_id: str
    start: int  # its first scheduled position (num_computed_tokens before the step)
    token_ids: tuple[int, ...]  # the host's tokens of the scheduled positions, PLACEHOLDER where
    # the token is still on the device (sampled by the step in flight)


@dataclass(frozen=True, slots=True)
class LastStep:
    """What step N left on the device for the next one."""

    next_inputs: torch.Tensor  # [num_reqs, 1 + num_spec_tokens] int64: sampled token, drafts
    rejected: torch.Tensor  # [num_reqs] int64, the drafts step N's verification rejected


@dataclass(frozen=True, slots=True)
class PrevSampled:
    """Step N+1's device fill from step N (upstream: _prepare_input_ids, and the positions and
    sequence lengths corrected by the rejected drafts): placeholders take step N's next input
    tokens; a request of step N starts its positions earlier by its rejected drafts."""

    last: LastStep
    dst: torch.Tensor  # [n] int64, placeholder positions in this step's input ids
    src: torch.Tensor  # [n] int64, flat indices into last.next_inputs
    tokens: torch.Tensor  # [m] int64, the tokens of requests that were in step N
    token_src: torch.Tensor  # [m] int64, their requests' rows in step N
    rows: torch.Tensor  # [r] int64, the batch rows of requests that were in step N
    row_src: torch.Tensor  # [r] int64, their rows in step N

    def fill(self, batch: InputBatch) -> None:
        """Write the placeholders' tokens and shift the positions (device work)."""
        last = self.last
        batch.input_ids.index_copy_(
            0, self.dst, last.next_inputs.view(-1).index_select(0, self.src)
        )
        shift = last.rejected.index_select(0, self.token_src).to(batch.positions.dtype)
        batch.positions.index_add_(0, self.tokens, -shift)
        lens = last.rejected.index_select(0, self.row_src).to(batch.seq_lens.dtype)
        batch.seq_lens.index_add_(0, self.rows, -lens)


class TokenRows:
    """The worker's copy of each request's tokens from position 0: what the scheduler sent for
    positions it never saw, PLACEHOLDER where a step sampled a token (it stays on the device)."""

    def __init__(self, fixes: Variant, device: str) -> None:
        self.fixes, self.device = fixes, device
        self.rows: dict[str, list[int]] = {}
        self.prev_rows: dict[str, int] = {}  # req_id -> batch row in the last step

    def prepare(
        self, step: list[ScheduledRequest], last: LastStep | None
    ) -> tuple[list[Request], PrevSampled | None]:
        """The step's requests (input ids from the rows) and the device fill from what the last
        step left (`last`); stamps each request's next token."""
        requests, fill, offset = [], ([], [], [], [], [], []), 0
        for r, s in enumerate(step):
            row = self.rows.setdefault(s.req_id, [])
            end = s.start + len(s.token_ids)
            if len(row) < end:  # positions the worker never saw: the scheduler's tokens
                row.extend(s.token_ids[len(row) - s.start :])
            prev = self.prev_rows.get(s.req_id, -1)
            if prev < 0 and Fix.ASYNC_PLACEHOLDER_HOST_FILL in self.fixes:
                # fix: async_placeholder_host_fill -- no row in the last step fills them: the host's
                row[s.start : end] = s.token_ids
            ids = row[s.start : end]
            if prev >= 0 and last is not None:  # the sampled token first, then the drafts
                _add_fill(fill, ids, offset, r, prev, last.next_inputs.shape[1])
            requests.append(Request(s.req_id, tuple(ids), 0, s.start))
            offset += len(ids)
            row[end:] = [PLACEHOLDER]  # this step's sampled token stays on the device
        self.prev_rows = {s.req_id: r for r, s in enumerate(step)}
        if not fill[0] or last is None:
            return requests, None
        index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
        return requests, PrevSampled(last, *(index(xs) for xs in fill))

    def forget(self, req_id: str) -> None:
        """A finished request's row goes."""
        self.rows.pop(req_id, None)


def _add_fill(fill, ids: list[int], offset: int, row: int, prev: int, width: int) -> None:
    """Append a request's share of the fill: its placeholders from step N's row `prev` (in
    column order), its tokens and its row for the rejected drafts' shift."""
    dst, src, tokens, token_src, rows, row_src = fill
    holes = [offset + i for i, t in enumerate(ids) if t == PLACEHOLDER]
    dst += holes
    src += [prev * width + j for j in range(len(holes))]
    tokens += range(offset, offset + len(ids))
    token_src += [prev] * len(ids)
    rows.append(row)
    row_src.append(prev)
