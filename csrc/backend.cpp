// backend.cpp - see backend.hpp.
#include "backend.hpp"
#include "core_error.hpp"
#include "rendezvous.hpp"
#include "timeouts.hpp"

#include "cuda_support.hpp"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

namespace tccomm {

namespace {

using c10d::OpType;

int64_t timeoutMs(std::chrono::milliseconds timeout) {
  // c10d's kUnsetTimeout (-1) and 0 both mean the communicator's timeout.
  return timeout.count() > 0 ? clampTimeout(timeout).count() : 0;
}

uint64_t coreTag(int tag) {
  return static_cast<uint64_t>(static_cast<uint32_t>(tag));
}

// Frees a communicator. tcc_comm_destroy joins the core's threads, so it
// must not run on one of them (the last reference to a backend can be
// dropped by a future continuation): hand it to a thread of its own then.
void destroyComm(tcc_comm_t* comm) {
  if (comm == nullptr) {
    return;
  }
  if (inCoreCallback()) {
    std::thread([comm] { tcc_comm_destroy(comm); }).detach();
    return;
  }
  tcc_comm_destroy(comm);
}

// Rows of dimension 0 that go to (or come from) each peer in an alltoall.
std::vector<size_t> splitRows(
    const char* op,
    const char* role,
    const std::vector<int64_t>& splits,
    int64_t dim0,
    int size) {
  if (splits.empty()) {
    TCC_CHECK(
        dim0 % size == 0,
        op,
        "the ",
        role,
        " tensor's dimension 0 (",
        dim0,
        ") does not divide equally across the group size ",
        size,
        "; pass split sizes");
    return std::vector<size_t>(size, static_cast<size_t>(dim0 / size));
  }
  TCC_CHECK(
      splits.size() == static_cast<size_t>(size),
      op,
      role,
      " split sizes has ",
      splits.size(),
      " entries, expected the group size ",
      size);
  std::vector<size_t> rows(size);
  int64_t total = 0;
  for (const auto j : c10::irange(size)) {
    TCC_CHECK(splits[j] >= 0, op, role, " split size ", j, " is negative (", splits[j], ")");
    rows[j] = static_cast<size_t>(splits[j]);
    total += splits[j];
  }
  TCC_CHECK(
      total == dim0,
      op,
      role,
      " split sizes sum to ",
      total,
      " but the ",
      role,
      " tensor's dimension 0 is ",
      dim0);
  return rows;
}

// Element ranges [offset, offset + rows * row) of consecutive splits.
std::vector<tcc_buf_t> splitBufs(const tcc_buf_t& whole, const std::vector<size_t>& rows, size_t row) {
  std::vector<tcc_buf_t> bufs;
  bufs.reserve(rows.size());
  size_t offset = 0;
  for (const size_t r : rows) {
    bufs.push_back(sliceBuf(whole, offset, r * row));
    offset += r * row;
  }
  return bufs;
}

// `tensors` has `size` entries, each with the dtype of `like` and `numel` elements.
void checkTensorList(
    const char* op,
    const std::vector<at::Tensor>& tensors,
    const at::Tensor& like,
    int64_t numel,
    int size,
    const char* role) {
  TCC_CHECK(
      tensors.size() == static_cast<size_t>(size),
      op,
      "the ",
      role,
      " list has ",
      tensors.size(),
      " tensors, expected the group size ",
      size);
  for (const auto j : c10::irange(tensors.size())) {
    checkTensorLike(op, tensors[j], like, role);
    TCC_CHECK(
        tensors[j].numel() == numel,
        op,
        role,
        " tensor ",
        j,
        " has ",
        tensors[j].numel(),
        " elements, expected ",
        numel);
  }
}

// On ranks other than the root, the root-only list must be absent or empty.
void checkNoRootList(
    const char* op,
    const std::vector<std::vector<at::Tensor>>& lists,
    int rank,
    int root,
    const char* role) {
  TCC_CHECK(
      lists.empty() || (lists.size() == 1 && lists[0].empty()),
      op,
      "only the root (rank ",
      root,
      ") passes ",
      role,
      " tensors; rank ",
      rank,
      " passed some");
}

// The one tensor list of a root-side list argument.
std::vector<at::Tensor>& rootList(
    const char* op,
    std::vector<std::vector<at::Tensor>>& lists,
    const char* role) {
  TCC_CHECK(
      lists.size() == 1,
      op,
      "expected one ",
      role,
      " tensor list on the root, got ",
      lists.size(),
      " (tccomm moves one tensor per process per op)");
  return lists[0];
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (const auto& list : lists) {
    all.insert(all.end(), list.begin(), list.end());
  }
  return all;
}

} // namespace

TccBackend::TccBackend(
    tcc_comm_t* comm,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& name,
    std::string advertiseAddr,
    tcc_transport_t transport)
    : c10d::Backend(rank, size),
      comm_(comm),
      options_(c10::make_intrusive<Options>("tccomm", timeout)),
      recorder_(GroupRecorder::create()),
      groupName_(name),
      advertiseAddr_(std::move(advertiseAddr)),
      transport_(transport) {
  options_->group_name = name;
  cuda::installCoreAllocator(); // once per process; nothing without CUDA
  init();
}

c10::intrusive_ptr<c10d::Backend::Options> TccBackend::getBackendOptions() {
  std::lock_guard<std::mutex> lock(mutex_);
  return c10::make_intrusive<Options>(*options_);
}

c10::intrusive_ptr<c10d::Backend> TccBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const char* op = "split";
  const ErrorScope scope(groupName_, rank_);
  TCC_CHECK(!ranks.empty(), op, "the list of ranks is empty");
  std::vector<bool> seen(size_, false);
  for (int r : ranks) {
    TCC_CHECK(r >= 0 && r < size_, op, "rank ", r, " is not in this group of ", size_, " ranks");
    TCC_CHECK(!seen[r], op, "rank ", r, " is listed twice");
    seen[r] = true;
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) {
    splitDevice(op, TCC_SPLIT_NOCOLOR, nullptr);
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checkUsable(op);
  }
  const auto timeout = opts ? opts->timeout : options_->timeout;
  const std::string name = opts && !opts->group_name.empty()
      ? opts->group_name
      : c10::str(options_->group_name, ":split:", ranks);
  auto child = createBackend(
      store, static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()), timeout, name, advertiseAddr_, transport_);
  if (opts) {
    child->options_->group_desc = opts->group_desc;
    child->options_->global_ranks_in_group = opts->global_ranks_in_group;
  }
  // Splits never overlap, so the lowest rank names one.
  splitDevice(op, *std::min_element(ranks.begin(), ranks.end()), child->comm_);
  return child;
}

void TccBackend::splitDevice(const char* op, int color, tcc_comm_t* child) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkUsable(op);
  const tcc_result_t r = tcc_comm_cuda_split(comm_, color, child, nullptr);
  if (r != TCC_OK) {
    throwCoreError(r, CallKind::Setup, c10::str("tccomm: ", op, " of '", groupName_, "' (rank ", rank_, ")"));
  }
}

TccBackend::~TccBackend() {
  tcc_comm_t* comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    comm = std::exchange(comm_, nullptr);
  }
  destroyComm(comm);
}

void TccBackend::shutdown() {
  tcc_comm_t* comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::lock_guard<std::mutex> lifetime(lifetimeMutex_);
    comm = std::exchange(comm_, nullptr);
  }
  destroyComm(comm);
}

void TccBackend::abort() {
  // Not mutex_: a thread issuing an op may hold it while it waits inside
  // the core, and this abort is what ends that wait.
  std::lock_guard<std::mutex> lifetime(lifetimeMutex_);
  if (comm_ != nullptr && !aborted_.exchange(true)) {
    tcc_comm_abort(comm_);
  }
  aborted_ = true;
}

tcc_comm_t* TccBackend::coreComm(const char* op) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkUsable(op);
  return comm_;
}

void TccBackend::checkUsable(const char* op) const {
  if (aborted_) {
    C10_THROW_ERROR(DistBackendError, c10::str("tccomm: ", op, ": the process group was aborted"));
  }
  if (comm_ == nullptr) {
    C10_THROW_ERROR(DistBackendError, c10::str("tccomm: ", op, ": the process group has been shut down"));
  }
}

void TccBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(timeout.count() > 0, "tccomm: setTimeout: the timeout must be positive, got ", timeout.count(), " ms");
  options_->timeout = clampTimeout(timeout);
  if (comm_ != nullptr) {
    tcc_comm_set_timeout(comm_, options_->timeout.count());
  }
}

#ifdef TCCOMM_HAS_BOUND_DEVICE
void TccBackend::setBoundDeviceId(std::optional<at::Device> device) {
  c10d::Backend::setBoundDeviceId(device);
  if (!device.has_value() || !device->is_cuda()) {
    return;
  }
  // init_process_group(device_id=...): every rank binds its device now, so
  // the NCCL communicator is created eagerly instead of at the first op.
  TORCH_CHECK(
      cuda::kBuilt,
      "tccomm: init_process_group(device_id=",
      *device,
      "): tccomm was built without CUDA");
  std::lock_guard<std::mutex> lock(mutex_);
  checkUsable("eager CUDA init");
  const tcc_result_t r = tcc_comm_cuda_init(comm_, device->index());
  if (r != TCC_OK) {
    throwCoreError(r, CallKind::Setup, c10::str("tccomm: device_id=", *device));
  }
}
#endif

void TccBackend::setSequenceNumberForGroup() {
  // Every rank creates the communicator together, so the count of issued
  // collectives starts at 0 everywhere: nothing to agree on.
}

uint64_t TccBackend::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mutex_);
  checkUsable("getSequenceNumberForGroup");
  return tcc_comm_collective_count(comm_);
}

c10d::ErrorType TccBackend::getError() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    return c10d::ErrorType::COMM_ERROR;
  }
  if (comm_ == nullptr) {
    return c10d::ErrorType::SUCCESS;
  }
  switch (tcc_comm_status(comm_)) {
    case TCC_OK:
      return c10d::ErrorType::SUCCESS;
    case TCC_ERR_TIMEOUT:
      return c10d::ErrorType::TIMEOUT;
    case TCC_ERR_REMOTE:
      return c10d::ErrorType::REMOTE_ERROR;
    default:
      return c10d::ErrorType::COMM_ERROR;
  }
}

void TccBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!coalescing_, "tccomm: startCoalescing: already coalescing (missing endCoalescing)");
  checkUsable("startCoalescing");
  // CUDA ops until endCoalescing form one NCCL group; host ops are unaffected.
  tcc_comm_group_start(comm_);
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> TccBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<PendingOp>> ops;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> inputs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "tccomm: endCoalescing: startCoalescing was not called");
    coalescing_ = false;
    ops.swap(coalescedOps_);
    outputs.swap(coalescedOutputs_);
    inputs.swap(coalescedInputs_);
    if (comm_ != nullptr && tcc_comm_group_end(comm_) != TCC_OK) {
      // The ops carry the failure; wait() raises it.
      TORCH_WARN_ONCE("tccomm: endCoalescing: ", coreErrorMessage(TCC_ERR_SYSTEM));
    }
    for (auto& pending : ops) {
      pending->cudaCopyBack(); // no-op for host ops
    }
  }
  return TccWork::create(rank_, OpType::COALESCED, "coalesced ops", std::move(ops), std::move(outputs), inputs);
}

c10::intrusive_ptr<c10d::Work> TccBackend::run(
    const char* op,
    OpType type,
    std::chrono::milliseconds timeout,
    std::vector<Step> steps,
    std::vector<at::Tensor> outputs,
    const std::vector<at::Tensor>& inputs,
    OpExtras extras) {
  std::vector<c10::intrusive_ptr<PendingOp>> ops;
  ops.reserve(steps.size());
  // The CUDA steps of one call go to NCCL as one group (one launch).
  const bool cudaOp = !steps.empty() && steps[0].buffers.device() >= 0;
  const bool grouped = cudaOp && steps.size() > 1;
  // Taken before the lock: capturing the Python stack may wait for the GIL.
  std::shared_ptr<torch::CapturedTraceback> stack = recorder_ ? GroupRecorder::captureStack() : nullptr;
  RecorderTicket ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checkUsable(op);
    const bool p2p = type == OpType::SEND || type == OpType::RECV || type == OpType::RECVANYSOURCE;
    const int64_t seq = p2p ? ++p2pSeq_ : ++collectiveSeq_;
    OpParams params;
    params.type = type;
    params.p2p = p2p;
    params.seq = seq;
    params.peer = extras.peer;
    params.inputs = &inputs;
    params.outputs = &outputs;
    params.inSplits = extras.inSplits;
    params.outSplits = extras.outSplits;
    // Described only while a profiler listens: the description costs copies.
    std::optional<ParamCommsRecord> profiled;
    if (ParamCommsRecord::wanted()) {
      profiled.emplace(identity(), params);
    }
    if (grouped) {
      tcc_comm_group_start(comm_);
    }
    for (auto& step : steps) {
      tcc_op_opts_t opts{};
      opts.timeout_ms = timeoutMs(timeout);
      opts.premul_factor = step.premulFactor;
      opts.premul_device_factor = step.premulDevice;
      auto pending = c10::make_intrusive<PendingOp>(op, std::move(step.buffers));
      tcc_op_t* handle = nullptr;
      const tcc_result_t r = step.call(comm_, &opts, &handle);
      if (r != TCC_OK) {
        // Read before group_end, which may fail on this thread too.
        const std::string msg = coreErrorMessage(r);
        if (grouped) {
          tcc_comm_group_end(comm_); // launches (and so completes) the steps issued so far
        }
        if (ops.empty()) {
          throwCoreError(r, CallKind::Op);
        }
        // Those finish on their own (their buffers stay alive until then);
        // the group cannot be used as if nothing happened.
        C10_THROW_ERROR(
            DistBackendError,
            c10::str(msg, " (", ops.size(), " of the ", steps.size(), " ops of this ", op, " were issued)"));
      }
      if (pending->device() >= 0) {
        pending->prepareCuda(tcc_op_cuda_stream(handle));
      }
      PendingOp::start(pending, handle);
      ops.push_back(std::move(pending));
    }
    if (recorder_) {
      if (!recorderNamed_) {
        recorder_->setIdentity(identity());
        recorderNamed_ = true;
      }
      RecordedOp recorded;
      recorded.op = &params;
      recorded.cuda = cudaOp;
      recorded.collectiveSeq = collectiveSeq_;
      recorded.p2pSeq = p2pSeq_;
      recorded.timeout = timeout.count() > 0 ? clampTimeout(timeout) : options_->timeout;
      ticket = recorder_->record(recorded, ops, std::move(stack));
    }
    if (grouped && tcc_comm_group_end(comm_) != TCC_OK) {
      // The ops carry the failure; wait() raises it.
      TORCH_WARN_ONCE("tccomm: ", op, ": ", coreErrorMessage(TCC_ERR_SYSTEM));
    }
    if (coalescing_) {
      coalescedOps_.insert(coalescedOps_.end(), ops.begin(), ops.end());
      coalescedOutputs_.insert(coalescedOutputs_.end(), outputs.begin(), outputs.end());
      coalescedInputs_.insert(coalescedInputs_.end(), inputs.begin(), inputs.end());
    } else if (cudaOp) {
      for (auto& pending : ops) {
        pending->cudaCopyBack();
      }
    }
  }
  return TccWork::create(
      rank_, type, op, std::move(ops), std::move(outputs), inputs, extras.sourceRank, std::move(ticket));
}

void TccBackend::setGlobalRanks(std::vector<uint64_t> ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      ranks.empty() || ranks.size() == static_cast<size_t>(size_),
      "tccomm: '", groupName_, "' has ", size_, " ranks but ", ranks.size(), " global ranks were given");
  options_->global_ranks_in_group = std::move(ranks);
  recorderNamed_ = false;
}

GroupIdentity TccBackend::identity() const {
  GroupIdentity id;
  id.name = getGroupUid().empty() ? groupName_ : getGroupUid();
  id.desc = getGroupDesc().empty() ? options_->group_desc : getGroupDesc();
  id.rank = rank_;
  id.size = size_;
  id.globalRanks = options_->global_ranks_in_group;
  return id;
}

c10::intrusive_ptr<c10d::Work> TccBackend::runOne(
    const char* op,
    OpType type,
    std::chrono::milliseconds timeout,
    Step step,
    std::vector<at::Tensor> outputs,
    const std::vector<at::Tensor>& inputs,
    OpExtras extras) {
  std::vector<Step> steps;
  steps.push_back(std::move(step));
  return run(op, type, timeout, std::move(steps), std::move(outputs), inputs, std::move(extras));
}

// ---- collectives -----------------------------------------------------------

c10::intrusive_ptr<c10d::Work> TccBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& tensor = singleTensor(op, tensors, "input");
  const int root = checkRank(op, "root", opts.rootRank, size_);
  TCC_CHECK(opts.rootTensor == 0, op, "rootTensor must be 0, got ", opts.rootTensor);
  Step step(op);
  const tcc_buf_t buf = step.buffers.inout(tensor);
  step.call = [buf, root](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_broadcast(c, buf, root, o, h);
  };
  return runOne(op, OpType::BROADCAST, opts.timeout, std::move(step), tensors, tensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  const ErrorScope scope(groupName_, rank_);
  if (tensors.size() == 1 && tensors[0].is_sparse()) {
    return sparseAllreduce(tensors[0], opts);
  }
  at::Tensor& tensor = singleTensor(op, tensors, "input");
  TCC_CHECK(!opts.sparseIndices.has_value(), op, "sparse allreduce is not supported");
  const Reduction red = toReduction(op, opts.reduceOp, tensor.scalar_type());
  Step step(op);
  step.setReduction(red, tensor);
  const tcc_buf_t buf = step.buffers.inout(tensor);
  step.call = [buf, red](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_allreduce(c, buf, buf, red.op, o, h);
  };
  return runOne(op, OpType::ALLREDUCE, opts.timeout, std::move(step), tensors, tensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::allreduceInto(
    at::Tensor& input,
    at::Tensor& output,
    const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  const ErrorScope scope(groupName_, rank_);
  checkTensor(op, input, "input");
  checkTensorLike(op, output, input, "output");
  TCC_CHECK(output.numel() == input.numel(), op, "the output has ", output.numel(), " elements, the input ",
            input.numel());
  const Reduction red = toReduction(op, opts.reduceOp, input.scalar_type());
  Step step(op);
  step.setReduction(red, input);
  const tcc_buf_t in = step.buffers.input(input);
  const tcc_buf_t out = step.buffers.output(output);
  step.call = [in, out, red](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_allreduce(c, in, out, red.op, o, h);
  };
  return runOne(op, OpType::ALLREDUCE, opts.timeout, std::move(step), {output}, {input});
}

c10::intrusive_ptr<c10d::Work> TccBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  const ErrorScope scope(groupName_, rank_);
  TCC_CHECK(!tensors.empty(), op, "no tensors given");
  std::vector<Step> steps;
  // Each tensor is its own core op: dtypes may differ between tensors.
  for (auto& tensor : tensors) {
    checkTensor(op, tensor, "input");
    const Reduction red = toReduction(op, opts.reduceOp, tensor.scalar_type());
    Step step(op);
    step.setReduction(red, tensor);
    const tcc_buf_t buf = step.buffers.inout(tensor);
    step.call = [buf, red](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
      return tcc_allreduce(c, buf, buf, red.op, o, h);
    };
    steps.push_back(std::move(step));
  }
  return run(op, OpType::ALLREDUCE_COALESCED, opts.timeout, std::move(steps), tensors, tensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& tensor = singleTensor(op, tensors, "input");
  const int root = checkRank(op, "root", opts.rootRank, size_);
  TCC_CHECK(opts.rootTensor == 0, op, "rootTensor must be 0, got ", opts.rootTensor);
  const Reduction red = toReduction(op, opts.reduceOp, tensor.scalar_type());
  Step step(op);
  step.setReduction(red, tensor);
  const tcc_buf_t buf = step.buffers.inout(tensor);
  step.call = [buf, red, root](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_reduce(c, buf, buf, red.op, root, o, h);
  };
  return runOne(op, OpType::REDUCE, opts.timeout, std::move(step), tensors, tensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& input = singleTensor(op, inputTensors, "input");
  TCC_CHECK(
      outputTensors.size() == 1,
      op,
      "expected one output tensor list, got ",
      outputTensors.size(),
      " (tccomm moves one tensor per process per op)");
  auto& outputs = outputTensors[0];
  checkTensorList(op, outputs, input, input.numel(), size_, "output");
  Step step(op);
  const tcc_buf_t send = step.buffers.input(input);
  std::vector<tcc_buf_t> recvs;
  for (auto& out : outputs) {
    recvs.push_back(step.buffers.output(out));
  }
  step.call = [send, recvs](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_allgather(c, send, recvs.data(), o, h);
  };
  return runOne(op, OpType::ALLGATHER, opts.timeout, std::move(step), outputs, inputTensors);
}

void TccBackend::Step::setReduction(const Reduction& red, const at::Tensor& like) {
  premulFactor = red.premulFactor;
  if (!red.premulTensor.defined()) {
    return;
  }
  if (like.is_cuda()) {
    // Read by the device when the reduction runs, as ProcessGroupNCCL does:
    // no host sync (and legal under graph capture). Converted on the
    // caller's stream, which the core's NCCL stream waits for.
    at::Tensor factor = red.premulTensor.to(like.device(), like.scalar_type(), /*non_blocking=*/true).contiguous();
    premulDevice = factor.data_ptr();
    buffers.keep(std::move(factor));
  } else {
    premulFactor = red.premulTensor.item<double>();
  }
}

TccBackend::Step TccBackend::allgatherIntoTensor(const char* op, at::Tensor& output, at::Tensor& input) const {
  checkTensor(op, input, "input");
  checkTensorLike(op, output, input, "output");
  const int64_t n = input.numel();
  TCC_CHECK(
      output.numel() == size_ * n,
      op,
      "the output has ",
      output.numel(),
      " elements, expected group size x input elements = ",
      size_,
      " x ",
      n);
  Step step(op);
  const tcc_buf_t send = step.buffers.input(input);
  const tcc_buf_t whole = step.buffers.output(output);
  std::vector<tcc_buf_t> recvs;
  for (const auto j : c10::irange(size_)) {
    recvs.push_back(sliceBuf(whole, static_cast<size_t>(j * n), static_cast<size_t>(n)));
  }
  step.call = [send, recvs](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_allgather(c, send, recvs.data(), o, h);
  };
  return step;
}

c10::intrusive_ptr<c10d::Work> TccBackend::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& opts) {
  const char* op = "_allgather_base";
  const ErrorScope scope(groupName_, rank_);
  return runOne(op, OpType::_ALLGATHER_BASE, opts.timeout, allgatherIntoTensor(op, outputBuffer, inputBuffer), {outputBuffer}, {inputBuffer});
}

c10::intrusive_ptr<c10d::Work> TccBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  // outputTensorLists[q][k] receives input k of rank q (as in gloo).
  const char* op = "allgather_coalesced";
  const ErrorScope scope(groupName_, rank_);
  TCC_CHECK(!inputTensors.empty(), op, "no tensors given");
  TCC_CHECK(
      outputTensorLists.size() == static_cast<size_t>(size_),
      op,
      "got ",
      outputTensorLists.size(),
      " output lists, expected one per rank (",
      size_,
      ")");
  for (const auto k : c10::irange(inputTensors.size())) {
    checkTensorLike(op, inputTensors[k], inputTensors[0], "input");
  }
  for (const auto q : c10::irange(outputTensorLists.size())) {
    const auto& list = outputTensorLists[q];
    TCC_CHECK(
        list.size() == inputTensors.size(),
        op,
        "output list ",
        q,
        " has ",
        list.size(),
        " tensors, expected one per input (",
        inputTensors.size(),
        ")");
    for (const auto k : c10::irange(list.size())) {
      checkTensorLike(op, list[k], inputTensors[0], "output");
      TCC_CHECK(
          list[k].numel() == inputTensors[k].numel(),
          op,
          "output ",
          q,
          "/",
          k,
          " has ",
          list[k].numel(),
          " elements, input ",
          k,
          " has ",
          inputTensors[k].numel());
    }
  }
  std::vector<Step> steps;
  for (const auto k : c10::irange(inputTensors.size())) {
    Step step(op);
    const tcc_buf_t send = step.buffers.input(inputTensors[k]);
    std::vector<tcc_buf_t> recvs;
    for (auto& list : outputTensorLists) {
      recvs.push_back(step.buffers.output(list[k]));
    }
    step.call = [send, recvs](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
      return tcc_allgather(c, send, recvs.data(), o, h);
    };
    steps.push_back(std::move(step));
  }
  return run(
      op, OpType::ALLGATHER_COALESCED, opts.timeout, std::move(steps), flatten(outputTensorLists), inputTensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_into_tensor_coalesced";
  const ErrorScope scope(groupName_, rank_);
  TCC_CHECK(!inputs.empty(), op, "no tensors given");
  TCC_CHECK(outputs.size() == inputs.size(), op, "got ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<Step> steps;
  for (const auto i : c10::irange(inputs.size())) {
    // Each pair is its own core op: dtypes may differ between pairs.
    checkTensor(op, inputs[i], "input");
    steps.push_back(allgatherIntoTensor(op, outputs[i], inputs[i]));
  }
  return run(op, OpType::COALESCED, opts.timeout, std::move(steps), outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> TccBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& input = singleTensor(op, inputTensors, "input");
  const int root = checkRank(op, "root", opts.rootRank, size_);
  const bool isRoot = rank_ == root;
  std::vector<at::Tensor> outputs;
  if (isRoot) {
    outputs = rootList(op, outputTensors, "output");
    checkTensorList(op, outputs, input, input.numel(), size_, "output");
  } else {
    checkNoRootList(op, outputTensors, rank_, root, "output");
  }
  Step step(op);
  const tcc_buf_t send = step.buffers.input(input);
  std::vector<tcc_buf_t> recvs;
  for (auto& out : outputs) {
    recvs.push_back(step.buffers.output(out));
  }
  step.call = [send, recvs, root, isRoot](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_gather(c, send, isRoot ? recvs.data() : nullptr, root, o, h);
  };
  return runOne(op, OpType::GATHER, opts.timeout, std::move(step), outputs, inputTensors);
}

#ifdef TCCOMM_HAS_GATHER_INTO_TENSOR
c10::intrusive_ptr<c10d::Work> TccBackend::gather_into_tensor(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::GatherOptions& opts) {
  const char* op = "gather_into_tensor";
  const ErrorScope scope(groupName_, rank_);
  checkTensor(op, inputBuffer, "input");
  const int root = checkRank(op, "root", opts.rootRank, size_);
  const bool isRoot = rank_ == root;
  const int64_t n = inputBuffer.numel();
  Step step(op);
  const tcc_buf_t send = step.buffers.input(inputBuffer);
  std::vector<tcc_buf_t> recvs;
  if (isRoot) {
    checkTensorLike(op, outputBuffer, inputBuffer, "output");
    TCC_CHECK(
        outputBuffer.numel() == size_ * n,
        op,
        "the output has ",
        outputBuffer.numel(),
        " elements, expected group size x input elements = ",
        size_,
        " x ",
        n);
    const tcc_buf_t whole = step.buffers.output(outputBuffer);
    for (const auto j : c10::irange(size_)) {
      recvs.push_back(sliceBuf(whole, static_cast<size_t>(j * n), static_cast<size_t>(n)));
    }
  }
  step.call = [send, recvs, root, isRoot](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_gather(c, send, isRoot ? recvs.data() : nullptr, root, o, h);
  };
  return runOne(op, OpType::GATHER, opts.timeout, std::move(step), {outputBuffer}, {inputBuffer});
}
#endif

c10::intrusive_ptr<c10d::Work> TccBackend::scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& output = singleTensor(op, outputTensors, "output");
  const int root = checkRank(op, "root", opts.rootRank, size_);
  const bool isRoot = rank_ == root;
  std::vector<at::Tensor> inputs;
  if (isRoot) {
    inputs = rootList(op, inputTensors, "input");
    checkTensorList(op, inputs, output, output.numel(), size_, "input");
  } else {
    checkNoRootList(op, inputTensors, rank_, root, "input");
  }
  Step step(op);
  const tcc_buf_t recv = step.buffers.output(output);
  std::vector<tcc_buf_t> sends;
  for (auto& in : inputs) {
    sends.push_back(step.buffers.input(in));
  }
  step.call = [sends, recv, root, isRoot](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_scatter(c, isRoot ? sends.data() : nullptr, recv, root, o, h);
  };
  return runOne(op, OpType::SCATTER, opts.timeout, std::move(step), outputTensors, inputs);
}

c10::intrusive_ptr<c10d::Work> TccBackend::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& output = singleTensor(op, outputTensors, "output");
  TCC_CHECK(
      inputTensors.size() == 1,
      op,
      "expected one input tensor list, got ",
      inputTensors.size(),
      " (tccomm moves one tensor per process per op)");
  auto& inputs = inputTensors[0];
  checkTensorList(op, inputs, output, output.numel(), size_, "input");
  const Reduction red = toReduction(op, opts.reduceOp, output.scalar_type());
  Step step(op);
  step.setReduction(red, output);
  std::vector<tcc_buf_t> sends;
  for (auto& in : inputs) {
    sends.push_back(step.buffers.input(in));
  }
  const tcc_buf_t recv = step.buffers.output(output);
  step.call = [sends, recv, red](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_reduce_scatter(c, sends.data(), recv, red.op, o, h);
  };
  return runOne(op, OpType::REDUCE_SCATTER, opts.timeout, std::move(step), outputTensors, inputs);
}

TccBackend::Step TccBackend::reduceScatterTensor(
    const char* op,
    at::Tensor& output,
    at::Tensor& input,
    const Reduction& red) const {
  checkTensor(op, output, "output");
  checkTensorLike(op, input, output, "input");
  const int64_t n = output.numel();
  TCC_CHECK(
      input.numel() == size_ * n,
      op,
      "the input has ",
      input.numel(),
      " elements, expected group size x output elements = ",
      size_,
      " x ",
      n);
  Step step(op);
  step.setReduction(red, output);
  const tcc_buf_t whole = step.buffers.input(input);
  std::vector<tcc_buf_t> sends;
  for (const auto j : c10::irange(size_)) {
    sends.push_back(sliceBuf(whole, static_cast<size_t>(j * n), static_cast<size_t>(n)));
  }
  const tcc_buf_t recv = step.buffers.output(output);
  step.call = [sends, recv, red](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_reduce_scatter(c, sends.data(), recv, red.op, o, h);
  };
  return step;
}

c10::intrusive_ptr<c10d::Work> TccBackend::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "_reduce_scatter_base";
  const ErrorScope scope(groupName_, rank_);
  checkTensor(op, outputBuffer, "output");
  const Reduction red = toReduction(op, opts.reduceOp, outputBuffer.scalar_type());
  return runOne(op, OpType::_REDUCE_SCATTER_BASE, opts.timeout, reduceScatterTensor(op, outputBuffer, inputBuffer, red), {outputBuffer}, {inputBuffer});
}

c10::intrusive_ptr<c10d::Work> TccBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  const ErrorScope scope(groupName_, rank_);
  TCC_CHECK(!outputs.empty(), op, "no tensors given");
  TCC_CHECK(outputs.size() == inputs.size(), op, "got ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<Step> steps;
  // Each pair is its own core op: dtypes may differ between pairs.
  for (const auto i : c10::irange(outputs.size())) {
    checkTensor(op, outputs[i], "output");
    const Reduction red = toReduction(op, opts.reduceOp, outputs[i].scalar_type());
    steps.push_back(reduceScatterTensor(op, outputs[i], inputs[i], red));
  }
#ifdef TCCOMM_HAS_REDUCE_SCATTER_COALESCED_OPTYPE
  const OpType type = OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
  const OpType type = OpType::COALESCED;
#endif
  return run(op, type, opts.timeout, std::move(steps), outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> TccBackend::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall_base";
  const ErrorScope scope(groupName_, rank_);
  checkTensor(op, inputBuffer, "input");
  checkTensorLike(op, outputBuffer, inputBuffer, "output");
  const size_t row = rowElements(op, inputBuffer, "input");
  const size_t outRow = rowElements(op, outputBuffer, "output");
  TCC_CHECK(
      row == outRow,
      op,
      "input and output rows differ: ",
      row,
      " vs ",
      outRow,
      " elements per index of dimension 0");
  const auto sendRows = splitRows(op, "input", inputSplitSizes, inputBuffer.size(0), size_);
  const auto recvRows = splitRows(op, "output", outputSplitSizes, outputBuffer.size(0), size_);
  Step step(op);
  const auto sends = splitBufs(step.buffers.input(inputBuffer), sendRows, row);
  const auto recvs = splitBufs(step.buffers.output(outputBuffer), recvRows, row);
  step.call = [sends, recvs](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_alltoall(c, sends.data(), recvs.data(), o, h);
  };
  OpExtras extras;
  extras.inSplits = &inputSplitSizes;
  extras.outSplits = &outputSplitSizes;
  return runOne(op, OpType::ALLTOALL_BASE, opts.timeout, std::move(step), {outputBuffer}, {inputBuffer}, std::move(extras));
}

c10::intrusive_ptr<c10d::Work> TccBackend::alltoall(
    std::vector<at::Tensor>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall";
  const ErrorScope scope(groupName_, rank_);
  const auto n = static_cast<size_t>(size_);
  TCC_CHECK(
      inputTensors.size() == n,
      op,
      "the input list has ",
      inputTensors.size(),
      " tensors, expected the group size ",
      size_);
  TCC_CHECK(
      outputTensors.size() == n,
      op,
      "the output list has ",
      outputTensors.size(),
      " tensors, expected the group size ",
      size_);
  for (const auto j : c10::irange(n)) {
    checkTensorLike(op, inputTensors[j], inputTensors[0], "input");
    checkTensorLike(op, outputTensors[j], inputTensors[0], "output");
  }
  Step step(op);
  std::vector<tcc_buf_t> sends;
  std::vector<tcc_buf_t> recvs;
  for (const auto j : c10::irange(n)) {
    sends.push_back(step.buffers.input(inputTensors[j]));
    recvs.push_back(step.buffers.output(outputTensors[j]));
  }
  step.call = [sends, recvs](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_alltoall(c, sends.data(), recvs.data(), o, h);
  };
  return runOne(op, OpType::ALLTOALL, opts.timeout, std::move(step), outputTensors, inputTensors);
}

c10::intrusive_ptr<c10d::Work> TccBackend::barrier(const c10d::BarrierOptions& opts) {
  const char* op = "barrier";
  const ErrorScope scope(groupName_, rank_);
  // Once the group ran CUDA ops, a barrier orders device work as nccl's
  // does: this rank's work queued so far (on the current stream and the
  // core's NCCL streams) is finished before the ranks meet.
  const int device = tcc_comm_cuda_device(coreComm(op));
  if (device >= 0) {
    cuda::synchronizeCurrentStream(static_cast<c10::DeviceIndex>(device));
    const tcc_result_t r = tcc_comm_cuda_synchronize(coreComm(op), timeoutMs(opts.timeout));
    if (r != TCC_OK) {
      throwCoreError(r, CallKind::Op);
    }
  }
  Step step(op);
  step.call = [](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) { return tcc_barrier(c, o, h); };
  return runOne(op, OpType::BARRIER, opts.timeout, std::move(step), {}, {});
}

// ---- point to point --------------------------------------------------------

c10::intrusive_ptr<c10d::Work> TccBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const char* op = "send";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& tensor = singleTensor(op, tensors, "input");
  const int peer = checkRank(op, "destination", dstRank, size_);
  TCC_CHECK(peer != rank_, op, "rank ", rank_, " cannot send to itself");
  Step step(op);
  const tcc_buf_t buf = step.buffers.input(tensor);
  step.call = [buf, peer, tag](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_send(c, buf, peer, coreTag(tag), o, h);
  };
  OpExtras extras;
  extras.peer = peer;
  return runOne(op, OpType::SEND, c10d::kUnsetTimeout, std::move(step), tensors, tensors, std::move(extras));
}

c10::intrusive_ptr<c10d::Work> TccBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const char* op = "recv";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& tensor = singleTensor(op, tensors, "output");
  const int peer = checkRank(op, "source", srcRank, size_);
  TCC_CHECK(peer != rank_, op, "rank ", rank_, " cannot receive from itself");
  Step step(op);
  const tcc_buf_t buf = step.buffers.output(tensor);
  step.call = [buf, peer, tag](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_recv(c, buf, peer, coreTag(tag), o, h);
  };
  // The tensor is also the work's "input": torch's profiler records its
  // shape for the receive, as for gloo's.
  OpExtras extras;
  extras.peer = peer;
  extras.sourceRank = peer;
  return runOne(op, OpType::RECV, c10d::kUnsetTimeout, std::move(step), tensors, tensors, std::move(extras));
}

c10::intrusive_ptr<c10d::Work> TccBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const char* op = "recv";
  const ErrorScope scope(groupName_, rank_);
  at::Tensor& tensor = singleTensor(op, tensors, "output");
  Step step(op);
  const tcc_buf_t buf = step.buffers.output(tensor);
  step.call = [buf, tag](tcc_comm_t* c, const tcc_op_opts_t* o, tcc_op_t** h) {
    return tcc_recv(c, buf, TCC_ANY_SOURCE, coreTag(tag), o, h);
  };
  // The sender is known once the receive completes: Work::sourceRank asks the op.
  OpExtras extras;
  extras.sourceRank = TccWork::kSourceFromOp;
  return runOne(op, OpType::RECVANYSOURCE, c10d::kUnsetTimeout, std::move(step), tensors, tensors, std::move(extras));
}

} // namespace tccomm
