// CuMem allocator with tags, sleep and wake, on the CUDA driver's virtual memory API:
// malloc reserves an address range, creates physical memory and maps it; sleep unmaps and
// releases the physical memory but keeps the range; wake creates and maps new memory there.
#include "cumem_allocator.h"

#include <cuda.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr unsigned char kPoisonByte = 0xFF;

struct Allocation {
  size_t size;  // padded to the allocation granularity
  int device;
  int tag;
  CUmemGenericAllocationHandle handle;
  bool mapped;
  std::vector<char> backup;  // host copy while asleep (offloaded tags only)
};

std::mutex g_mutex;
std::map<CUdeviceptr, Allocation> g_allocations;
int g_tag = 0;

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  cuGetErrorString(result, &text);
  throw std::runtime_error(std::string(what) + ": " + (text ? text : "unknown CUDA error"));
}

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

size_t granularity(int device) {
  CUmemAllocationProp prop = properties(device);
  size_t bytes = 0;
  check(cuMemGetAllocationGranularity(&bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  return bytes;
}

void create_and_map(CUdeviceptr ptr, Allocation& a) {
  CUmemAllocationProp prop = properties(a.device);
  check(cuMemCreate(&a.handle, a.size, &prop, 0), "cuMemCreate");
  check(cuMemMap(ptr, a.size, 0, a.handle, 0), "cuMemMap");
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(cuMemSetAccess(ptr, a.size, &access, 1), "cuMemSetAccess");
  a.mapped = true;
}

void unmap_and_release(CUdeviceptr ptr, Allocation& a) {
  check(cuMemUnmap(ptr, a.size), "cuMemUnmap");
  check(cuMemRelease(a.handle), "cuMemRelease");
  a.mapped = false;
}

}  // namespace

extern "C" {

void* repro_cumem_malloc(size_t size, int device, cudaStream_t /*stream*/) {
  try {
    std::lock_guard<std::mutex> lock(g_mutex);
    const size_t step = granularity(device);
    Allocation a{(size + step - 1) / step * step, device, g_tag, 0, false, {}};
    CUdeviceptr ptr = 0;
    check(cuMemAddressReserve(&ptr, a.size, step, 0, 0), "cuMemAddressReserve");
    create_and_map(ptr, a);
    g_allocations.emplace(ptr, std::move(a));
    return reinterpret_cast<void*>(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "repro_cumem_malloc(%zu): %s\n", size, e.what());
    return nullptr;  // torch reports it as out of memory
  }
}

void repro_cumem_free(void* p, size_t /*size*/, int /*device*/, cudaStream_t /*stream*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto ptr = reinterpret_cast<CUdeviceptr>(p);
  auto it = g_allocations.find(ptr);
  if (it == g_allocations.end()) return;
  try {
    // NOTE: cudaFree waits for the device; cuMemUnmap does not, and unmapping memory a kernel
    // still reads is an illegal access in that kernel. Wait as cudaFree would.
    check(cuCtxSynchronize(), "cuCtxSynchronize");
    if (it->second.mapped) unmap_and_release(ptr, it->second);
    check(cuMemAddressFree(ptr, it->second.size), "cuMemAddressFree");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "repro_cumem_free: %s\n", e.what());
  }
  g_allocations.erase(it);
}

}  // extern "C"

namespace repro::cumem {

void set_tag(int tag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_tag = tag;
}

void sleep(int tag, bool offload) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("sleep: device error");
  for (auto& [ptr, a] : g_allocations) {
    if (a.tag != tag || !a.mapped) continue;
    if (offload) {
      a.backup.resize(a.size);
      check(cuMemcpyDtoH(a.backup.data(), ptr, a.size), "cuMemcpyDtoH");
    }
    unmap_and_release(ptr, a);
  }
}

void wake(int tag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& [ptr, a] : g_allocations) {
    if (a.tag != tag || a.mapped) continue;
    create_and_map(ptr, a);
    if (a.backup.empty()) {
      check(cuMemsetD8(ptr, kPoisonByte, a.size), "cuMemsetD8");  // discarded: poison
    } else {
      check(cuMemcpyHtoD(ptr, a.backup.data(), a.size), "cuMemcpyHtoD");
      std::vector<char>().swap(a.backup);
    }
  }
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("wake: device error");
}

int64_t mapped_bytes(int tag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t total = 0;
  for (const auto& [ptr, a] : g_allocations) {
    if (a.tag == tag && a.mapped) total += static_cast<int64_t>(a.size);
  }
  return total;
}

}  // namespace repro::cumem
