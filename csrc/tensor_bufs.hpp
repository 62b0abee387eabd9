// tensor_bufs.hpp - torch tensors -> tccomm buffer descriptors.
//
// Everything here runs before an op reaches the core: it validates tensors
// (device, dtype, layout, sizes, ranks) and throws an error naming the op and
// the cause, so a bad call never sends anything.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "tccomm.h"

namespace tccomm {

// While one lives on a thread, argument errors raised there name the group
// and this rank, as the core's own errors do. A backend call opens one
// first thing: the checks below run deep inside it and know neither.
class ErrorScope {
 public:
  ErrorScope(const std::string& group, int rank);
  ~ErrorScope();
  ErrorScope(const ErrorScope&) = delete;
  ErrorScope& operator=(const ErrorScope&) = delete;

 private:
  const std::string* outerGroup_;
  int outerRank_;
};

// "tccomm <op> on '<group>' (rank <r>): " inside an ErrorScope, else "tccomm: <op>: ".
std::string errorPrefix(const char* op);

// Throws c10::Error (Python: RuntimeError) "<errorPrefix(op)><message>";
// the message is only built when the check fails.
#define TCC_CHECK(cond, op, ...) TORCH_CHECK(cond, ::tccomm::errorPrefix(op), __VA_ARGS__)

// The core's dtype for a torch dtype; throws for anything tccomm cannot move.
tcc_dtype_t toTccDtype(const char* op, at::ScalarType type);

// A c10d reduce op as the core sees it.
struct Reduction {
  tcc_redop_t op;
  double premulFactor; // TCC_PREMUL_SUM only; 1.0 otherwise
  // TCC_PREMUL_SUM given a one-element tensor factor: read where the op
  // runs (Step::setReduction), never here, so a CUDA factor costs no sync.
  at::Tensor premulTensor;
};

// Maps a c10d ReduceOp (PREMUL_SUM: its factor from the supplement) and
// checks that the core can apply it to `type`.
Reduction toReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType type);

// Checks device (CPU, or CUDA when built with it), layout and dtype of one tensor.
void checkTensor(const char* op, const at::Tensor& t, const char* role);
// Checks `t` and that it has the dtype and device of `like`.
void checkTensorLike(const char* op, const at::Tensor& t, const at::Tensor& like, const char* role);

// The one tensor of a c10d tensor list (tccomm moves one tensor per process
// per op, like gloo on CPU).
at::Tensor& singleTensor(const char* op, std::vector<at::Tensor>& tensors, const char* role);

// `rank` in [0, size), as int; throws naming `role` ("root", "peer", ...).
int checkRank(const char* op, const char* role, int64_t rank, int size);

// Elements per row of dimension 0 (alltoall splits); throws for 0-d tensors.
size_t rowElements(const char* op, const at::Tensor& t, const char* role);

// The element range [offset, offset + count) of a buffer.
tcc_buf_t sliceBuf(const tcc_buf_t& whole, size_t offset, size_t count);

// The memory of one core op: the contiguous buffers handed to the core, kept
// alive until the op completes, and the copies back into non-contiguous
// output tensors that make the op's results visible where c10d expects them.
class Buffers {
 public:
  explicit Buffers(const char* op) : op_(op) {}

  // Read by the core. A non-contiguous tensor is copied to a contiguous one.
  tcc_buf_t input(const at::Tensor& t);
  // Written by the core. A non-contiguous tensor is staged through a
  // contiguous temporary that is copied back when the op succeeds.
  tcc_buf_t output(const at::Tensor& t);
  // Read and written (in-place ops): like output, with the data copied in.
  tcc_buf_t inout(const at::Tensor& t);

  // Runs the copies back; called once, after the op succeeded (CUDA: once
  // the caller's stream waits for the op, on that stream).
  void copyBack();
  bool hasCopyBack() const {
    return !copyBack_.empty();
  }
  // Forgets the copies back (done, or the op failed); the staging stays alive.
  void dropCopyBack();
  // Keeps `t` alive as long as the described buffers (a tensor the op reads
  // through a pointer of its own, such as a device PREMUL_SUM factor).
  void keep(at::Tensor t) {
    keepAlive_.push_back(std::move(t));
  }
  // Drops every tensor reference.
  void clear();
  // -1 for CPU tensors, else the CUDA device of the described tensors.
  int device() const {
    return device_;
  }
  const std::vector<at::Tensor>& tensors() const {
    return keepAlive_;
  }

 private:
  tcc_buf_t describe(const at::Tensor& contiguous);
  tcc_buf_t staged(const at::Tensor& t, bool copyIn);

  const char* op_;
  int device_ = -1;
  std::vector<at::Tensor> keepAlive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copyBack_; // (destination, staging)
};

} // namespace tccomm
