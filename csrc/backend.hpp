// backend.hpp - the c10d::Backend of a tccomm group.
//
// One TccBackend per process group, holding the group's core communicator.
// Each op validates its tensors (tensor_bufs.hpp), describes them as core
// buffers, issues one core op per tensor (or per tensor pair), and returns a
// TccWork over those ops (work.hpp). No collective algorithm lives here.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "tccomm.h"
#include "flight_recorder.hpp"
#include "param_comms.hpp"
#include "tensor_bufs.hpp"
#include "torch_compat.hpp"
#include "work.hpp"

namespace tccomm {

// What some ops add to their description: the peer of a send/recv (and
// the work's source rank), the split sizes of an all-to-all.
struct OpExtras {
  int peer = -1;
  int sourceRank = -1; // TccWork's; kSourceFromOp for a receive from any source
  // The caller's split sizes, alive until run() returns (all-to-all only).
  const std::vector<int64_t>* inSplits = nullptr;
  const std::vector<int64_t>* outSplits = nullptr;
};

class TccBackend final : public c10d::Backend {
 public:
  // Takes ownership of `comm`. `advertiseAddr` (where this process's
  // endpoints listen) and `transport` (the one asked for at creation) are
  // used again for groups split from this one.
  TccBackend(
      tcc_comm_t* comm,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      const std::string& name,
      std::string advertiseAddr,
      tcc_transport_t transport);
  ~TccBackend() override;

  const std::string getBackendName() const override {
    return "tccomm";
  }
  // A copy: callers (ProcessGroup::splitGroup) edit what they get.
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsSplitting() const override {
    return true;
  }
  // The ranks of `ranks` (ranks of this group; the order gives the new
  // ranks) form a new group, created through `store`. Returns null on a
  // rank that is not among them. Only the members take part in creating
  // its host side; once this group has its NCCL communicator, every rank
  // of this group must call split (as dist.split_group does), since the
  // child's NCCL communicator is split from it (ProcessGroupNCCL's rule).
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  bool supportsCoalescing() const override {
    return true;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
#ifdef TCCOMM_HAS_BOUND_DEVICE
  // A CUDA device creates the group's NCCL communicator now (eager init).
  void setBoundDeviceId(std::optional<at::Device> device) override;
#endif
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  c10d::ErrorType getError() override;
  // Fails every pending and future op; the communicator is freed later.
  void abort() override;
  // Waits for issued ops, then frees the communicator.
  void shutdown() override;
  // The members' global ranks (torch's global_ranks_in_group), for the
  // profiler's metadata; set once after creation.
  void setGlobalRanks(std::vector<uint64_t> ranks);
  // The core communicator, for features built on the same group (windows,
  // csrc/window_ops.cpp); throws unless the group is usable. Stays owned here.
  tcc_comm_t* coreComm(const char* op);

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  // allreduce of `input` into `output` (same shape and dtype), input left
  // as it is: the functional all_reduce's result without a copy first.
  c10::intrusive_ptr<c10d::Work> allreduceInto(at::Tensor& input, at::Tensor& output,
                                               const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputTensorLists,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#ifdef TCCOMM_HAS_GATHER_INTO_TENSOR
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputTensors,
      std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputTensors,
      std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // Makes argument errors raised on this thread name the group and rank.
  ErrorScope errorScope() const {
    return ErrorScope(groupName_, rank_);
  }

 private:
  // Issues one core op on the communicator.
  using CoreCall = std::function<tcc_result_t(tcc_comm_t*, const tcc_op_opts_t*, tcc_op_t**)>;

  // One validated core op, ready to issue: its buffers and the call.
  struct Step {
    explicit Step(const char* op) : buffers(op) {}
    // The reduce op's PREMUL_SUM factor for buffers like `like`: a tensor
    // factor stays on the device for CUDA buffers (premulDevice).
    void setReduction(const Reduction& red, const at::Tensor& like);
    Buffers buffers;
    double premulFactor = 1.0;
    const void* premulDevice = nullptr; // kept alive by `buffers`
    CoreCall call;
  };

  // Issues `steps` in order and wraps them in one TccWork. Everything that
  // can be checked has been by now; this only fails when the core refuses.
  c10::intrusive_ptr<c10d::Work> run(
      const char* op,
      c10d::OpType type,
      std::chrono::milliseconds timeout,
      std::vector<Step> steps,
      std::vector<at::Tensor> outputs,
      const std::vector<at::Tensor>& inputs,
      OpExtras extras = {});
  // run() for the common case of a single core op.
  c10::intrusive_ptr<c10d::Work> runOne(
      const char* op,
      c10d::OpType type,
      std::chrono::milliseconds timeout,
      Step step,
      std::vector<at::Tensor> outputs,
      const std::vector<at::Tensor>& inputs,
      OpExtras extras = {});
  // The group as torch's profiler names it. Caller holds mutex_.
  GroupIdentity identity() const;
  // all_reduce of a sparse COO tensor (sparse_allreduce.cpp): runs to the
  // end before it returns a completed work.
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // Throws unless the communicator can take new ops. Caller holds mutex_.
  void checkUsable(const char* op) const;
  // The device side of split: the child's NCCL communicator from this
  // group's (nothing while this group has none). child null: no color.
  void splitDevice(const char* op, int color, tcc_comm_t* child);
  // Allgather of one tensor into one tensor of size x its elements.
  Step allgatherIntoTensor(const char* op, at::Tensor& output, at::Tensor& input) const;
  // Reduce-scatter of one tensor of size x the output's elements.
  Step reduceScatterTensor(const char* op, at::Tensor& output, at::Tensor& input, const Reduction& red) const;

  // Guards everything below. Held while ops are issued, which may wait
  // inside the core (NCCL setup, a nonblocking NCCL enqueue), so abort()
  // must not need it.
  std::mutex mutex_;
  // What abort() takes instead: comm_'s lifetime (shutdown writes comm_
  // under both). Never held across a call that can block.
  std::mutex lifetimeMutex_;
  tcc_comm_t* comm_; // nullptr once shut down
  std::atomic<bool> aborted_{false};
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<PendingOp>> coalescedOps_;
  std::vector<at::Tensor> coalescedOutputs_;
  std::vector<at::Tensor> coalescedInputs_;
  c10::intrusive_ptr<Options> options_;
  // Ops issued so far, collectives and point-to-point apart (as nccl
  // numbers them for the profiler).
  int64_t collectiveSeq_ = 0;
  int64_t p2pSeq_ = 0;
  // The group's flight recorder ring (null when the recorder is off), and
  // whether it knows the group's current name and ranks.
  const std::shared_ptr<GroupRecorder> recorder_;
  bool recorderNamed_ = false;
  const std::string groupName_; // as the core names the communicator
  const std::string advertiseAddr_;
  const tcc_transport_t transport_;
};

} // namespace tccomm
