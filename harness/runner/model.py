"""A tiny seeded decoder with LoRA on its embedding and its layers, and a dense reference.

embed (+ LoRA: gather A rows at input_ids + embeddings_indices[1][:n], then expand)
-> num_layers x relu(h @ W.T + LoRA) -> logits = h @ head.T, where each layer's LoRA has two
slices (as a fused gate|up projection): slice s adds scale * (h @ A[s].T) @ B[s].T to its half
of the columns.
Weights and adapters are small integers, so every result is exact in float32 and replay,
eager and reference compare with ==. All device work goes through `launch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.runner.lora import PunicaWrapper
from kernels.lora_ops import Launch


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    max_loras: int = 2
    max_lora_rank: int = 16
    lora_scale: float = 2.0
    seed: int = 0


def _ints(gen: torch.Generator, *shape: int, low: int = -1, high: int = 2) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen).float()


class TinyLoRADecoder:
    # NOTE: LoRA layers by prefix; the runner maps each prefix to a punica wrapper.
    PREFIXES = ("model.embed_tokens", "model.layers.0", "model.layers.1")
    LAYER_SLICES = 2

    def __init__(self, config: ModelConfig, device: str) -> None:
        c, gen = config, torch.Generator().manual_seed(config.seed)
        self.config, self.device = config, device
        self.embed = _ints(gen, c.vocab_size, c.hidden_size).to(device)
        self.layers = [
            _ints(gen, c.hidden_size, c.hidden_size).to(device) for _ in range(c.num_layers)
        ]
        self.head = _ints(gen, c.vocab_size, c.hidden_size).to(device)
        zeros = lambda *shape: torch.zeros(*shape, device=device)
        # LoRA weights stacked per slice and slot, filled in place by load_lora
        k, width = self.LAYER_SLICES, c.hidden_size // self.LAYER_SLICES
        self.embed_a = zeros(c.max_loras * c.vocab_size, c.max_lora_rank)  # [L * vocab, rank]
        self.embed_b = zeros(1, c.max_loras, c.hidden_size, c.max_lora_rank)
        self.lora_a = [zeros(k, c.max_loras, c.max_lora_rank, c.hidden_size) for _ in self.layers]
        self.lora_b = [zeros(k, c.max_loras, width, c.max_lora_rank) for _ in self.layers]

    def load_lora(self, slot: int, seed: int) -> None:
        """Write a seeded adapter into `slot` of every stacked LoRA tensor."""
        c, gen = self.config, torch.Generator().manual_seed(seed)
        rows = slice(slot * c.vocab_size, (slot + 1) * c.vocab_size)
        self.embed_a[rows] = _ints(gen, c.vocab_size, c.max_lora_rank).to(self.device)
        self.embed_b[0, slot] = _ints(gen, c.hidden_size, c.max_lora_rank).to(self.device)
        for a, b in zip(self.lora_a, self.lora_b, strict=True):
            a[:, slot] = _ints(gen, *a[:, slot].shape).to(self.device)
            b[:, slot] = _ints(gen, *b[:, slot].shape).to(self.device)

    def forward(
        self, input_ids: torch.Tensor, wrappers: list[PunicaWrapper], launch: Launch
    ) -> torch.Tensor:
        """logits [n, vocab] for input_ids [n]; wrappers[i] serves PREFIXES[i]."""
        c, n = self.config, input_ids.shape[0]
        h = torch.empty(n, c.hidden_size, device=self.device)
        a_rows = torch.empty(1, n, c.max_lora_rank, device=self.device)
        offsets = wrappers[0].embeddings_indices[1, :n]
        launch(_embed, input_ids, offsets, self.embed, self.embed_a, h, a_rows)
        wrappers[0].add_lora_embedding(h, a_rows, self.embed_b, launch)
        for i, weight in enumerate(self.layers):
            y = torch.empty(n, c.hidden_size, device=self.device)
            buffer = torch.empty(self.LAYER_SLICES, n, c.max_lora_rank, device=self.device)
            launch(torch.mm, h, weight.T, out=y)
            wrappers[i + 1].add_lora_linear(
                y, h, self.lora_a[i], self.lora_b[i], c.lora_scale, buffer, launch
            )
            launch(torch.relu_, y)
            h = y
        logits = torch.empty(n, c.vocab_size, device=self.device)
        launch(torch.mm, h, self.head.T, out=logits)
        return logits

    def reference(self, token_ids: list[int], slots: list[int]) -> torch.Tensor:
        """Dense float64 logits on the CPU; slot -1 = base model."""
        c = self.config
        d = lambda t: t.detach().double().cpu()
        h = d(self.embed)[token_ids]
        for t, s in enumerate(slots):
            if s != -1:
                h[t] += d(self.embed_a)[s * c.vocab_size + token_ids[t]] @ d(self.embed_b[0, s]).T
        width = c.hidden_size // self.LAYER_SLICES
        for w, a, b in zip(self.layers, self.lora_a, self.lora_b, strict=True):
            y = h @ d(w).T
            for t, s in enumerate(slots):
                for k in range(self.LAYER_SLICES if s != -1 else 0):
                    delta = c.lora_scale * (h[t] @ d(a[k, s]).T) @ d(b[k, s]).T
                    y[t, k * width : (k + 1) * width] += delta
            h = y.relu()
        return h @ d(self.head).T


def _embed(input_ids, offsets, weight, lora_a_2d, h, a_rows) -> None:
    """Base rows, and the LoRA-A rows at input_ids + offsets (a bad offset fails the gather:
    a device-side assert on the GPU, IndexError on the CPU)."""
    h.copy_(F.embedding(input_ids, weight))
    a_rows[0].copy_(F.embedding(input_ids + offsets, lora_a_2d))
