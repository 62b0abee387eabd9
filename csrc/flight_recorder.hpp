// flight_recorder.hpp - the last ops of every tccomm group, for post-mortems.
//
// What torch's flight recorder does for ProcessGroupNCCL, for tccomm groups:
// each group keeps a ring of its last N ops (sequence numbers, op, sizes,
// dtypes, state scheduled/started/completed, timestamps, the Python stack
// that issued it), and the process writes them, in the pickle format of
// torch's recorder, to TORCH_FR_DUMP_TEMP_FILE<global rank>:
//   * on its first failed op (a timeout, a dead peer, an abort, ranks that
//     disagree on a collective), before the error reaches the program;
//   * on the signal named by TCCOMM_FR_DUMP_SIGNAL (e.g. USR1);
//   * on demand: torchcomm_backend.dump_flight_recorder().
// `python -m torch.distributed.flight_recorder.fr_trace <dir>` then reads
// the dumps of all ranks and names the rank and op where they diverged.
//
// Configured as torch's recorder is: TORCH_FR_BUFFER_SIZE (or
// TORCH_NCCL_TRACE_BUFFER_SIZE) > 0 turns it on with rings of that many
// entries (off by default: a recorded op costs a stack capture);
// TORCH_FR_DUMP_TEMP_FILE (or TORCH_NCCL_DEBUG_INFO_TEMP_FILE) is the dump
// file's prefix, default /tmp/nccl_trace_rank_; TORCH_INCLUDE_STACK_TRACE=0
// records no stacks.
//
// torch's analyzer accepts only the names of the libraries it knows before
// the op's name ("nccl:all_reduce"): ops tccomm runs through NCCL carry
// "nccl:", ops on host memory "gloo:" (torch's CPU library, whose op names
// and semantics they share). The dump's comm_lib_version says "tccomm".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "param_comms.hpp"

namespace torch {
struct CapturedTraceback;
}

namespace tccomm {

class PendingOp;
class GroupRecorder;

// One op as the backend issues it: what the profiler is told (op type,
// peer, tensors), and more.
struct RecordedOp {
  const OpParams* op = nullptr;
  bool cuda = false;          // runs through NCCL
  int64_t collectiveSeq = 0;  // the group's collectives so far (this one's, if one)
  int64_t p2pSeq = 0;         // its point-to-point ops so far (this one's, if one)
  std::chrono::milliseconds timeout{0};
};

// What a work keeps to report its op's end to the ring.
struct RecorderTicket {
  std::shared_ptr<GroupRecorder> recorder; // null: not recorded
  uint64_t slot = 0;
};

class GroupRecorder : public std::enable_shared_from_this<GroupRecorder> {
 public:
  // A ring for a new group, or null when the recorder is off.
  static std::shared_ptr<GroupRecorder> create();
  // The group as torch names it; set before the first record and again
  // when it changes (torch names a group after creating its backend).
  void setIdentity(const GroupIdentity& identity);
  // The calling thread's Python stack (null when stacks are off). Called
  // before the backend takes its lock: it may wait for the GIL.
  static std::shared_ptr<torch::CapturedTraceback> captureStack();
  // Records an op as scheduled. `ops`: the core ops it issued, asked at
  // dump time whether they started.
  RecorderTicket record(
      const RecordedOp& op,
      const std::vector<c10::intrusive_ptr<PendingOp>>& ops,
      std::shared_ptr<torch::CapturedTraceback> stack);
  // The op ended. failed: it raised. anySource: a receive from any source
  // now knows its peer (-1 otherwise).
  void retire(uint64_t slot, bool failed, int anySource);

  struct Entry;
  struct Snapshot;
  // Copies the ring (for a dump).
  Snapshot snapshot();

  GroupRecorder(size_t capacity, uint64_t uid);
  ~GroupRecorder();

 private:
  std::mutex mutex_;
  const size_t capacity_;
  const uint64_t uid_;
  std::unique_ptr<GroupIdentity> identity_;
  std::vector<Entry> ring_;
  uint64_t recorded_ = 0; // slots handed out; slot % capacity_ is the index
};

// Writes the dump of every live group to `path` ("" for
// TORCH_FR_DUMP_TEMP_FILE<global rank>); returns the path written, or ""
// when the recorder is off. Throws when the file cannot be written.
std::string dumpFlightRecorder(const std::string& path);
// An op failed: the first failure of the process dumps (on the recorder's
// own thread, so that the engine thread reporting it never blocks).
void flightRecorderSawFailure();
// Before a failure is raised to the program: waits (GIL released, at most
// a minute) until the failure dump requested above is written.
void awaitFailureDump();

} // namespace tccomm
