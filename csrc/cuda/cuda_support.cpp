// cuda_support.cpp - see cuda_support.hpp. Built only when torch has CUDA.
#include "../cuda_support.hpp"

#include "tccomm.h"

#include <mutex>

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace tccomm::cuda {

void* currentStream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device).stream();
}

void synchronizeCurrentStream(c10::DeviceIndex device) {
  c10::cuda::getCurrentCUDAStream(device).synchronize();
}

c10::intrusive_ptr<c10::ivalue::Future> completedFuture(
    const std::vector<at::Tensor>& outputs,
    c10::DeviceIndex device,
    void* ncclStream) {
  const c10::Device dev(c10::DeviceType::CUDA, device);
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{dev});
  // markCompleted records its events on the current stream: make that the
  // NCCL stream, so consumers wait for the op and nothing else.
  c10::cuda::CUDAStreamGuard guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(ncclStream), device));
  future->markCompleted(c10::IValue(outputs));
  return future;
}

void recordIfCapturing(const std::vector<at::Tensor>& tensors, c10::DeviceIndex device, void* ncclStream) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    return;
  }
  const auto stream = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(ncclStream), device);
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda() && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    }
  }
}

namespace {

// The core's staging memory from torch's caching allocator. Called from C:
// nothing may throw across, so a failure is NULL, which the core reports.
void* coreAlloc(void* /*ctx*/, size_t bytes, int device, void* stream) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
  } catch (...) {
    return nullptr;
  }
}

// The block goes back to the pool of the stream it was allocated on, so
// only work ordered after the core's on that stream can reuse it.
void coreFree(void* /*ctx*/, void* ptr, int /*device*/, void* /*stream*/) {
  try {
    c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  } catch (...) {
  }
}

} // namespace

void installCoreAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    tcc_device_allocator_t allocator{};
    allocator.alloc = coreAlloc;
    allocator.free = coreFree;
    tcc_set_device_allocator(&allocator);
  });
}

} // namespace tccomm::cuda
