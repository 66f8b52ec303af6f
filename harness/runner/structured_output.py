"""Structured outputs: a toy grammar per guided request, the scheduler's compact bitmask and the
worker's scatter of it into a batch-sized mask applied to the step's logits (upstream V1:
StructuredOutputManager.grammar_bitmask on the scheduler, apply_grammar_bitmask in
vllm/v1/structured_output/utils.py on the worker).

The scheduler sends one packed int32 row per guided request, in its own order (it does not know
the runner's rows), with the guided request ids in that order (`GrammarOutput`). The worker
writes each row into the batch-sized mask at its request's row, and the apply kernel
(kernels/grammar_bitmask.py) masks every logits row by its mask row, as xgrammar does when the
mask is aligned with the logits (no indices). So a row that no guided request fills must be the
neutral row (every bit set): fix part `grammar_neutral_fill` (vllm-gaudi #1199, #1200: the
reordered mask was created full of zeros, forbidding every token of a free request; upstream's
own fix, vLLM #22896, was not found to read). And only the guided requests' rows are
written: fix part `grammar_guided_row_count` (vLLM #22963: the count of rows was taken from
the batch-sized mask's length, not from the guided requests' indices), else the scatter runs
on past the scheduler's rows into the staging buffers' stale entries (another step's rows,
another step's row indices).

NOTE: the worker's staging buffers (the scheduler's rows and their batch rows) and the mask are
persistent, written in place each step, as a runner that captures graphs keeps its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.fixes import Fix, Variant
from kernels.grammar_bitmask import NEUTRAL, apply_token_bitmask, pack_allowed, words_per_row


@dataclass(frozen=True, slots=True)
class ToyGrammar:
    """A deterministic automaton over token ids: in state s the tokens t with t % modulus == s
    are allowed; accepting t moves to state (s + t + 1) % modulus."""

    modulus: int
    start: int = 0

    def allowed(self, state: int, vocab_size: int) -> list[int]:
        return list(range(state % self.modulus, vocab_size, self.modulus))

    def advance(self, state: int, token: int) -> int:
        if token % self.modulus != state % self.modulus:
            raise ValueError(f"token {token} not allowed in state {state} (mod {self.modulus})")
        return (state + token + 1) % self.modulus


@dataclass(frozen=True, slots=True)
class GrammarOutput:
    """The scheduler's bitmask of a step (upstream: GrammarOutput): one packed row per guided
    request, in `req_ids`' order (the scheduler's, not the batch's)."""

    req_ids: tuple[str, ...]
    bitmask: torch.Tensor  # [len(req_ids), words] int32, on the host


def grammar_bitmask(guided: list[tuple[str, ToyGrammar, int]], vocab_size: int) -> GrammarOutput:
    """The scheduler's compact bitmask of `guided` (request id, grammar, state), in that order."""
    rows = [grammar.allowed(state, vocab_size) for _, grammar, state in guided]
    return GrammarOutput(tuple(r for r, _, _ in guided), pack_allowed(rows, vocab_size))


class StructuredOutputsWorker:
    """The worker's side: the scheduler's rows scattered into a batch-sized mask, then applied
    to the step's logits by the Triton kernel."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: str, fixes: Variant) -> None:
        words = words_per_row(vocab_size)
        self.fixes, self.device = fixes, device
        # staging of the scheduler's rows and of each one's batch row (host), and the mask
        self.sched_rows = torch.zeros(max_num_reqs, words, dtype=torch.int32)
        self.batch_rows = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.mask_cpu = torch.zeros(max_num_reqs, words, dtype=torch.int32)
        self.mask = torch.zeros(max_num_reqs, words, dtype=torch.int32, device=device)

    def scatter(self, grammar: GrammarOutput, req_ids: tuple[str, ...]) -> torch.Tensor:
        """The batch-sized mask [len(req_ids), words] on the host: each guided request's row at
        its batch row."""
        num_guided, row_of = len(grammar.req_ids), {r: i for i, r in enumerate(req_ids)}
        self.sched_rows[:num_guided] = grammar.bitmask
        self.batch_rows[:num_guided] = torch.tensor([row_of[r] for r in grammar.req_ids])
        mask = self.mask_cpu[: len(req_ids)]
        if Fix.GRAMMAR_NEUTRAL_FILL in self.fixes:
            # fix: grammar_neutral_fill -- a row no guided request fills allows every token.
            mask.fill_(NEUTRAL)
        count = mask.shape[0]  # the batch-sized mask's rows
        if Fix.GRAMMAR_GUIDED_ROW_COUNT in self.fixes:
            # fix: grammar_guided_row_count -- as many rows as the guided requests have.
            count = num_guided
        for i in range(count):
            mask[self.batch_rows[i]] = self.sched_rows[i]
        return mask

    def apply(self, grammar: GrammarOutput, req_ids: tuple[str, ...], logits: torch.Tensor, launch):
        """Mask `logits` [len(req_ids), vocab] in place (upstream: before the sampler)."""
        mask = self.scatter(grammar, req_ids)
        self.mask[: mask.shape[0]].copy_(mask)
        launch(apply_token_bitmask, logits, self.mask[: mask.shape[0]])
