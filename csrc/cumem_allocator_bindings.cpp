// Python binding of csrc/cumem_allocator.cpp (the allocator pair itself is loaded by torch's
// CUDAPluggableAllocator from this same library, by symbol name). pybind11 alone, no torch
// headers: torch/extension.h made this file most of a cold build's time.
#include <pybind11/pybind11.h>

#include "cumem_allocator.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_tag", &repro::cumem::set_tag, "tag of the allocations made from now on");
  m.def("sleep", &repro::cumem::sleep, "back up (if offload), unmap and release a tag");
  m.def("wake", &repro::cumem::wake, "map a tag again: backups restored, the rest poisoned");
  m.def("mapped_bytes", &repro::cumem::mapped_bytes, "physical bytes mapped for a tag");
}
