// param_comms.cpp - see param_comms.hpp.
#include "param_comms.hpp"

#include <tuple>

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "torch_compat.hpp"

namespace tccomm {
namespace {

int64_t elements(const std::vector<at::Tensor>* tensors) {
  int64_t n = 0;
  if (tensors != nullptr) {
    for (const auto& t : *tensors) {
      n += t.defined() ? t.numel() : 0;
    }
  }
  return n;
}

// The first defined tensor's dtype (inputs first), Byte when there is none.
at::ScalarType dtypeOf(const OpParams& op) {
  for (const auto* list : {op.inputs, op.outputs}) {
    if (list != nullptr) {
      for (const auto& t : *list) {
        if (t.defined()) {
          return t.scalar_type();
        }
      }
    }
  }
  return at::kByte;
}

// nccl's (start, stride) of the members' global ranks; stride -1 when
// they are not evenly spaced (the profiler then lists no ranks).
std::pair<int, int> rankLayout(const GroupIdentity& group) {
  const auto& g = group.globalRanks;
  if (g.empty()) {
    return {0, 1};
  }
  if (g.size() == 1) {
    return {static_cast<int>(g[0]), 1};
  }
  const int64_t stride = static_cast<int64_t>(g[1]) - static_cast<int64_t>(g[0]);
  for (size_t i = 1; i < g.size(); ++i) {
    if (static_cast<int64_t>(g[i]) - static_cast<int64_t>(g[i - 1]) != stride) {
      return {static_cast<int>(g[0]), -1};
    }
  }
  return {static_cast<int>(g[0]), static_cast<int>(stride)};
}

} // namespace

OpNames opNames(c10d::OpType type) {
  using c10d::OpType;
  switch (type) {
    case OpType::BROADCAST:
      return {"tccomm:broadcast", "broadcast", "broadcast"};
    case OpType::ALLREDUCE:
      return {"tccomm:all_reduce", "allreduce", "all_reduce"};
    case OpType::ALLREDUCE_COALESCED:
      return {"tccomm:all_reduce", "allreduce_coalesced", "allreduce_coalesced"};
    case OpType::REDUCE:
      return {"tccomm:reduce", "reduce", "reduce"};
    case OpType::ALLGATHER:
      return {"tccomm:all_gather", "all_gather", "all_gather"};
    case OpType::ALLGATHER_COALESCED:
      return {"tccomm:all_gather", "allgather_coalesced", "ALLGATHER_coalesced"};
    case OpType::_ALLGATHER_BASE:
      return {"tccomm:all_gather_into_tensor", "_allgather_base", "_all_gather_base"};
#ifdef TCCOMM_HAS_ALLGATHER_COALESCED_OPTYPE
    case OpType::ALLGATHER_INTO_TENSOR_COALESCED:
      return {"tccomm:all_gather_into_tensor", "allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced"};
#endif
    case OpType::GATHER:
      return {"tccomm:gather", "gather", "gather"};
    case OpType::SCATTER:
      return {"tccomm:scatter", "scatter", "scatter"};
    case OpType::REDUCE_SCATTER:
      return {"tccomm:reduce_scatter", "reduce_scatter", "reduce_scatter"};
    case OpType::_REDUCE_SCATTER_BASE:
      return {"tccomm:reduce_scatter_tensor", "_reduce_scatter_base", "_reduce_scatter_base"};
#ifdef TCCOMM_HAS_REDUCE_SCATTER_COALESCED_OPTYPE
    case OpType::REDUCE_SCATTER_TENSOR_COALESCED:
      return {"tccomm:reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced"};
#endif
    case OpType::ALLTOALL:
    case OpType::ALLTOALL_BASE:
      return {"tccomm:all_to_all", "all_to_all", "all_to_all"};
    case OpType::BARRIER:
      return {"tccomm:barrier", "barrier", "barrier"};
    case OpType::SEND:
      return {"tccomm:send", "send", "send"};
    case OpType::RECV:
      return {"tccomm:recv", "recv", "recv"};
    case OpType::RECVANYSOURCE:
      return {"tccomm:recvAnySource", "recv", "recv"};
    case OpType::COALESCED:
      return {"tccomm:coalesced", "coalesced", "coalesced"};
    default:
      return {"tccomm:coalesced", "unknown", "coalesced"};
  }
}

bool listening(at::RecordScope scope) {
  // The thread's cached view of the callbacks: an atomic read in the usual
  // case. at::hasCallbacks() copies the global list under a mutex instead,
  // which took about 0.05 us of every op here.
  return at::getStepCallbacksUnlessEmpty(scope).has_value();
}

bool ParamCommsRecord::wanted() {
  return listening(at::RecordScope::FUNCTION);
}

ParamCommsRecord::ParamCommsRecord(const GroupIdentity& group, const OpParams& op) {
  const auto [start, stride] = rankLayout(group);
  const std::tuple<std::string, std::string> pgName{group.name, group.desc};
  const std::vector<int64_t> inSplits = op.inSplits != nullptr ? *op.inSplits : std::vector<int64_t>{};
  const std::vector<int64_t> outSplits = op.outSplits != nullptr ? *op.outSplits : std::vector<int64_t>{};
  const bool uneven = op.type == c10d::OpType::ALLTOALL_BASE && !(inSplits.empty() && outSplits.empty());
  std::string name = uneven ? "all_to_allv" : opNames(op.type).collective;
  const int rankField = op.p2p ? op.peer : group.rank; // nccl's: the peer for send/recv
  auto info = std::make_shared<torch::ParamCommsDebugInfo>(
      pgName,
      rankField,
      std::string(name),
      elements(op.inputs),
      elements(op.outputs),
      dtypeOf(op),
      inSplits,
      outSplits,
      start,
      stride,
      group.size
#ifdef TCCOMM_HAS_PARAM_COMMS_SEQUENCE
      ,
      /*isAsynchronizedOp=*/true
#endif
  );
#ifdef TCCOMM_HAS_PARAM_COMMS_SEQUENCE
  info->setSequenceInfo(op.seq, op.p2p);
#endif
  debugInfo_ = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PARAM_COMMS_INFO, info);
  span_ = std::make_unique<at::RecordFunction>(at::RecordScope::FUNCTION);
  if (!span_->isActive()) {
    return;
  }
  const c10::IValue inputs = op.inputs != nullptr ? c10::IValue(*op.inputs) : c10::IValue(std::vector<at::Tensor>{});
  std::vector<c10::IValue> params = {
      inputs,
      c10::IValue(std::make_tuple(op.seq, op.p2p)),
      c10::IValue(pgName),
      rankField,
      name,
      inSplits,
      outSplits,
      start,
      stride,
      group.size,
#ifdef TCCOMM_HAS_PARAM_COMMS_SEQUENCE
      true,
#endif
  };
  if (span_->needsInputs()) {
    span_->before(at::kParamCommsCallName, c10::ArrayRef<const c10::IValue>(params.data(), params.size()));
  } else {
    span_->before(at::kParamCommsCallName);
  }
  if (span_->needsOutputs()) {
    span_->setOutputs(
        std::vector<c10::IValue>(1, op.outputs != nullptr ? c10::IValue(*op.outputs) : c10::IValue()));
  }
}

ParamCommsRecord::~ParamCommsRecord() = default;

} // namespace tccomm
