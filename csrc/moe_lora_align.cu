// MoE-LoRA align-block-size kernels (the CUDA side of vLLM #40131), torch-free so that
// `nvcc -c` checks this file alone. Semantics match kernels/moe_lora_align.py: per LoRA id, pairs
// grouped by expert and padded to block_size; sorted_token_ids padding = numel; expert_ids -1
// past the padded total. Fix parts are runtime flags picked by the host launcher at the bottom.
#include "moe_lora_align.h"

namespace repro {
namespace {

constexpr int kThreads = 256;

// True when this slot must write nothing.
__device__ __forceinline__ bool skip_slot(int32_t lora_id, const int32_t* adapter_enabled,
                                          int32_t max_loras, bool oob_guard, bool check_adapter) {
  if (lora_id == -1) return true;
  // fix: moe_align_oob_guard -- a forged id must not index rows the outputs do not have.
  if (oob_guard && lora_id >= max_loras) return true;
  return check_adapter && adapter_enabled[lora_id] == 0;
}

// Expert ids of one row from the per-expert padded ends (shared), -1 past the total.
__device__ void write_expert_ids(int32_t* expert_ids, const int32_t* ends, int32_t num_experts,
                                 int32_t total, int32_t block_size, int32_t m_blocks) {
  for (int32_t b = threadIdx.x; b < m_blocks; b += blockDim.x) {
    int32_t start = b * block_size;
    int32_t expert = -1;
    if (start < total) {
      expert = 0;
      while (ends[expert] <= start) ++expert;
    }
    expert_ids[b] = expert;
  }
}

// Exclusive padded starts (in place over counts) and inclusive ends; returns the padded total.
__device__ int32_t padded_layout(int32_t* counts_to_starts, int32_t* ends, int32_t num_experts,
                                 int32_t block_size) {
  int32_t pos = 0;
  for (int32_t e = 0; e < num_experts; ++e) {
    int32_t padded = (counts_to_starts[e] + block_size - 1) / block_size * block_size;
    counts_to_starts[e] = pos;
    pos += padded;
    ends[e] = pos;
  }
  return pos;
}

// Small batch: one block per slot; thread e owns expert e and places its pairs in order.
__global__ void small_batch_kernel(AlignParams p, bool oob_guard) {
  extern __shared__ int32_t shared[];
  int32_t* starts = shared;              // [num_experts]
  int32_t* ends = shared + p.num_experts;  // [num_experts]
  __shared__ int32_t total;
  const int32_t lora_id = p.lora_ids[blockIdx.x];
  if (skip_slot(lora_id, p.adapter_enabled, p.max_loras, oob_guard, true)) return;
  const int64_t lora = lora_id;
  for (int32_t e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int32_t count = 0;
    for (int32_t i = 0; i < p.numel; ++i)
      count += p.token_lora_mapping[i / p.top_k] == lora_id && p.topk_ids[i] == e;
    starts[e] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    total = padded_layout(starts, ends, p.num_experts, p.block_size);
    p.num_tokens_post_pad[lora] = total;
  }
  int32_t* row = p.sorted_token_ids + lora * p.max_num_tokens_padded;
  for (int32_t j = threadIdx.x; j < p.max_num_tokens_padded; j += blockDim.x) row[j] = p.numel;
  __syncthreads();  // NOTE: padding must land before the pairs that overwrite it.
  write_expert_ids(p.expert_ids + lora * p.max_num_m_blocks, ends, p.num_experts, total,
                   p.block_size, p.max_num_m_blocks);
  for (int32_t e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int32_t dest = starts[e];
    for (int32_t i = 0; i < p.numel; ++i)
      if (p.token_lora_mapping[i / p.top_k] == lora_id && p.topk_ids[i] == e) row[dest++] = i;
  }
}

// Large path, two blocks per slot: x == 0 writes the token mask, cumsum, total and expert ids;
// x == 1 pads the slot's sorted_token_ids row.
__global__ void align_kernel(AlignParams p, bool oob_guard) {
  extern __shared__ int32_t shared[];
  int32_t* counts = shared;                // [num_experts], then starts
  int32_t* ends = shared + p.num_experts;  // [num_experts]
  __shared__ int32_t total;
  const int32_t lora_id = p.lora_ids[blockIdx.y];
  if (skip_slot(lora_id, p.adapter_enabled, p.max_loras, oob_guard, true)) return;
  const int64_t lora = lora_id;
  if (blockIdx.x == 1) {
    int32_t* row = p.sorted_token_ids + lora * p.max_num_tokens_padded;
    for (int32_t j = threadIdx.x; j < p.max_num_tokens_padded; j += blockDim.x) row[j] = p.numel;
    return;
  }
  for (int32_t e = threadIdx.x; e < p.num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < p.numel; i += blockDim.x) {
    const bool mine = p.token_lora_mapping[i / p.top_k] == lora_id;
    p.token_mask[lora * p.numel + i] = mine;
    if (mine) atomicAdd(&counts[p.topk_ids[i]], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    total = padded_layout(counts, ends, p.num_experts, p.block_size);
    p.num_tokens_post_pad[lora] = total;
  }
  __syncthreads();
  int32_t* cumsum_row = p.cumsum + lora * (p.num_experts + 1);
  for (int32_t e = threadIdx.x; e < p.num_experts; e += blockDim.x) cumsum_row[e] = counts[e];
  if (threadIdx.x == 0) cumsum_row[p.num_experts] = total;
  write_expert_ids(p.expert_ids + lora * p.max_num_m_blocks, ends, p.num_experts, total,
                   p.block_size, p.max_num_m_blocks);
}

// Large path: each masked pair takes its expert's next position from the cumsum row.
__global__ void count_and_sort_kernel(AlignParams p, bool oob_guard, bool sort_adapter_check) {
  const int32_t lora_id = p.lora_ids[blockIdx.y];
  // fix: moe_align_sort_adapter_check -- a disabled slot's token-mask row was never written.
  if (skip_slot(lora_id, p.adapter_enabled, p.max_loras, oob_guard, sort_adapter_check)) return;
  const int64_t lora = lora_id;
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.numel || p.token_mask[lora * p.numel + i] == 0) return;
  const int32_t dest = atomicAdd(&p.cumsum[lora * (p.num_experts + 1) + p.topk_ids[i]], 1);
  p.sorted_token_ids[lora * p.max_num_tokens_padded + dest] = i;
}

}  // namespace

cudaError_t moe_lora_align_block_size(const AlignParams& p, AlignFixes fixes,
                                      cudaStream_t stream) {
  // fix: moe_align_grid_plus_one -- lora_ids has max_loras + 1 entries and -1 sorts first.
  const int32_t num_slots = fixes.grid_plus_one ? p.max_loras + 1 : p.max_loras;
  const size_t shared_bytes = 2 * sizeof(int32_t) * p.num_experts;
  if (p.numel < kSmallBatchMaxNumel && p.num_experts <= kSmallBatchMaxExperts) {
    small_batch_kernel<<<num_slots, 64, shared_bytes, stream>>>(p, fixes.oob_guard);
    return cudaGetLastError();
  }
  align_kernel<<<dim3(2, num_slots), kThreads, shared_bytes, stream>>>(p, fixes.oob_guard);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid((p.numel + kThreads - 1) / kThreads, num_slots);
  count_and_sort_kernel<<<grid, kThreads, 0, stream>>>(p, fixes.oob_guard,
                                                       fixes.sort_adapter_check);
  return cudaGetLastError();
}

}  // namespace repro
