// cuda_support.cpp - see cuda_support.hpp. Built only when torch has CUDA.
#include "../cuda_support.hpp"

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace tccomm::cuda {

void* currentStream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device).stream();
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

} // namespace tccomm::cuda
