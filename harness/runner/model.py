"""A tiny seeded decoder with LoRA on its embedding and its layers.

embed (+ LoRA: gather A rows at input_ids + embeddings_indices[1][:n], then expand)
-> num_layers x [attention, when the step has a KV cache] relu(h @ W.T + LoRA)
-> logits = h @ head.T, where each layer's LoRA has two slices (as a fused gate|up
projection): slice s adds scale * (h @ A[s].T) @ B[s].T to its half of the columns.
Attention (layer i uses KV-cache group i): q, k, v projections, K/V written through the slot
mapping, paged causal attention through the block table, h += o @ Wo.T.
Without attention, weights and adapters are small integers: every result is exact in float32
and replay, eager and the dense reference (harness.oracle) compare with ==. All device work
goes through `launch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.runner.lora import PunicaWrapper
from kernels.lora_ops import Launch
from kernels.paged_attention import paged_attention, reshape_and_cache


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    max_loras: int = 2
    max_lora_rank: int = 16
    lora_scale: float = 2.0
    num_heads: int = 2
    seed: int = 0


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's KV-cache view: per group caches, slots and block tables (batch rows)."""

    k_caches: list[torch.Tensor]  # per group [num_blocks, block_size, heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mappings: torch.Tensor  # [num_groups, num_tokens] int64
    block_tables: list[torch.Tensor]  # per group [num_reqs, max_num_blocks] int32
    token_rows: torch.Tensor  # [num_tokens] int32, batch row of each token
    positions: torch.Tensor  # [num_tokens] int64
    max_model_len: int


def _ints(gen: torch.Generator, *shape: int, low: int = -1, high: int = 2) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen).float()


class TinyLoRADecoder:
    # NOTE: LoRA layers by prefix; the runner maps each prefix to a punica wrapper.
    PREFIXES = ("model.embed_tokens", "model.layers.0", "model.layers.1")
    LAYER_SLICES = 2

    def __init__(
        self,
        config: ModelConfig,
        device: str,
        place: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`place` puts a base weight where it lives (default: on `device`)."""
        c = config
        self.config, self.device = config, device
        place = place or (lambda t: t.to(device))
        weights = self._seeded_weights()
        self.embed, self.head = place(weights["embed"]), place(weights["head"])
        self.layers = [place(w) for w in weights["layers"]]
        self.attn = [[place(w) for w in ws] for ws in weights["attn"]]  # per layer q, k, v, o
        zeros = lambda *shape: torch.zeros(*shape, device=device)
        # LoRA weights stacked per slice and slot, filled in place by load_lora
        k, width = self.LAYER_SLICES, c.hidden_size // self.LAYER_SLICES
        self.embed_a = zeros(c.max_loras * c.vocab_size, c.max_lora_rank)  # [L * vocab, rank]
        self.embed_b = zeros(1, c.max_loras, c.hidden_size, c.max_lora_rank)
        self.lora_a = [zeros(k, c.max_loras, c.max_lora_rank, c.hidden_size) for _ in self.layers]
        self.lora_b = [zeros(k, c.max_loras, width, c.max_lora_rank) for _ in self.layers]

    def _seeded_weights(self) -> dict:
        c, gen = self.config, torch.Generator().manual_seed(self.config.seed)
        embed = _ints(gen, c.vocab_size, c.hidden_size)
        layers = [_ints(gen, c.hidden_size, c.hidden_size) for _ in range(c.num_layers)]
        head = _ints(gen, c.vocab_size, c.hidden_size)
        attn = [
            [torch.randn(c.hidden_size, c.hidden_size, generator=gen) * 0.25 for _ in range(4)]
            for _ in range(c.num_layers)
        ]
        return {"embed": embed, "layers": layers, "head": head, "attn": attn}

    def reload_weights(self) -> None:
        """Write the seeded base weights again, in place (after their memory was discarded)."""
        weights = self._seeded_weights()
        self.embed.copy_(weights["embed"])
        self.head.copy_(weights["head"])
        for mine, fresh in zip(self.layers, weights["layers"], strict=True):
            mine.copy_(fresh)
        for mine, fresh in zip(self.attn, weights["attn"], strict=True):
            for w, f in zip(mine, fresh, strict=True):
                w.copy_(f)

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
        self,
        input_ids: torch.Tensor,
        wrappers: list[PunicaWrapper] | None,
        launch: Launch,
        attn: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """logits [n, vocab] for input_ids [n]; wrappers[i] serves PREFIXES[i] (None: no LoRA)."""
        c, n = self.config, input_ids.shape[0]
        h = torch.empty(n, c.hidden_size, device=self.device)
        if wrappers is None:
            launch(_embed_base, input_ids, self.embed, h)
        else:
            a_rows = torch.empty(1, n, c.max_lora_rank, device=self.device)
            offsets = wrappers[0].embeddings_indices[1, :n]
            launch(_embed, input_ids, offsets, self.embed, self.embed_a, h, a_rows)
            wrappers[0].add_lora_embedding(h, a_rows, self.embed_b, launch)
        for i, weight in enumerate(self.layers):
            if attn is not None:
                h = self._attention(i, h, attn, launch)
            y = torch.empty(n, c.hidden_size, device=self.device)
            launch(torch.mm, h, weight.T, out=y)
            if wrappers is not None:
                buffer = torch.empty(self.LAYER_SLICES, n, c.max_lora_rank, device=self.device)
                wrappers[i + 1].add_lora_linear(
                    y, h, self.lora_a[i], self.lora_b[i], c.lora_scale, buffer, launch
                )
            launch(torch.relu_, y)
            h = y
        logits = torch.empty(n, c.vocab_size, device=self.device)
        launch(torch.mm, h, self.head.T, out=logits)
        return logits

    def _attention(
        self, i: int, h: torch.Tensor, attn: AttentionMetadata, launch: Launch
    ) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        heads, dim = c.num_heads, c.hidden_size // c.num_heads
        q, k, v, o = (torch.empty(n, heads, dim, device=self.device) for _ in range(4))
        wq, wk, wv, wo = self.attn[i]
        for out, w in ((q, wq), (k, wk), (v, wv)):
            launch(torch.mm, h, w.T, out=out.view(n, c.hidden_size))
        launch(reshape_and_cache, k, v, attn.k_caches[i], attn.v_caches[i], attn.slot_mappings[i])
        launch(
            paged_attention,
            q,
            attn.k_caches[i],
            attn.v_caches[i],
            attn.block_tables[i],
            attn.token_rows,
            attn.positions,
            o,
            dim**-0.5,
            attn.max_model_len,
        )
        out = torch.empty(n, c.hidden_size, device=self.device)
        launch(torch.addmm, h, o.view(n, c.hidden_size), wo.T, out=out)
        return out


def _embed_base(input_ids, weight, h) -> None:
    h.copy_(F.embedding(input_ids, weight))


def _embed(input_ids, offsets, weight, lora_a_2d, h, a_rows) -> None:
    """Base rows, and the LoRA-A rows at input_ids + offsets (a bad offset fails the gather:
    a device-side assert on the GPU, IndexError on the CPU)."""
    h.copy_(F.embedding(input_ids, weight))
    a_rows[0].copy_(F.embedding(input_ids + offsets, lora_a_2d))
