"""The miniature Model Runner V2: execute_model (real and dummy runs), capture_model, and
greedy generation over the paged KV cache.

The dummy-run branch is where the LoRA fix parts of vLLM #43139 and #43314 live;
post_kv_cache_wake_up is where the fix part of vLLM #40648 lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    Launcher,
)
from harness.runner.input_batch import InputBatch, InputBuffers, Request
from harness.runner.kv_cache import KVCache
from harness.runner.lora import LoRAManager, LoRAMapping, LoRAModelManager, PunicaWrapper
from harness.runner.model import ModelConfig, TinyLoRADecoder
from harness.runner.sleep_mode import TaggedPools


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    device: str
    fixes: Variant = ALL_FIXES
    model: ModelConfig = field(default_factory=ModelConfig)
    max_num_tokens: int = 32
    max_num_reqs: int = 8
    cudagraph_sizes: tuple[int, ...] = (8, 16)
    enable_lora: bool = True
    block_sizes: tuple[int, ...] = (4, 16)  # one KV-cache group per layer
    num_kv_blocks: int = 32  # per group
    max_model_len: int = 64


class ModelRunner:
    def __init__(self, config: RunnerConfig, pools: TaggedPools | None = None) -> None:
        """With `pools` (a Worker's), weights and the KV cache live in tagged sleep pools."""
        self.config, self.device, self.fixes = config, config.device, config.fixes
        self.pools = pools
        self.launch = Launcher()
        self.input_buffers = InputBuffers(config.max_num_tokens, config.max_num_reqs, self.device)
        place = (lambda t: pools.adopt("weights", t)) if pools else None
        self.model = TinyLoRADecoder(config.model, self.device, place)
        self.kv_cache: KVCache | None = None
        # NOTE: the embedding and first layer share one wrapper object, the second layer has its own
        shared, own = (
            PunicaWrapper(
                config.max_num_tokens, config.max_num_reqs, config.model.max_loras, self.device
            )
            for _ in range(2)
        )
        prefixes = TinyLoRADecoder.PREFIXES
        mapping = {prefixes[0]: shared, prefixes[1]: shared, prefixes[2]: own}
        self.lora_manager = LoRAManager(
            LoRAModelManager(config.model.max_loras, config.model.vocab_size, mapping)
        )
        self.cudagraph_manager = CudaGraphManager(self.device, self.launch, self.fixes)

    @property
    def wrappers(self) -> list[PunicaWrapper] | None:
        """The wrapper of each LoRA layer, in TinyLoRADecoder.PREFIXES order (None: no LoRA)."""
        if not self.config.enable_lora:
            return None
        mapping = self.lora_manager._adapter_manager.punica_wrapper_mapping
        return [mapping[p] for p in TinyLoRADecoder.PREFIXES]

    def add_lora(self, lora_id: int, seed: int) -> int:
        """Activate adapter `lora_id` with seeded weights; returns its slot."""
        slot = self.lora_manager._adapter_manager.activate_adapter(lora_id)
        self.model.load_lora(slot, seed)
        return slot

    def execute_model(
        self,
        requests: list[Request] | None = None,
        *,
        dummy_run: bool = False,
        num_tokens: int = 0,
        num_reqs: int = 1,
        use_cudagraph: bool = True,
    ) -> torch.Tensor:
        """Logits [num_tokens, vocab]. A real run may replay a captured graph (then the result
        is a view of the graph's output buffer: clone it to keep it)."""
        if dummy_run:
            return self._forward(self._prepare_dummy(num_tokens, num_reqs))
        n = sum(len(r.token_ids) for r in requests)
        desc = self.cudagraph_manager.dispatch(n) if use_cudagraph else None
        batch = self.input_buffers.prepare(requests, desc.num_tokens if desc else n)
        if self.config.enable_lora:
            mapping = LoRAMapping(batch.token_lora_ids, batch.req_lora_ids, is_prefill=True)
            self.lora_manager._adapter_manager.set_adapter_mapping(mapping)
        if desc is not None:
            return self.cudagraph_manager.run_fullgraph(desc)[:n]
        return self._forward(batch)[:n]

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        return self.model.forward(batch.input_ids, self.wrappers, self.launch)

    def _prepare_dummy(self, num_tokens: int, num_reqs: int) -> InputBatch:
        """The dummy-run branch of execute_model: dummy inputs, and the LoRA state for them."""
        batch = self.input_buffers.dummy(num_tokens, num_reqs)
        if not self.config.enable_lora or Fix.LORA_DUMMY_MAPPING not in self.fixes:
            return batch
        # fix: lora_dummy_mapping -- an unset mapping leaves the LoRA index buffers garbage.
        adapter_manager = self.lora_manager._adapter_manager
        adapter_manager.set_adapter_mapping(
            LoRAMapping((0,) * batch.num_tokens_after_padding, (0,) * batch.num_reqs, True)
        )
        if Fix.LORA_CAPTURE_LAUNCH in self.fixes:
            # fix: lora_capture_launch -- launch (so capture) LoRA kernels; programs see -1, exit.
            for wrapper in adapter_manager.distinct_wrappers():
                for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
                    meta.no_lora_flag_cpu[0] = False
                    meta.num_active_loras_cpu[0] = 1
        return batch

    def capture_model(self) -> None:
        """One FULL graph per configured size, from dummy runs."""
        descs = [
            BatchExecutionDescriptor(CUDAGraphMode.FULL, n, min(n, self.config.max_num_reqs))
            for n in self.config.cudagraph_sizes
        ]
        self.cudagraph_manager.capture(descs, self._create_forward_fn)

    def _create_forward_fn(self, desc: BatchExecutionDescriptor):
        batch = self._prepare_dummy(desc.num_tokens, desc.num_reqs)
        return (lambda mode: self._forward(batch)), None

    def initialize_kv_cache(self) -> None:
        """Paged K/V caches and block tables, in the kv_cache pool."""
        if self.pools is None:
            raise RuntimeError(
                "the KV cache lives in tagged memory pools: build the runner "
                "with pools (a Worker does)"
            )
        c, m = self.config, self.config.model
        self.kv_cache = KVCache(
            c.block_sizes,
            c.num_kv_blocks,
            m.num_heads,
            m.hidden_size // m.num_heads,
            c.max_num_reqs,
            c.max_num_tokens,
            c.max_model_len,
            self.pools,
            m.seed,
        )

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens per prompt: one prefill step, then one decode step per new token."""
        self.kv_cache.reset()
        seqs, new = [list(p) for p in prompts], [[] for _ in prompts]
        for step in range(max_new_tokens):
            requests = []
            for row, seq in enumerate(seqs):
                start = 0 if step == 0 else len(seq) - 1
                requests.append(Request(f"req{row}", tuple(seq[start:]), 0, start))
                self.kv_cache.ensure_blocks(row, len(seq))
            batch = self.input_buffers.prepare(requests, sum(len(r.token_ids) for r in requests))
            attn = self.kv_cache.metadata(batch)
            logits = self.model.forward(batch.input_ids, self.wrappers, self.launch, attn)
            last = batch.query_start_loc[1:].long() - 1
            for row, token in enumerate(logits[last].argmax(-1).tolist()):
                seqs[row].append(token)
                new[row].append(token)
        return new

    def post_kv_cache_wake_up(self) -> None:
        """Called by the worker after the kv_cache pool woke up."""
        if Fix.BLOCK_TABLE_REINIT_ON_WAKE in self.fixes:
            # fix: block_table_reinit_on_wake -- the layout tensors woke up with garbage.
            self.kv_cache.block_tables.init_block_table_layout_tensors()

    def reload_weights(self) -> None:
        self.model.reload_weights()
