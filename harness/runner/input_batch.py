"""Persistent input buffers and the InputBatch views a step runs on.

NOTE: the buffers keep their addresses for the runner's lifetime: captured graphs read them, so
every batch is written into them in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Request:
    req_id: str
    token_ids: tuple[int, ...]  # tokens scheduled this step
    lora_id: int = 0  # 0 = base model
    num_computed_tokens: int = 0  # position of the first scheduled token


@dataclass(frozen=True, slots=True)
class InputBatch:
    num_reqs: int
    num_tokens: int
    num_tokens_after_padding: int
    input_ids: torch.Tensor  # [num_tokens_after_padding], view of the persistent buffer
    positions: torch.Tensor  # [num_tokens_after_padding]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    idx_mapping: torch.Tensor  # [num_reqs] request -> state slot
    token_lora_ids: tuple[int, ...]  # [num_tokens_after_padding], 0 for padding
    req_lora_ids: tuple[int, ...]  # [num_reqs]


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: str) -> None:
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)

    def _batch(self, num_reqs, num_tokens, padded, token_lora_ids, req_lora_ids) -> InputBatch:
        return InputBatch(
            num_reqs,
            num_tokens,
            padded,
            self.input_ids[:padded],
            self.positions[:padded],
            self.query_start_loc[: num_reqs + 1],
            self.idx_mapping[:num_reqs],
            token_lora_ids,
            req_lora_ids,
        )

    def prepare(self, requests: list[Request], num_tokens_after_padding: int) -> InputBatch:
        """Write the requests' tokens in place; padding tokens are id 0 on no LoRA."""
        ids = [t for r in requests for t in r.token_ids]
        n, padded = len(ids), num_tokens_after_padding
        if not 0 < n <= padded <= self.max_num_tokens or len(requests) > self.max_num_reqs:
            raise ValueError(
                f"{len(requests)} requests, {n} tokens padded to {padded}: over the "
                f"buffers ({self.max_num_reqs} requests, {self.max_num_tokens} tokens)"
            )
        lengths = [len(r.token_ids) for r in requests]
        self.input_ids[:padded].copy_(torch.tensor(ids + [0] * (padded - n)))
        positions = [r.num_computed_tokens + p for r in requests for p in range(len(r.token_ids))]
        self.positions[:padded].copy_(torch.tensor(positions + [0] * (padded - n)))
        starts = torch.cumsum(torch.tensor([0, *lengths]), 0)
        self.query_start_loc[: len(requests) + 1].copy_(starts)
        self.idx_mapping[: len(requests)].copy_(torch.arange(len(requests)))
        token_loras = tuple(r.lora_id for r in requests for _ in r.token_ids) + (0,) * (padded - n)
        return self._batch(
            len(requests), n, padded, token_loras, tuple(r.lora_id for r in requests)
        )

    def dummy(self, num_tokens: int, num_reqs: int) -> InputBatch:
        """A dummy batch (warm-up, profile, capture): token id 0, no LoRA ids set."""
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].zero_()
        self.query_start_loc[: num_reqs + 1].zero_()
        self.idx_mapping[:num_reqs].zero_()
        return self._batch(num_reqs, num_tokens, num_tokens, (0,) * num_tokens, (0,) * num_reqs)
