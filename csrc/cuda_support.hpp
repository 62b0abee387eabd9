// cuda_support.hpp - the few CUDA things the shim needs from torch.
//
// Implemented in csrc/cuda/cuda_support.cpp, which only builds compile when
// torch has CUDA (TCCOMM_WITH_CUDA, set by setup.py). A CPU-only build gets
// the inline stand-ins below; they are never reached there, because
// checkTensor() refuses CUDA tensors first.
#pragma once

#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

namespace tccomm::cuda {

#ifdef TCCOMM_WITH_CUDA

constexpr bool kBuilt = true;

// The calling thread's current stream on `device`, as the core's cudaStream_t.
void* currentStream(c10::DeviceIndex device);

// A future over `outputs` that is complete now and device-aware: whoever
// waits on it, or chains a callback, has its current stream wait for the
// work enqueued so far on `ncclStream` (the host never blocks).
c10::intrusive_ptr<c10::ivalue::Future> completedFuture(
    const std::vector<at::Tensor>& outputs,
    c10::DeviceIndex device,
    void* ncclStream);

// While the calling thread's current stream captures a CUDA graph, the core
// completes ops at once and the tensors are let go right away: tell the
// caching allocator they are in use on `ncclStream` so their memory is not
// handed out again ahead of the graph's communication.
void recordIfCapturing(const std::vector<at::Tensor>& tensors, c10::DeviceIndex device, void* ncclStream);

// Blocks until the calling thread's current stream on `device` is idle.
void synchronizeCurrentStream(c10::DeviceIndex device);

// Makes the core stage device memory through torch's caching allocator
// (reused, seen by torch.cuda.memory_*, a graph's pool under capture).
void installCoreAllocator();

#else

constexpr bool kBuilt = false;

inline void* currentStream(c10::DeviceIndex /*device*/) {
  return nullptr;
}

inline c10::intrusive_ptr<c10::ivalue::Future> completedFuture(
    const std::vector<at::Tensor>& /*outputs*/,
    c10::DeviceIndex /*device*/,
    void* /*ncclStream*/) {
  TORCH_CHECK(false, "tccomm was built without CUDA");
}

inline void recordIfCapturing(const std::vector<at::Tensor>& /*tensors*/, c10::DeviceIndex /*device*/, void* /*ncclStream*/) {}

inline void installCoreAllocator() {}

inline void synchronizeCurrentStream(c10::DeviceIndex /*device*/) {}

#endif

} // namespace tccomm::cuda
