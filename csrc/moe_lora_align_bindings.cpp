// Torch binding of csrc/moe_lora_align.cu: checks tensors, fills AlignParams, launches on the
// current stream. Workspaces come from the Python launcher (kernels/moe_lora_align.py).
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "moe_lora_align.h"

namespace {

int32_t* ptr(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kInt32 && t.is_contiguous(), name,
              ": contiguous int32 CUDA tensor expected");
  return t.data_ptr<int32_t>();
}

void moe_lora_align_block_size(torch::Tensor topk_ids, torch::Tensor token_lora_mapping,
                               torch::Tensor lora_ids, torch::Tensor adapter_enabled,
                               torch::Tensor sorted_token_ids, torch::Tensor expert_ids,
                               torch::Tensor num_tokens_post_pad, torch::Tensor token_mask,
                               torch::Tensor cumsum, int64_t num_experts, int64_t block_size,
                               int64_t max_loras, bool grid_plus_one, bool oob_guard,
                               bool sort_adapter_check) {
  const repro::AlignParams p{
      ptr(topk_ids, "topk_ids"),
      ptr(token_lora_mapping, "token_lora_mapping"),
      ptr(lora_ids, "lora_ids"),
      ptr(adapter_enabled, "adapter_enabled"),
      ptr(sorted_token_ids, "sorted_token_ids"),
      ptr(expert_ids, "expert_ids"),
      ptr(num_tokens_post_pad, "num_tokens_post_pad"),
      ptr(token_mask, "token_mask"),
      ptr(cumsum, "cumsum"),
      static_cast<int32_t>(topk_ids.numel()),
      static_cast<int32_t>(topk_ids.size(1)),
      static_cast<int32_t>(num_experts),
      static_cast<int32_t>(block_size),
      static_cast<int32_t>(max_loras),
      static_cast<int32_t>(sorted_token_ids.size(1)),
      static_cast<int32_t>(expert_ids.size(1)),
  };
  const repro::AlignFixes fixes{grid_plus_one, oob_guard, sort_adapter_check};
  const cudaError_t err = repro::moe_lora_align_block_size(
      p, fixes, at::cuda::getCurrentCUDAStream(topk_ids.get_device()));
  TORCH_CHECK(err == cudaSuccess, "moe_lora_align_block_size launch: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_lora_align_block_size", &moe_lora_align_block_size,
        "MoE-LoRA align block size (vLLM #40131 family) with switchable fix parts");
}
