// work.hpp - core op handles wrapped as c10d::Work.
//
// A PendingOp is one op of the core: its handle, and the buffers that must
// outlive it. It owns the op's single completion callback (the core allows
// one), runs the copies back into non-contiguous outputs, and then tells
// every TccWork that includes it. A TccWork is what c10d sees: one or more
// PendingOps (several for coalesced ops and for endCoalescing), completed
// when the last of them completes.
//
// CUDA ops follow ProcessGroupNCCL's stream semantics: wait() makes the
// caller's current stream wait for the op (the host does not block), the
// future is device-aware and complete at once, isCompleted() asks the
// device. The tensors stay referenced until the op completes on the device.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "flight_recorder.hpp"
#include "tccomm.h"
#include "tensor_bufs.hpp"

namespace tccomm {

class TccWork;

// True on a thread that is running a core completion callback (the core's
// engine threads, or a thread inside tcc_op_wait): such a thread must not
// destroy the communicator.
bool inCoreCallback();

class PendingOp : public c10::intrusive_ptr_target {
 public:
  PendingOp(const char* op, Buffers buffers);
  ~PendingOp() override;

  // Takes over `handle` (one reference) and registers the completion
  // callback, which keeps this object (and so the buffers) alive until the
  // core reports completion, whoever else lets go of it.
  static void start(const c10::intrusive_ptr<PendingOp>& self, tcc_op_t* handle);

  // Tells `work` when this op completes (at once if it already has).
  void addListener(c10::intrusive_ptr<TccWork> work);

  tcc_op_t* handle() const {
    return handle_;
  }
  // -1 for a host op, else its CUDA device.
  int device() const {
    return device_;
  }
  // The NCCL stream the op runs on (CUDA ops; set by the backend).
  void* ncclStream() const {
    return ncclStream_;
  }
  // Called for a CUDA op once the core accepted it, before start(): notes
  // its NCCL stream and, under graph capture, tells the allocator its
  // tensors are in use there.
  void prepareCuda(void* ncclStream);
  // CUDA ops with non-contiguous outputs: has the caller's current stream
  // wait for the op, then copies the results into the outputs on it.
  // Called by the issuing thread once the op's NCCL work is enqueued.
  void cudaCopyBack();
  const char* name() const {
    return op_;
  }

 private:
  static void onComplete(tcc_op_t* handle, void* arg);
  void complete();

  const char* op_;
  tcc_op_t* handle_ = nullptr;
  const int device_;
  void* ncclStream_ = nullptr;
  Buffers buffers_;
  mutable std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<c10::intrusive_ptr<TccWork>> listeners_;
};

class TccWork : public c10d::Work {
 public:
  // sourceRank for a receive from any source: the op knows once complete.
  static constexpr int kSourceFromOp = -2;
  // `outputs` is the future's value (the tensors c10d callers read).
  static c10::intrusive_ptr<TccWork> create(
      int rank,
      c10d::OpType type,
      const char* op,
      std::vector<c10::intrusive_ptr<PendingOp>> ops,
      std::vector<at::Tensor> outputs,
      const std::vector<at::Tensor>& inputs,
      int sourceRank = -1,
      RecorderTicket ticket = {});

  // Host ops: blocks until they finish. CUDA ops: the current stream waits.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // CUDA ops: the current stream waits for them (as wait() does).
  void synchronize() override;
  // Both hand completion to code that does not wait: they make sure the
  // core starts the ops at once (tcc_op_start); for CUDA ops isCompleted
  // queries the device.
  bool isCompleted() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // Use create(), which also registers the work with its ops. `title`: the
  // profiler's name for the work, nullptr while nobody listens.
  TccWork(
      int rank,
      c10d::OpType type,
      const char* title,
      const char* op,
      std::vector<c10::intrusive_ptr<PendingOp>> ops,
      std::vector<at::Tensor> outputs,
      const std::vector<at::Tensor>& inputs,
      int sourceRank,
      RecorderTicket ticket);

  // Called by each PendingOp when it completes, with its error (nullptr on
  // success).
  void opDone(const std::exception_ptr& error);

 private:
  void complete();
  void completeFuture(c10::ivalue::Future& future, const std::exception_ptr& error);
  // A future completion handed to the core's detached pool (tcc_run_detached).
  struct FutureCompletion {
    c10::intrusive_ptr<TccWork> work;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::exception_ptr error;
  };
  static void runFutureCompletion(void* arg);
  // tcc_op_start on every op of this work.
  void startOps();
  // Makes the current stream wait for the CUDA ops; throws the error of
  // any op that has already failed.
  void waitOnStream();

  const char* op_;
  std::vector<c10::intrusive_ptr<PendingOp>> ops_;
  std::vector<at::Tensor> outputs_;
  const int sourceRank_;
  int device_ = -1; // the CUDA device of the work's CUDA ops, -1: host only
  void* ncclStream_ = nullptr;
  // Made on the first getFuture(): most works are only waited on, and a
  // future costs allocations (a scan of the outputs when completed; CUDA:
  // events). Host: completed by the last op, or at once if that was earlier.
  // CUDA: complete and device-aware from the start.
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_; // guarded by futureMutex_
  bool futureDue_ = false; // host ops completed; guarded by futureMutex_
  // The op's entry in the group's flight recorder, told when it ends.
  const RecorderTicket ticket_;
  std::atomic<size_t> remaining_;
  // Written under errorMutex_ by a failed op before it counts itself done in
  // remaining_; so whoever brings remaining_ to 0 reads it without the lock.
  std::mutex errorMutex_;
  std::exception_ptr firstError_;
};

} // namespace tccomm
