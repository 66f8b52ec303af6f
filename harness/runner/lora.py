"""LoRA plumbing with upstream semantics: mapping, conversion, kernel metadata, punica wrapper,
adapter manager.

NOTE: the punica wrapper's index buffers are allocated uninitialized and poisoned on purpose
(torch's fill for new tensors): until a mapping is set they hold garbage, as upstream's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.poison import poisoned_allocations
from kernels.fused_moe_lora import ConsumerFixes, fused_moe_lora_expand, fused_moe_lora_shrink
from kernels.lora_ops import KernelMeta, Launch, lora_expand, lora_shrink
from kernels.moe_lora_align import AlignFixes, align_sizes, moe_lora_align_block_size


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """How the expert LoRA aligns: CUDA C++ on the GPU, its Triton twin on the CPU; the fix
    parts of #40131 (align) and #32277 (its consumers) as kernel switches."""

    backend: str = "triton"
    fixes: AlignFixes = field(default_factory=AlignFixes)
    block_size: int = 16
    consumer: ConsumerFixes = field(default_factory=ConsumerFixes)


def moe_config(fixes: Variant, device: str, *, twin: bool = False) -> MoEConfig:
    """The MoE LoRA family's fix parts as its kernel switches, the one translation (the runner
    and the kernel-level scenarios both read it): the CUDA C++ kernels on the GPU, their Triton
    twin on the CPU, and on any device with `twin`."""
    return MoEConfig(
        "cuda" if device == "cuda" and not twin else "triton",
        AlignFixes(
            grid_plus_one=Fix.MOE_ALIGN_GRID_PLUS_ONE in fixes,
            oob_guard=Fix.MOE_ALIGN_OOB_GUARD in fixes,
            sort_adapter_check=Fix.MOE_ALIGN_SORT_ADAPTER_CHECK in fixes,
        ),
        consumer=ConsumerFixes(
            grid_plus_one=Fix.MOE_LORA_GRID_PLUS_ONE in fixes,
            id_guard=Fix.MOE_LORA_ID_GUARD in fixes,
        ),
    )


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    index_mapping: tuple[int, ...]  # LoRA id per token (0 = no LoRA)
    prompt_mapping: tuple[int, ...]  # LoRA id per request
    is_prefill: bool = False


def convert_mapping(
    mapping: LoRAMapping, lora_index_to_id: list[int | None], vocab_size: int
) -> tuple[list[int], list[int], list[int]]:
    """(slot per token, embedding offset per token, slot per request); slot -1 = no LoRA.

    Id 0 becomes slot -1 and offset 0 without being looked up; any other id must be active.
    """

    def slot(lora_id: int) -> int:
        if lora_id == 0:
            return -1
        if lora_id not in lora_index_to_id:
            raise ValueError(f"LoRA id {lora_id} is not active (slots: {lora_index_to_id})")
        return lora_index_to_id.index(lora_id)

    token_slots = [slot(i) for i in mapping.index_mapping]
    offsets = [max(s, 0) * vocab_size for s in token_slots]
    return token_slots, offsets, [slot(i) for i in mapping.prompt_mapping]


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class LoRAKernelMeta:
    """Device metadata the shrink/expand kernels read, refreshed in place by prepare_tensors."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: str) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        with poisoned_allocations():
            self.token_lora_mapping = torch.empty(max_num_tokens, **i32)
            self.token_indices_sorted_by_lora_ids = torch.empty(max_num_tokens, **i32)
            self.active_lora_ids = torch.empty(max_loras + 1, **i32)
            self.num_tokens_per_lora = torch.empty(max_loras + 1, **i32)
            self.lora_token_start_loc = torch.empty(max_loras + 2, **i32)
        self.no_lora_flag_cpu = torch.zeros(1, dtype=torch.bool)
        self.num_active_loras_cpu = torch.zeros(1, dtype=torch.int32)

    def prepare_tensors(self, slots: list[int]) -> None:
        """Reset; if every token is slot -1, set the flag and stop; else sort/unique/cumsum.

        Computed on the host from the slot list, then copied in place (same addresses).
        """
        self.active_lora_ids.fill_(-1)
        self.num_tokens_per_lora.zero_()
        self.lora_token_start_loc.zero_()
        n = len(slots)
        self.token_lora_mapping[:n].copy_(_i32(slots))
        if all(s == -1 for s in slots):
            self.no_lora_flag_cpu[0] = True
            self.num_active_loras_cpu[0] = 0
            return
        self.no_lora_flag_cpu[0] = False
        ids = sorted(set(slots))
        counts = [slots.count(i) for i in ids]
        order = sorted(range(n), key=lambda t: slots[t])  # stable: token order within a LoRA
        self.token_indices_sorted_by_lora_ids[:n].copy_(_i32(order))
        self.active_lora_ids[: len(ids)].copy_(_i32(ids))
        self.num_tokens_per_lora[: len(ids)].copy_(_i32(counts))
        self.lora_token_start_loc[1 : len(ids) + 1].copy_(torch.cumsum(_i32(counts), 0))
        self.num_active_loras_cpu[0] = len(ids)

    def kernel_meta(self) -> KernelMeta:
        return KernelMeta(
            self.token_lora_mapping,
            self.token_indices_sorted_by_lora_ids,
            self.active_lora_ids,
            self.num_tokens_per_lora,
            self.lora_token_start_loc,
            self.no_lora_flag_cpu,
            self.num_active_loras_cpu,
        )


class PunicaWrapper:
    """Per-token LoRA indices and the kernel metas; the entry points the LoRA layers call.

    The token mapping meta serves the embedding and linear layers (one row per token); the
    prompt mapping meta serves the LM head (one row per request: its sampled token).
    `specialize`: the kernels launch num_active_loras_cpu LoRA programs instead of
    max_loras + 1 (upstream's specialize_active_lora)."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_loras: int,
        device: str,
        specialize: bool = False,
    ):
        self.specialize = specialize
        with poisoned_allocations():
            # [0]: added-vocab offsets (unused here), [1]: offsets into the stacked LoRA embedding
            self._embeddings_indices = torch.empty(
                2, max_num_tokens, dtype=torch.long, device=device
            )
        self.token_mapping_meta = LoRAKernelMeta(max_num_tokens, max_loras, device)
        self.prompt_mapping_meta = LoRAKernelMeta(max_num_reqs, max_loras, device)

    @property
    def embeddings_indices(self) -> torch.Tensor:  # [2, max_num_tokens]
        return self._embeddings_indices

    def update_metadata(
        self, mapping: LoRAMapping, lora_index_to_id: list[int | None], vocab_size: int
    ) -> None:
        slots, offsets, prompt_slots = convert_mapping(mapping, lora_index_to_id, vocab_size)
        n = len(offsets)
        self._embeddings_indices[0, :n].zero_()
        self._embeddings_indices[1, :n].copy_(torch.tensor(offsets, dtype=torch.long))
        self.token_mapping_meta.prepare_tensors(slots)
        self.prompt_mapping_meta.prepare_tensors(prompt_slots)

    def add_lora_linear(self, y, x, lora_a, lora_b, scale, buffer, launch: Launch) -> None:
        """Per slice s: y[:, cols of s] += scale * (x @ A[s].T) @ B[s].T per token;
        `buffer` [num_slices, >= num_tokens, rank] float32."""
        self._shrink_expand(self.token_mapping_meta, y, x, lora_a, lora_b, scale, buffer, launch)

    def add_lora_embedding(self, y, x, lora_b, launch: Launch) -> None:
        """y += x[0] @ B[0].T per token, x [1, n, rank] being the gathered LoRA-A rows."""
        meta = self.token_mapping_meta.kernel_meta()
        lora_expand(x, lora_b, y, meta, launch, self.specialize)

    def add_lora_logits(self, logits, x, lora_a, lora_b, scale, buffer, launch: Launch) -> None:
        """logits[r] += scale * (x[r] @ A.T) @ B.T with request r's adapter: x [num_reqs,
        hidden] the sampled hidden states, `buffer` [1, >= num_reqs, rank] float32."""
        self._shrink_expand(
            self.prompt_mapping_meta, logits, x, lora_a, lora_b, scale, buffer, launch
        )

    def add_lora_fused_moe(
        self, y, x, topk_ids, lora_a, lora_b, scale, adapter_enabled, moe: MoEConfig, launch
    ) -> None:
        """y[t] += scale * (x[t] @ A[lora, e].T) @ B[lora, e].T over t's experts e: align the
        (token, expert) pairs per LoRA slot of active_lora_ids, then the fused shrink and
        expand that trust the align outputs (per pair), then the sum over each token's pairs.
        lora_a [L, E, rank, hidden], lora_b [L, E, hidden, rank]; the align outputs are
        allocated empty (poisoned), as upstream's."""
        meta = self.token_mapping_meta
        if bool(meta.no_lora_flag_cpu[0]):  # NOTE: host decision; frozen into a captured graph
            return
        (n, top_k), (max_loras, num_experts, rank, _) = topk_ids.shape, lora_a.shape
        padded, m_blocks = align_sizes(n * top_k, num_experts, moe.block_size)
        i32 = dict(dtype=torch.int32, device=x.device)
        with poisoned_allocations():
            sorted_ids = torch.empty(max_loras, padded, **i32)
            expert_ids = torch.empty(max_loras, m_blocks, **i32)
            post_pad = torch.empty(max_loras, **i32)
        slots, lora_ids = meta.token_lora_mapping[:n], meta.active_lora_ids
        align = dict(num_experts=num_experts, block_size=moe.block_size, max_loras=max_loras)
        launch(
            moe_lora_align_block_size,
            topk_ids,
            slots,
            lora_ids,
            adapter_enabled,
            sorted_ids,
            expert_ids,
            post_pad,
            **align,
            fixes=moe.fixes,
            backend=moe.backend,
        )
        shrunk = torch.zeros(n * top_k, rank, device=x.device)
        align_outputs = (sorted_ids, expert_ids, post_pad, lora_ids, adapter_enabled)
        consumer = dict(block_size=moe.block_size, fixes=moe.consumer)
        launch(fused_moe_lora_shrink, x, lora_a, *align_outputs, shrunk, top_k=top_k, **consumer)
        expanded = torch.zeros(n * top_k, y.shape[1], device=x.device)
        launch(
            fused_moe_lora_expand, shrunk, lora_b, *align_outputs, expanded, scale=scale, **consumer
        )
        launch(_add_pairs, expanded, y)

    def _shrink_expand(self, mapping_meta, y, x, lora_a, lora_b, scale, buffer, launch) -> None:
        meta = mapping_meta.kernel_meta()
        lora_shrink(x, lora_a, buffer, meta, scale, launch, self.specialize)
        lora_expand(buffer, lora_b, y, meta, launch, self.specialize)


def _add_pairs(expanded: torch.Tensor, y: torch.Tensor) -> None:
    """y[t] += the sum of token t's pairs' rows (base-model pairs hold zeros)."""
    y.add_(expanded.view(y.shape[0], -1, y.shape[1]).sum(1))


class LoRAModelManager:
    """Adapter slots and per-layer wrappers; upstream's `_adapter_manager` (its LRU cache
    manager: with every slot taken, activating an adapter evicts the least recently used)."""

    def __init__(
        self,
        max_loras: int,
        vocab_size: int,
        punica_wrapper_mapping: dict[str, PunicaWrapper],
        fixes: Variant = ALL_FIXES,
    ) -> None:
        self.lora_index_to_id: list[int | None] = [None] * max_loras
        self.vocab_size, self.fixes = vocab_size, fixes
        self.punica_wrapper_mapping = punica_wrapper_mapping  # prefix -> wrapper, may share
        self._lru: list[int] = []  # active ids, least recently used first
        self._last_mapping: LoRAMapping | None = None
        self._last_slot_layout: tuple[int | None, ...] | None = None

    def activate_adapter(self, lora_id: int) -> int:
        """The slot of `lora_id`, taking the first free one if it is not active (evicting the
        least recently used adapter when none is free); `lora_id` becomes the most recently
        used. NOTE: an eviction leaves the mapping memo as it was (upstream's LRU removal)."""
        if lora_id not in self.lora_index_to_id:
            if None not in self.lora_index_to_id:
                self._free_slot(self._lru[0])
            self.lora_index_to_id[self.lora_index_to_id.index(None)] = lora_id
        if lora_id in self._lru:
            self._lru.remove(lora_id)
        self._lru.append(lora_id)
        return self.lora_index_to_id.index(lora_id)

    def _free_slot(self, lora_id: int) -> int:
        slot = self.lora_index_to_id.index(lora_id)
        self.lora_index_to_id[slot] = None
        self._lru.remove(lora_id)
        return slot

    def deactivate_adapter(self, lora_id: int) -> int:
        """Free the slot of `lora_id` (removed); returns it. The mapping memo is dropped: the
        same ids may now map to other slots."""
        if lora_id not in self.lora_index_to_id:
            raise ValueError(f"LoRA id {lora_id} is not active (slots: {self.lora_index_to_id})")
        self._last_mapping = None
        return self._free_slot(lora_id)

    def distinct_wrappers(self) -> list[PunicaWrapper]:
        """Each wrapper once, however many prefixes share it."""
        seen: dict[int, PunicaWrapper] = {}
        for wrapper in self.punica_wrapper_mapping.values():
            seen.setdefault(id(wrapper), wrapper)
        return list(seen.values())

    def set_adapter_mapping(self, mapping: LoRAMapping) -> None:
        """Refresh every wrapper's metadata in place, unless nothing it derives from changed."""
        slot_layout = tuple(self.lora_index_to_id)
        unchanged = mapping == self._last_mapping
        if Fix.LORA_SLOT_LAYOUT_MEMO in self.fixes:
            # fix: lora_slot_layout_memo -- an eviction moves adapters under an unchanged mapping.
            unchanged = unchanged and slot_layout == self._last_slot_layout
        if unchanged:
            return
        for wrapper in self.distinct_wrappers():
            wrapper.update_metadata(mapping, self.lora_index_to_id, self.vocab_size)
        self._last_mapping, self._last_slot_layout = mapping, slot_layout


class LoRAManager:
    """The runner's handle (upstream: `runner.lora_manager._adapter_manager`)."""

    def __init__(self, adapter_manager: LoRAModelManager) -> None:
        self._adapter_manager = adapter_manager
