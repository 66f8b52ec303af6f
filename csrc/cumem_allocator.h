// Host interface of csrc/cumem_allocator.cpp: a CuMem (driver virtual memory) allocator whose
// allocations carry a tag and can sleep (physical memory released, address range kept) and
// wake (new physical memory mapped at the same addresses). Torch-free.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

extern "C" {
// The pair torch.cuda.memory.CUDAPluggableAllocator loads by name.
void* repro_cumem_malloc(size_t size, int device, cudaStream_t stream);
void repro_cumem_free(void* ptr, size_t size, int device, cudaStream_t stream);
}

namespace repro::cumem {

void set_tag(int tag);  // tag of the allocations made from now on
// Copy the allocations of `tag` to host memory if `offload`, then unmap and release them.
void sleep(int tag, bool offload);
// Map new memory for the sleeping allocations of `tag`: backups restored, the rest 0xFF bytes.
void wake(int tag);
int64_t mapped_bytes(int tag);  // physical bytes currently mapped for `tag`

}  // namespace repro::cumem
