"""Persistent input buffers and the InputBatch views a step runs on.

NOTE: the buffers keep their addresses for the runner's lifetime: captured graphs read them, so
every batch is written into them in place. A batch may be padded (to a captured graph's size):
padding tokens are id 0 at position 0 of row 0, without LoRA and without a KV-cache slot;
padding requests are empty, of length 1, sampled from token 0.

SamplingStates holds per-request sampling state in request rows (the allowed-token-ids mask);
a batch that splits decodes from prefills is reordered by swapping rows (decode_first_swaps),
where vLLM #48419's fix part lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.fixes import Fix, Variant


@dataclass(frozen=True, slots=True)
class Request:
    req_id: str
    token_ids: tuple[int, ...]  # tokens scheduled this step
    lora_id: int = 0  # 0 = base model
    num_computed_tokens: int = 0  # position of the first scheduled token
    allowed_token_ids: tuple[int, ...] | None = None  # SamplingParams.allowed_token_ids


@dataclass(frozen=True, slots=True)
class InputBatch:
    num_reqs: int
    num_tokens: int
    num_tokens_after_padding: int
    num_reqs_after_padding: int
    input_ids: torch.Tensor  # [num_tokens_after_padding], views of the persistent buffers
    positions: torch.Tensor  # [num_tokens_after_padding] int64
    token_rows: torch.Tensor  # [num_tokens_after_padding] int32, batch row of each token
    query_start_loc: torch.Tensor  # [num_reqs_after_padding + 1] int32
    idx_mapping: torch.Tensor  # [num_reqs_after_padding] int32, batch row -> request state row
    seq_lens: torch.Tensor  # [num_reqs_after_padding] int32, tokens in the KV cache after the step
    logits_indices: torch.Tensor  # [num_reqs_after_padding] int64, the sampled token of a row
    token_lora_ids: tuple[int, ...]  # [num_tokens_after_padding], 0 for padding
    req_lora_ids: tuple[int, ...]  # [num_reqs_after_padding], 0 for padding
    is_dummy: bool = False

    @property
    def uniform_decode(self) -> bool:
        """One token per request, padding included: what FULL decode graphs and the split-KV
        decode backend serve."""
        rows = self.num_reqs_after_padding
        return self.num_tokens_after_padding == rows and self.num_tokens == self.num_reqs


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: str) -> None:
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        tokens = lambda dtype: torch.zeros(max_num_tokens, dtype=dtype, device=device)
        reqs = lambda n, dtype: torch.zeros(n, dtype=dtype, device=device)
        self.input_ids, self.positions = tokens(torch.long), tokens(torch.long)
        self.token_rows = tokens(torch.int32)
        self.query_start_loc = reqs(max_num_reqs + 1, torch.int32)
        self.idx_mapping, self.seq_lens = (
            reqs(max_num_reqs, torch.int32),
            reqs(max_num_reqs, torch.int32),
        )
        self.logits_indices = reqs(max_num_reqs, torch.long)

    def _write(self, lengths: list[int], starts: list[int], padded: int, padded_reqs: int) -> None:
        """Rows, positions, offsets, lengths and sampled tokens of requests of `lengths` tokens
        whose first token sits at position `starts[r]`."""
        n, r = sum(lengths), len(lengths)
        if not 0 < n <= padded <= self.max_num_tokens or not r <= padded_reqs <= self.max_num_reqs:
            raise ValueError(
                f"{r} requests, {n} tokens padded to {padded_reqs} requests, {padded} tokens: "
                f"over the buffers ({self.max_num_reqs} requests, {self.max_num_tokens} tokens)"
            )
        rows = [row for row, length in enumerate(lengths) for _ in range(length)]
        positions = [
            s + p for s, length in zip(starts, lengths, strict=True) for p in range(length)
        ]
        ends = torch.cumsum(torch.tensor(lengths), 0).tolist()
        pad, pad_reqs = padded - n, padded_reqs - r
        self.token_rows[:padded].copy_(torch.tensor(rows + [0] * pad))
        self.positions[:padded].copy_(torch.tensor(positions + [0] * pad))
        self.query_start_loc[: padded_reqs + 1].copy_(torch.tensor([0, *ends] + [n] * pad_reqs))
        self.idx_mapping[:padded_reqs].copy_(torch.tensor(list(range(r)) + [0] * pad_reqs))
        seq_lens = [s + length for s, length in zip(starts, lengths, strict=True)]
        self.seq_lens[:padded_reqs].copy_(torch.tensor(seq_lens + [1] * pad_reqs))
        self.logits_indices[:padded_reqs].copy_(
            torch.tensor([e - 1 for e in ends] + [0] * pad_reqs)
        )

    def _batch(self, n, r, padded, padded_reqs, token_loras, req_loras, dummy) -> InputBatch:
        return InputBatch(
            r,
            n,
            padded,
            padded_reqs,
            self.input_ids[:padded],
            self.positions[:padded],
            self.token_rows[:padded],
            self.query_start_loc[: padded_reqs + 1],
            self.idx_mapping[:padded_reqs],
            self.seq_lens[:padded_reqs],
            self.logits_indices[:padded_reqs],
            token_loras,
            req_loras,
            dummy,
        )

    def prepare(self, requests: list[Request], padded: int, padded_reqs: int) -> InputBatch:
        """Write the requests' tokens in place, padded to `padded` tokens, `padded_reqs` rows."""
        lengths = [len(r.token_ids) for r in requests]
        self._write(lengths, [r.num_computed_tokens for r in requests], padded, padded_reqs)
        ids = [t for r in requests for t in r.token_ids]
        n, pad, pad_reqs = len(ids), padded - len(ids), padded_reqs - len(requests)
        self.input_ids[:padded].copy_(torch.tensor(ids + [0] * pad))
        token_loras = tuple(r.lora_id for r in requests for _ in r.token_ids) + (0,) * pad
        req_loras = tuple(r.lora_id for r in requests) + (0,) * pad_reqs
        return self._batch(n, len(requests), padded, padded_reqs, token_loras, req_loras, False)

    def dummy(self, num_tokens: int, num_reqs: int) -> InputBatch:
        """A dummy batch (profile, warm-up, capture): token id 0 (dummy_lengths), no LoRA ids
        set."""
        self._write(dummy_lengths(num_tokens, num_reqs), [0] * num_reqs, num_tokens, num_reqs)
        self.input_ids[:num_tokens].zero_()
        zeros = (0,) * num_tokens, (0,) * num_reqs
        return self._batch(num_tokens, num_reqs, num_tokens, num_reqs, *zeros, True)


def dummy_lengths(num_tokens: int, num_reqs: int) -> list[int]:
    """A dummy batch's tokens per request: split evenly, the last request takes the rest."""
    lengths = [num_tokens // num_reqs] * (num_reqs - 1)
    return [*lengths, num_tokens - sum(lengths)]


class SamplingStates:
    """Per-request sampling state in request rows: the allowed-token-ids mask (True: the token
    is not allowed), a host tensor copied to the logits' device each step (upstream:
    InputBatch.allowed_token_ids_mask_cpu_tensor). This runner keeps no request across steps:
    the rows are written from each step's requests, then reordered with them."""

    def __init__(self, max_num_reqs: int, vocab_size: int, fixes: Variant) -> None:
        self.mask_cpu = torch.zeros(max_num_reqs, vocab_size, dtype=torch.bool)
        self.fixes = fixes

    def add_requests(self, requests: list[Request]) -> bool:
        """Write the mask rows of `requests` in their order; whether any is restricted."""
        self.mask_cpu[: len(requests)] = False
        for row, q in enumerate(requests):
            if q.allowed_token_ids is not None:
                self.mask_cpu[row] = True
                self.mask_cpu[row, list(q.allowed_token_ids)] = False
        return any(q.allowed_token_ids is not None for q in requests)

    def swap_states(self, i1: int, i2: int) -> None:
        """Rows i1 and i2 trade their sampling state."""
        mask = self.mask_cpu
        if Fix.INPUT_BATCH_SWAP_COPY in self.fixes:
            # fix: input_batch_swap_copy -- list indexing copies both rows before either is written
            mask[[i1, i2]] = mask[[i2, i1]]
        else:  # two views of live rows: row i1 is overwritten before the second write reads it
            mask[i1], mask[i2] = mask[i2], mask[i1]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [num_reqs, vocab] with every disallowed token at -inf (a new tensor)."""
        mask = self.mask_cpu[: logits.shape[0]].to(logits.device)
        return logits.masked_fill(mask, float("-inf"))


def decode_first_swaps(is_decode: list[bool]) -> list[tuple[int, int]]:
    """The row swaps that put every decode before every prefill: the first prefill trades
    places with the last decode until none is behind one (upstream:
    reorder_batch_to_split_decodes_and_prefills, for backends that split them)."""
    order, swaps = list(is_decode), []
    front, back = 0, len(order) - 1
    while True:
        while front < back and order[front]:
            front += 1
        while front < back and not order[back]:
            back -= 1
        if front >= back:
            return swaps
        swaps.append((front, back))
        order[front], order[back] = True, False
