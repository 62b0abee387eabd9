// window_ops.cpp - torch.ops.tccomm.window_*: one-sided windows (the core's
// tcc_window_*) for torchcomm_backend's TorchComm-style API.
//
// Python names a window by an integer handle. Each handle owns a shared
// reference to the core window; every view handed out (window_view) holds
// one too, so destroying the handle never unmaps memory a tensor still uses.
//   window_create(pg, bytes, timeout_ms) -> int   collective over pg's group (bytes -1: decline)
//   window_put(win, src, dst, offset_bytes)       copy src into dst's buffer
//   window_signal(win, dst) / window_wait_signal(win, peer, timeout_ms)
//   window_view(win, rank, dtype, shape) -> Tensor  zero-copy view of a buffer
//   window_buffer_bytes(win, rank) -> int          size of rank's buffer
//   window_destroy(win)
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "backend.hpp"
#include "core_error.hpp"
#include "tccomm.h"

namespace tccomm {
namespace {

using WindowPtr = std::shared_ptr<tcc_window_t>;

class WindowRegistry {
 public:
  int64_t add(WindowPtr win) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t id = ++last_;
    windows_[id] = std::move(win);
    return id;
  }
  // A reference to the window; throws for an unknown or destroyed handle.
  WindowPtr get(const char* op, int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = windows_.find(id);
    TORCH_CHECK(
        it != windows_.end(),
        "tccomm: window ",
        op,
        ": window handle ",
        id,
        " is not registered (deregistered already, or never created)");
    return it->second;
  }
  void remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    windows_.erase(id);
  }

 private:
  std::mutex mutex_;
  int64_t last_ = 0;
  std::map<int64_t, WindowPtr> windows_;
};

WindowRegistry& windowRegistry() {
  static auto* r = new WindowRegistry(); // never destroyed: views may outlive main
  return *r;
}

// The core's messages name the window op, the group, the rank and the cause.
void throwIfFailed(tcc_result_t r) {
  if (r != TCC_OK) {
    throwCoreError(r, CallKind::Op);
  }
}

int64_t windowCreate(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t bytes, int64_t timeoutMs) {
  // -1: this rank declines (its caller found the buffer unusable); every
  // rank's creation then fails at once instead of waiting for a timeout.
  TORCH_CHECK(bytes >= -1, "tccomm: window_create: the size must not be negative, got ", bytes);
  auto backend = pg->getBackend(c10::DeviceType::CPU);
  auto* tcc = dynamic_cast<TccBackend*>(backend.get());
  TORCH_CHECK(tcc != nullptr, "tccomm: window_create: the group's CPU backend is not tccomm");
  tcc_comm_t* comm = tcc->coreComm("window_create");
  tcc_window_t* raw = nullptr;
  const size_t size = bytes < 0 ? TCC_WINDOW_DECLINE : static_cast<size_t>(bytes);
  const tcc_result_t r = tcc_window_create(comm, size, timeoutMs, &raw);
  if (r != TCC_OK) {
    // Every rank fails alike; bad sizes are bad input like an op's.
    throwCoreError(r, CallKind::Op, "tccomm: window_create");
  }
  return windowRegistry().add(WindowPtr(raw, tcc_window_destroy));
}

void windowPut(int64_t id, const at::Tensor& src, int64_t dst, int64_t offsetBytes) {
  WindowPtr win = windowRegistry().get("put", id);
  TORCH_CHECK(
      src.device().is_cpu(),
      "tccomm: window put: windows live in host shared memory; the source tensor is on ",
      src.device());
  TORCH_CHECK(offsetBytes >= 0, "tccomm: window put: the offset must not be negative, got ", offsetBytes);
  const at::Tensor c = src.contiguous();
  const size_t bytes = static_cast<size_t>(c.numel()) * c.element_size();
  throwIfFailed(
      tcc_window_put(win.get(), c.data_ptr(), bytes, static_cast<int>(dst), static_cast<size_t>(offsetBytes)));
}

void windowSignal(int64_t id, int64_t dst) {
  WindowPtr win = windowRegistry().get("signal", id);
  throwIfFailed(tcc_window_signal(win.get(), static_cast<int>(dst)));
}

void windowWaitSignal(int64_t id, int64_t peer, int64_t timeoutMs) {
  WindowPtr win = windowRegistry().get("wait_signal", id);
  throwIfFailed(tcc_window_wait_signal(win.get(), static_cast<int>(peer), timeoutMs));
}

at::Tensor windowView(int64_t id, int64_t rank, at::ScalarType dtype, at::IntArrayRef shape) {
  WindowPtr win = windowRegistry().get("map_remote_tensor", id);
  size_t bytes = 0;
  void* ptr = tcc_window_buffer(win.get(), static_cast<int>(rank), &bytes);
  TORCH_CHECK(
      ptr != nullptr,
      "tccomm: window map_remote_tensor: rank ",
      rank,
      " is out of range [0, ",
      tcc_window_size(win.get()),
      ")");
  int64_t numel = 1;
  for (const int64_t d : shape) {
    TORCH_CHECK(d >= 0, "tccomm: window map_remote_tensor: negative dimension in ", shape);
    numel *= d;
  }
  const size_t want = static_cast<size_t>(numel) * c10::elementSize(dtype);
  TORCH_CHECK(
      want <= bytes,
      "tccomm: window map_remote_tensor: a ",
      dtype,
      " tensor of shape ",
      shape,
      " needs ",
      want,
      " bytes but rank ",
      rank,
      "'s buffer has ",
      bytes);
  // The deleter keeps the mapping alive for as long as the view exists.
  return at::from_blob(ptr, shape, [win](void*) mutable { win.reset(); }, at::TensorOptions().dtype(dtype));
}

int64_t windowBufferBytes(int64_t id, int64_t rank) {
  WindowPtr win = windowRegistry().get("map_remote_tensor", id);
  size_t bytes = 0;
  TORCH_CHECK(
      tcc_window_buffer(win.get(), static_cast<int>(rank), &bytes) != nullptr,
      "tccomm: window map_remote_tensor: rank ",
      rank,
      " is out of range [0, ",
      tcc_window_size(win.get()),
      ")");
  return static_cast<int64_t>(bytes);
}

void windowDestroy(int64_t id) {
  windowRegistry().get("tensor_deregister", id);
  windowRegistry().remove(id);
}

} // namespace
} // namespace tccomm

// A fragment of its own, so these ops stay apart from ops.cpp's.
TORCH_LIBRARY_FRAGMENT(tccomm, m) {
  m.def(
      "window_create(__torch__.torch.classes.c10d.ProcessGroup pg, int bytes, int timeout_ms) -> int",
      &tccomm::windowCreate);
  m.def("window_put(int win, Tensor src, int dst, int offset_bytes) -> ()", &tccomm::windowPut);
  m.def("window_signal(int win, int dst) -> ()", &tccomm::windowSignal);
  m.def("window_wait_signal(int win, int peer, int timeout_ms) -> ()", &tccomm::windowWaitSignal);
  m.def("window_view(int win, int rank, ScalarType dtype, int[] shape) -> Tensor", &tccomm::windowView);
  m.def("window_buffer_bytes(int win, int rank) -> int", &tccomm::windowBufferBytes);
  m.def("window_destroy(int win) -> ()", &tccomm::windowDestroy);
}
