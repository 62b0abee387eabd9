// work.cpp - see work.hpp.
#include "work.hpp"

#include "core_error.hpp"

#include "param_comms.hpp"

#include "cuda_support.hpp"
#include "timeouts.hpp"

#include <algorithm>
#include <chrono>
#include <memory>

#include <ATen/core/jit_type.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

namespace tccomm {

namespace {

thread_local bool tlsInCoreCallback = false;

std::exception_ptr backendError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
}

std::string coreFailure(const char* op, tcc_op_t* handle) {
  const char* msg = tcc_op_error(handle);
  if (msg != nullptr && msg[0] != '\0') {
    return msg;
  }
  return std::string("tccomm: ") + op + ": " + tcc_result_string(tcc_op_result(handle));
}

// The name under which torch's profiler shows a work, from issue to
// completion ("tccomm:all_reduce", as gloo's are "gloo:all_reduce").
// nullptr while no profiler callback listens in the scope c10d::Work records
// in: it then skips the recording (an allocation per op) altogether.
const char* profilingTitle(c10d::OpType type) {
  return listening(at::RecordScope::USER_SCOPE) ? opNames(type).span : nullptr;
}

// The inputs c10d::Work records with the span: only when there is one. The
// argument is a std::optional of a vector, so passing the vector copies it,
// and each copied tensor's reference count crossing 1 <-> 2 takes the GIL
// (torch keeps a tensor's Python object alive while C++ holds it).
std::optional<std::vector<at::Tensor>> recordedInputs(const char* title, const std::vector<at::Tensor>& inputs) {
  if (title == nullptr) {
    return std::nullopt;
  }
  return inputs;
}

} // namespace

bool inCoreCallback() {
  return tlsInCoreCallback;
}

// ---- PendingOp -------------------------------------------------------------

PendingOp::PendingOp(const char* op, Buffers buffers)
    : op_(op), device_(buffers.device()), buffers_(std::move(buffers)) {}

PendingOp::~PendingOp() {
  tcc_op_release(handle_);
}

void PendingOp::start(const c10::intrusive_ptr<PendingOp>& self, tcc_op_t* handle) {
  self->handle_ = handle;
  // The callback owns one reference, given back in onComplete.
  PendingOp* owned = c10::intrusive_ptr<PendingOp>(self).release();
  const tcc_result_t r = tcc_op_on_complete(handle, &PendingOp::onComplete, owned);
  if (r != TCC_OK) {
    c10::intrusive_ptr<PendingOp>::reclaim(owned); // the callback will not run
    throwCoreError(r, CallKind::Op, std::string("tccomm ") + self->op_);
  }
}

void PendingOp::onComplete(tcc_op_t* /*handle*/, void* arg) {
  auto self = c10::intrusive_ptr<PendingOp>::reclaim(static_cast<PendingOp*>(arg));
  const bool outer = !tlsInCoreCallback;
  tlsInCoreCallback = true;
  self->complete();
  if (outer) {
    tlsInCoreCallback = false;
  }
}

void PendingOp::prepareCuda(void* ncclStream) {
  ncclStream_ = ncclStream;
  cuda::recordIfCapturing(buffers_.tensors(), static_cast<c10::DeviceIndex>(device_), ncclStream);
}

void PendingOp::cudaCopyBack() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!buffers_.hasCopyBack()) {
    return;
  }
  // A failed op copies nothing back: its error reaches the work.
  if (tcc_op_stream_wait(handle_, cuda::currentStream(device_)) == TCC_OK) {
    at::NoGradGuard noGrad;
    buffers_.copyBack();
  }
  buffers_.dropCopyBack();
  if (done_) {
    buffers_.clear();
  }
}

void PendingOp::complete() {
  std::exception_ptr error;
  const bool cuda = device_ >= 0;
  if (tcc_op_result(handle_) != TCC_OK) {
    error = backendError(coreFailure(op_, handle_));
  } else if (!cuda && buffers_.hasCopyBack()) {
    try {
      buffers_.copyBack();
    } catch (const std::exception& e) {
      error = backendError(
          std::string("tccomm: ") + op_ + ": copying the result into a non-contiguous output failed: " +
          e.what());
    }
  }
  std::vector<c10::intrusive_ptr<TccWork>> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = error;
    listeners.swap(listeners_);
    // The data has landed: let the staging copies and inputs go (a CUDA
    // copy-back still to be enqueued keeps them until cudaCopyBack).
    if (!(cuda && buffers_.hasCopyBack())) {
      buffers_.clear();
    }
  }
  for (auto& work : listeners) {
    work->opDone(error);
  }
}

void PendingOp::addListener(c10::intrusive_ptr<TccWork> work) {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      listeners_.push_back(std::move(work));
      return;
    }
    error = error_;
  }
  work->opDone(error);
}

// ---- TccWork ---------------------------------------------------------------

TccWork::TccWork(
    int rank,
    c10d::OpType type,
    const char* title,
    const char* op,
    std::vector<c10::intrusive_ptr<PendingOp>> ops,
    std::vector<at::Tensor> outputs,
    const std::vector<at::Tensor>& inputs,
    int sourceRank,
    RecorderTicket ticket)
    : c10d::Work(rank, type, title, recordedInputs(title, inputs)),
      op_(op),
      ops_(std::move(ops)),
      outputs_(std::move(outputs)),
      sourceRank_(sourceRank),
      ticket_(std::move(ticket)),
      remaining_(ops_.size()) {}

c10::intrusive_ptr<TccWork> TccWork::create(
    int rank,
    c10d::OpType type,
    const char* op,
    std::vector<c10::intrusive_ptr<PendingOp>> ops,
    std::vector<at::Tensor> outputs,
    const std::vector<at::Tensor>& inputs,
    int sourceRank,
    RecorderTicket ticket) {
  auto work = c10::make_intrusive<TccWork>(
      rank, type, profilingTitle(type), op, std::move(ops), std::move(outputs), inputs, sourceRank, std::move(ticket));
  for (auto& pending : work->ops_) {
    if (pending->device() >= 0) {
      work->device_ = pending->device();
      work->ncclStream_ = pending->ncclStream();
      break;
    }
  }
  // The future is made on first use (getFuture), which most calls never
  // reach: it costs allocations (and for CUDA, events) per call.
  if (work->ops_.empty()) {
    work->complete();
  }
  for (auto& pending : work->ops_) {
    pending->addListener(work);
  }
  return work;
}

void TccWork::opDone(const std::exception_ptr& error) {
  if (error) {
    std::lock_guard<std::mutex> lock(errorMutex_);
    if (!firstError_) {
      firstError_ = error;
    }
  }
  if (remaining_.fetch_sub(1) == 1) {
    complete();
  }
}

void TccWork::complete() {
  const std::exception_ptr error = firstError_; // every op is done (see remaining_)
  if (ticket_.recorder) {
    const int source = sourceRank_ == kSourceFromOp && !error ? sourceRank() : -1;
    ticket_.recorder->retire(ticket_.slot, error != nullptr, source);
    if (error) {
      flightRecorderSawFailure(); // the dump is written before wait() raises
    }
  }
  finish(error);
  if (device_ >= 0) {
    return; // the future is complete from the start (see getFuture)
  }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(futureMutex_);
    futureDue_ = true;
    future = future_;
  }
  if (!future) {
    return;
  }
  if (!inCoreCallback()) {
    completeFuture(*future, error);
    return;
  }
  // The future's continuations are user code that may wait for later ops of
  // this group (DDP comm hooks do): they must not run on the thread that
  // progresses those ops. The core's detached pool runs them.
  auto* task = new FutureCompletion{c10::intrusive_ptr<TccWork>::reclaim_copy(this), future, error};
  if (tcc_run_detached(&TccWork::runFutureCompletion, task) != TCC_OK) {
    delete task; // no thread could be started: complete here rather than never
    completeFuture(*future, error);
  }
}

void TccWork::runFutureCompletion(void* arg) {
  std::unique_ptr<FutureCompletion> task(static_cast<FutureCompletion*>(arg));
  task->work->completeFuture(*task->future, task->error);
}

void TccWork::completeFuture(c10::ivalue::Future& future, const std::exception_ptr& error) {
  // Continuations attached to the future run here, on this thread.
  if (error) {
    future.setError(error);
  } else {
    future.markCompleted(c10::IValue(outputs_));
  }
}

void TccWork::waitOnStream() {
  for (auto& pending : ops_) {
    if (pending->device() < 0) {
      continue;
    }
    tcc_op_t* handle = pending->handle();
    const tcc_result_t r = tcc_op_stream_wait(handle, cuda::currentStream(static_cast<c10::DeviceIndex>(pending->device())));
    // Only an op already known to have failed raises here (no device query:
    // wait() must stay cheap); isCompleted() asks the device.
    const tcc_result_t done = tcc_op_result(handle);
    if (r != TCC_OK || (done != TCC_OK && done != TCC_ERR_INPROGRESS)) {
      if (done != TCC_OK && done != TCC_ERR_INPROGRESS) {
        C10_THROW_ERROR(DistBackendError, coreFailure(op_, handle));
      }
      C10_THROW_ERROR(
          DistBackendError,
          c10::str("tccomm: ", op_, ": cannot make the current CUDA stream wait for the op (", tcc_result_string(r), ")"));
    }
  }
}

void TccWork::synchronize() {
  if (device_ >= 0) {
    waitOnStream();
  }
}

bool TccWork::wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const bool bounded = timeout != kNoTimeout;
  if (device_ >= 0) {
    // Stream semantics: the current stream waits for the CUDA ops, the host
    // does not block on them unless the caller gave a timeout (as
    // ProcessGroupNCCL's wait does): then it blocks until they completed
    // and raises if they did not in time. Host ops of a mixed coalesced
    // group are waited for below either way.
    waitOnStream();
    bool hostOps = false;
    for (auto& pending : ops_) {
      hostOps |= pending->device() < 0;
    }
    if (!hostOps && !bounded) {
      return true;
    }
  }
  // The clock is read only for a bounded wait: most waits have no limit.
  const auto deadline = bounded ? Clock::now() + clampTimeout(timeout) : Clock::time_point::max();
  for (auto& pending : ops_) {
    int64_t waitMs = -1; // no limit of our own: the op's timeout applies
    if (pending->device() >= 0 && !bounded) {
      continue; // waited for on the stream above
    }
    if (bounded) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      waitMs = std::max<int64_t>(0, left.count());
    }
    const tcc_result_t r = tcc_op_wait(pending->handle(), waitMs);
    if (r == TCC_ERR_INPROGRESS) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "tccomm: ",
              op_,
              ": Work.wait timed out after ",
              timeout.count(),
              " ms; the op is still running"));
    }
    if (pending->device() >= 0 && r != TCC_OK) {
      C10_THROW_ERROR(DistBackendError, coreFailure(op_, pending->handle()));
    }
  }
  if (device_ >= 0) {
    return true; // without a timeout, the CUDA ops of the group may still be running
  }
  // Every op has finished; the completion callbacks run before waiters
  // wake, so this returns at once (it also orders us after copy-backs).
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return completed_; });
    error = exception_;
  }
  if (error) {
    // A failure reaches the program only once the flight recorder (when
    // on) has written what led to it: the program may exit right after.
    awaitFailureDump();
    std::rethrow_exception(error);
  }
  // A future made before completion is completed on the detached pool:
  // once wait() returns, its value must be readable too.
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(futureMutex_);
    future = future_;
  }
  if (future) {
    future->wait();
  }
  return true;
}

void TccWork::startOps() {
  for (auto& pending : ops_) {
    tcc_op_start(pending->handle());
  }
}

bool TccWork::isCompleted() {
  startOps();
  for (auto& pending : ops_) {
    if (pending->device() >= 0) {
      tcc_op_test(pending->handle()); // asks the device; finishes the op when done
    }
  }
  return c10d::Work::isCompleted();
}

c10::intrusive_ptr<c10::ivalue::Future> TccWork::getFuture() {
  if (device_ >= 0) {
    std::lock_guard<std::mutex> lock(futureMutex_);
    if (!future_) {
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> errorLock(errorMutex_);
        error = firstError_;
      }
      if (error) {
        // Already known to have failed: the future says so.
        future_ = c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()),
            std::vector<c10::Device>{c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_))});
        future_->setError(error);
      } else {
        // Complete now and device-aware, as ProcessGroupNCCL's: a
        // consumer's stream waits for the NCCL stream's work so far, which
        // includes this op (and maybe later ones: waiting for more is safe,
        // never less). A failure found later reaches the program through
        // the error policy (README, "CUDA"), as with nccl.
        future_ = cuda::completedFuture(outputs_, static_cast<c10::DeviceIndex>(device_), ncclStream_);
      }
    }
    return future_;
  }
  startOps();
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool alreadyDone = false;
  {
    std::lock_guard<std::mutex> lock(futureMutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      alreadyDone = futureDue_;
    }
    future = future_;
  }
  if (alreadyDone) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(errorMutex_);
      error = firstError_;
    }
    completeFuture(*future, error);
  }
  return future;
}

std::vector<at::Tensor> TccWork::result() {
  return outputs_;
}

int TccWork::sourceRank() const {
  if (sourceRank_ >= 0) {
    return sourceRank_;
  }
  if (sourceRank_ == kSourceFromOp && ops_.size() == 1) {
    const int source = tcc_op_peer(ops_[0]->handle());
    if (source >= 0) {
      return source;
    }
  }
  return c10d::Work::sourceRank();
}

} // namespace tccomm
