"""LoRA slots under a live engine (vLLM #47725): the LRU eviction of adapter activation, the
mapping memo keyed on the slot layout, and the runner's per-step activation that reloads an
evicted adapter into whatever slot is free."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.lora import LoRAMapping, LoRAModelManager, PunicaWrapper
from harness.runner.model_runner import ModelRunner, runner_config

pytestmark = pytest.mark.lora_slot_memo
BUGGY = ALL_FIXES - {Fix.LORA_SLOT_LAYOUT_MEMO}
DECODE = LoRAMapping((1, 2), (1, 2), is_prefill=True)  # request a on adapter 1, b on 2


def _manager(device: str, fixes=ALL_FIXES) -> LoRAModelManager:
    wrapper = PunicaWrapper(max_num_tokens=4, max_num_reqs=2, max_loras=2, device=device)
    return LoRAModelManager(2, vocab_size=8, punica_wrapper_mapping={"m": wrapper}, fixes=fixes)


def _rotate(manager: LoRAModelManager) -> None:
    """Adapter 3 added out of band, then the batch's adapters 1 and 2 activated again: the
    slots go from (1, 2) to (2, 1)."""
    for lora_id in (3, 1, 2):
        manager.activate_adapter(lora_id)


def test_activation_evicts_the_least_recently_used_and_keeps_the_memo(device) -> None:
    manager = _manager(device)
    assert [manager.activate_adapter(i) for i in (1, 2, 1)] == [0, 1, 0]
    manager.set_adapter_mapping(DECODE)
    assert manager.activate_adapter(3) == 1, "2 was the least recently used"
    assert manager.lora_index_to_id == [1, 3]
    assert manager._last_mapping == DECODE, "an eviction leaves the memo (upstream's LRU)"
    manager.deactivate_adapter(3)
    assert manager.lora_index_to_id == [1, None] and manager._last_mapping is None
    with pytest.raises(ValueError, match="LoRA id 3 is not active"):
        manager.deactivate_adapter(3)


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_a_rotation_under_one_mapping_refreshes_the_metadata_only_when_fixed(device, fixes) -> None:
    manager = _manager(device, fixes)
    for lora_id in (1, 2):
        manager.activate_adapter(lora_id)
    manager.set_adapter_mapping(DECODE)
    (wrapper,) = manager.distinct_wrappers()
    metas = (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta)
    assert [m.token_lora_mapping[:2].tolist() for m in metas] == [[0, 1], [0, 1]]
    _rotate(manager)
    assert manager.lora_index_to_id == [2, 1]
    manager.set_adapter_mapping(DECODE)
    want = [1, 0] if fixes == ALL_FIXES else [0, 1]  # buggy: a still reads slot 0, now 2's
    assert [m.token_lora_mapping[:2].tolist() for m in metas] == [want, want]
    assert wrapper.embeddings_indices[1, :2].tolist() == [8 * s for s in want]


def test_the_step_reloads_an_evicted_adapter_with_its_own_weights(device) -> None:
    runner = ModelRunner(runner_config(device, cudagraph_mode=CUDAGraphMode.NONE))
    for lora_id in (1, 2):
        runner.add_lora(lora_id, seed=10 + lora_id, experts=False)
    head_b = {i: runner.model.head_b[:, i].clone() for i in (0, 1)}  # adapter 1, adapter 2
    requests = [Request("a", (3,), 1), Request("b", (5,), 2)]
    runner.execute_model(requests, use_cudagraph=False)
    runner.add_lora(3, seed=13, experts=False)
    assert runner.lora_manager._adapter_manager.lora_index_to_id == [3, 2]
    runner.execute_model(requests, use_cudagraph=False)
    assert runner.lora_manager._adapter_manager.lora_index_to_id == [2, 1]
    assert torch.equal(runner.model.head_b[:, 0], head_b[1])  # adapter 2 now in slot 0
    assert torch.equal(runner.model.head_b[:, 1], head_b[0])  # adapter 1 now in slot 1
    runner.remove_lora(2)
    assert 2 not in runner.registered_loras
