"""The engine loop one step ahead: schedule and launch step N+1 (async_scheduler.py), then
process step N's output; the step's verification and sampling run on the device.

Speculative decoding here: the drafter proposes the sampled token again, on the device; the
verification accepts every draft except at the engine's `reject_steps` (launched-step indices),
where it rejects them all: deterministic by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runner.async_inputs import PLACEHOLDER, LastStep, TokenRows
from harness.runner.async_scheduler import AsyncScheduler, StepPlan
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A launched step, as the device ran it (for oracles)."""

    requests: list[Request]  # as scheduled (positions before the device's shift)
    positions: torch.Tensor  # [num_tokens] int64, after the shift
    logits: torch.Tensor  # [num_tokens, vocab], every token's
    valid: torch.Tensor  # [num_tokens] bool: the token's position is in the sequence


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """A step's results on the device, read by the host one step later."""

    emitted: torch.Tensor  # [num_reqs, 1 + num_spec_tokens] int64: accepted drafts, the
    # sampled token, PLACEHOLDER for each rejected draft
    last: LastStep


class AsyncEngine:
    """The engine loop one step ahead: schedule and launch step N+1, then process step N."""

    def __init__(
        self, runner: ModelRunner, scheduler: AsyncScheduler, reject_steps: tuple[int, ...] = ()
    ) -> None:
        self.runner, self.scheduler, self.reject_steps = runner, scheduler, reject_steps
        self.rows = TokenRows(runner.fixes, runner.device)
        self.in_flight: tuple[StepPlan, DeviceStep] | None = None
        self.steps: list[StepRecord] = []

    def step(self) -> None:
        """Schedule step N+1 and launch it (its placeholders filled from step N on the device),
        then let step N's tokens reach the host."""
        plan = self.scheduler.schedule()
        last = self.in_flight[1].last if self.in_flight else None
        requests, fill = self.rows.prepare(plan.scheduled, last)
        launched = None
        if requests:
            out = self.runner.execute_model(requests, use_cudagraph=False, prev_sampled=fill)
            launched = (plan, self._sample(requests, out.hidden_states))
        if self.in_flight is not None:
            plan_n, done = self.in_flight[0], self.in_flight[1]
            emitted = [[t for t in row if t != PLACEHOLDER] for row in done.emitted.tolist()]
            finished = self.scheduler.update_from_output(
                plan_n, emitted, done.last.rejected.tolist()
            )
            for req_id in finished:
                self.rows.forget(req_id)
        self.in_flight = launched

    def _sample(self, requests: list[Request], hidden: torch.Tensor) -> DeviceStep:
        """The step's verification and sampling, on the device: greedy targets at every
        position; a decode accepts its drafts (none at a reject step) and samples at the first
        position past them, a prefill samples at its last; the drafter proposes the sampled
        token again."""
        k, device, n = self.scheduler.num_spec_tokens, self.runner.device, hidden.shape[0]
        reject = len(self.steps) in self.reject_steps
        spec = [bool(q.num_computed_tokens) and len(q.token_ids) == 1 + k for q in requests]
        accepted = [k if s and not reject else 0 for s in spec]
        offsets, lasts, valid = [], [], []
        for q, s, a in zip(requests, spec, accepted, strict=True):
            offsets.append(len(valid))
            lasts.append(len(valid) + (a if s else len(q.token_ids) - 1))
            valid += [not s or i <= a for i in range(len(q.token_ids))]
        index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
        logits = hidden @ self.runner.model.head.T  # [num_tokens, vocab]
        sampled = logits.argmax(-1).index_select(0, index(lasts))  # [num_reqs]
        columns = torch.arange(k, device=device)
        draft_at = (index(offsets)[:, None] + 1 + columns).clamp(max=n - 1)
        ids = self.runner.input_buffers.input_ids[:n]
        drafts = torch.where(columns < index(accepted)[:, None], ids[draft_at], PLACEHOLDER)
        rejected = index([k - a if s else 0 for s, a in zip(spec, accepted, strict=True)])
        positions = self.runner.input_buffers.positions[:n].clone()
        self.steps.append(StepRecord(requests, positions, logits, torch.tensor(valid)))
        emitted = torch.cat([drafts, sampled[:, None]], 1)
        return DeviceStep(emitted, LastStep(sampled[:, None].repeat(1, 1 + k), rejected))

    def run(self, max_steps: int) -> None:
        """Step until every request finished (or `max_steps`)."""
        for _ in range(max_steps):
            if not (self.scheduler.waiting or self.scheduler.running or self.in_flight):
                return
            self.step()
