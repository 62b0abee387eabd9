// param_comms.hpp - what torch's profiler sees of a tccomm op besides its
// "tccomm:<op>" span (work.cpp): the record_param_comms event with the
// metadata the nccl backend attaches (collective name, group name,
// description and ranks, sequence number, element counts, split sizes,
// dtype), which torch's trace export and tools built on it (HTA) read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace at {
class RecordFunction;
enum class RecordScope : uint8_t;
}
namespace c10 {
class DebugInfoGuard;
}

namespace tccomm {

// The group an op runs on, as the profiler names it.
struct GroupIdentity {
  std::string name; // torch's group name ("0" for the default group)
  std::string desc; // torch's group description ("default_pg", ...)
  int rank = 0;
  int size = 1;
  // Global ranks of the group's members; empty: 0 .. size-1.
  std::vector<uint64_t> globalRanks;
};

// One op as described to the profiler.
struct OpParams {
  c10d::OpType type;
  bool p2p = false;
  int64_t seq = 0;  // per group and kind (collective or p2p), from 1, as nccl's
  int peer = -1;    // send/recv: the group rank of the other side
  const std::vector<at::Tensor>* inputs = nullptr;
  const std::vector<at::Tensor>* outputs = nullptr;
  const std::vector<int64_t>* inSplits = nullptr; // all-to-all's, else none
  const std::vector<int64_t>* outSplits = nullptr;
};

// The names torch's tools show for an op type: its profiler span
// ("tccomm:all_reduce", as gloo's "gloo:all_reduce"), nccl's collective
// name in the profiler's metadata ("allreduce"; all_to_all with split sizes
// is "all_to_allv", which OpParams decides), and the op as torch's flight
// recorder names it ("all_reduce"; the names its analyzer matches).
struct OpNames {
  const char* span;
  const char* collective;
  const char* recorder;
};
OpNames opNames(c10d::OpType type);

// Whether a profiler (or other RecordFunction callback) listens in `scope`
// on this thread now.
bool listening(at::RecordScope scope);

// The record_param_comms event of one op: open while the op is issued.
class ParamCommsRecord {
 public:
  // Whether the event would be recorded (listening() for its scope): build
  // the description only then.
  static bool wanted();
  ParamCommsRecord(const GroupIdentity& group, const OpParams& op);
  ~ParamCommsRecord();
  ParamCommsRecord(const ParamCommsRecord&) = delete;
  ParamCommsRecord& operator=(const ParamCommsRecord&) = delete;

 private:
  std::unique_ptr<c10::DebugInfoGuard> debugInfo_;
  std::unique_ptr<at::RecordFunction> span_;
};

} // namespace tccomm
