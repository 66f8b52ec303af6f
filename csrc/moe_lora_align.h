// Host interface of csrc/moe_lora_align.cu: raw pointers in, no torch types.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace repro {

constexpr int32_t kSmallBatchMaxNumel = 1024;  // small path: numel < this and E <= next
constexpr int32_t kSmallBatchMaxExperts = 64;

struct AlignParams {
  const int32_t* topk_ids;            // [numel]
  const int32_t* token_lora_mapping;  // [numel / top_k]
  const int32_t* lora_ids;            // [max_loras + 1]
  const int32_t* adapter_enabled;     // [max_loras + 1]
  int32_t* sorted_token_ids;          // [max_loras, max_num_tokens_padded]
  int32_t* expert_ids;                // [max_loras, max_num_m_blocks]
  int32_t* num_tokens_post_pad;       // [max_loras]
  int32_t* token_mask;                // [max_loras, numel] workspace
  int32_t* cumsum;                    // [max_loras, num_experts + 1] workspace, zeroed
  int32_t numel;
  int32_t top_k;
  int32_t num_experts;
  int32_t block_size;
  int32_t max_loras;
  int32_t max_num_tokens_padded;
  int32_t max_num_m_blocks;
};

struct AlignFixes {
  bool grid_plus_one;       // moe_align_grid_plus_one
  bool oob_guard;           // moe_align_oob_guard
  bool sort_adapter_check;  // moe_align_sort_adapter_check
};

// Launches the small-batch kernel, or the align and count-and-sort kernels, on `stream`.
cudaError_t moe_lora_align_block_size(const AlignParams& p, AlignFixes fixes, cudaStream_t stream);

}  // namespace repro
