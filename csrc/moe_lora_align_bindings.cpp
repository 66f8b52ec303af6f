// Python binding of csrc/moe_lora_align.cu: fills AlignParams from the launcher's device
// pointers and sizes and launches on the stream it names. The launcher (kernels/
// moe_lora_align.py) checks the tensors (int32, contiguous, on one CUDA device) and makes the
// workspaces. pybind11 alone, no torch headers: torch/extension.h made this file most of a
// cold build's time.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moe_lora_align.h"

namespace {

int32_t* ptr(uintptr_t address) { return reinterpret_cast<int32_t*>(address); }

void moe_lora_align_block_size(uintptr_t topk_ids, uintptr_t token_lora_mapping,
                               uintptr_t lora_ids, uintptr_t adapter_enabled,
                               uintptr_t sorted_token_ids, uintptr_t expert_ids,
                               uintptr_t num_tokens_post_pad, uintptr_t token_mask,
                               uintptr_t cumsum, int64_t numel, int64_t top_k,
                               int64_t num_experts, int64_t block_size, int64_t max_loras,
                               int64_t max_num_tokens_padded, int64_t max_num_m_blocks,
                               uintptr_t stream, bool grid_plus_one, bool oob_guard,
                               bool sort_adapter_check) {
  const repro::AlignParams p{
      ptr(topk_ids),
      ptr(token_lora_mapping),
      ptr(lora_ids),
      ptr(adapter_enabled),
      ptr(sorted_token_ids),
      ptr(expert_ids),
      ptr(num_tokens_post_pad),
      ptr(token_mask),
      ptr(cumsum),
      static_cast<int32_t>(numel),
      static_cast<int32_t>(top_k),
      static_cast<int32_t>(num_experts),
      static_cast<int32_t>(block_size),
      static_cast<int32_t>(max_loras),
      static_cast<int32_t>(max_num_tokens_padded),
      static_cast<int32_t>(max_num_m_blocks),
  };
  const repro::AlignFixes fixes{grid_plus_one, oob_guard, sort_adapter_check};
  const cudaError_t err =
      repro::moe_lora_align_block_size(p, fixes, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("moe_lora_align_block_size launch: ") +
                             cudaGetErrorString(err));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_lora_align_block_size", &moe_lora_align_block_size,
        "MoE-LoRA align block size (vLLM #40131 family) with switchable fix parts");
}
