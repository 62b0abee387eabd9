// tensor_bufs.cpp - see tensor_bufs.hpp.
#include "tensor_bufs.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/util/irange.h>

#include "cuda_support.hpp"

namespace tccomm {

namespace {
thread_local const std::string* scopeGroup = nullptr;
thread_local int scopeRank = -1;
} // namespace

ErrorScope::ErrorScope(const std::string& group, int rank) : outerGroup_(scopeGroup), outerRank_(scopeRank) {
  scopeGroup = &group;
  scopeRank = rank;
}

ErrorScope::~ErrorScope() {
  scopeGroup = outerGroup_;
  scopeRank = outerRank_;
}

std::string errorPrefix(const char* op) {
  if (scopeGroup == nullptr) {
    return c10::str("tccomm: ", op, ": ");
  }
  return c10::str("tccomm ", op, " on '", *scopeGroup, "' (rank ", scopeRank, "): ");
}

tcc_dtype_t toTccDtype(const char* op, at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return TCC_FLOAT32;
    case at::kDouble:
      return TCC_FLOAT64;
    case at::kHalf:
      return TCC_FLOAT16;
    case at::kBFloat16:
      return TCC_BFLOAT16;
    case at::kChar:
      return TCC_INT8;
    case at::kShort:
      return TCC_INT16;
    case at::kInt:
      return TCC_INT32;
    case at::kLong:
      return TCC_INT64;
    case at::kByte:
      return TCC_UINT8;
    case at::kBool:
      return TCC_BOOL;
    default:
      TORCH_CHECK(
          false,
          "tccomm: ",
          op,
          ": dtype ",
          type,
          " is not supported (supported: float32, float64, float16, bfloat16, "
          "int8, int16, int32, int64, uint8, bool)");
  }
}

namespace {

tcc_redop_t toTccRedop(const char* op, c10d::ReduceOp::RedOpType type) {
  switch (type) {
    case c10d::ReduceOp::SUM:
      return TCC_SUM;
    case c10d::ReduceOp::AVG:
      return TCC_AVG;
    case c10d::ReduceOp::PRODUCT:
      return TCC_PRODUCT;
    case c10d::ReduceOp::MIN:
      return TCC_MIN;
    case c10d::ReduceOp::MAX:
      return TCC_MAX;
    case c10d::ReduceOp::BAND:
      return TCC_BAND;
    case c10d::ReduceOp::BOR:
      return TCC_BOR;
    case c10d::ReduceOp::BXOR:
      return TCC_BXOR;
    case c10d::ReduceOp::PREMUL_SUM:
      return TCC_PREMUL_SUM;
    default:
      TORCH_CHECK(false, "tccomm: ", op, ": unknown reduce op ", static_cast<int>(type));
  }
}

// The factor of a PREMUL_SUM the way ProcessGroupNCCL takes it: a double
// (into r.premulFactor), or a one-element tensor (r.premulTensor, read later
// where the op runs).
void premulFactor(const char* op, const c10d::ReduceOp& reduceOp, Reduction& r) {
  const auto* supplement =
      dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(reduceOp.supplement_.get());
  TCC_CHECK(
      supplement != nullptr,
      op,
      "PREMUL_SUM without its factor (create it with "
      "torch.distributed._make_nccl_premul_sum(factor))");
  if (!supplement->tensor_factor.defined()) {
    r.premulFactor = supplement->double_factor;
    return;
  }
  TCC_CHECK(
      supplement->tensor_factor.numel() == 1,
      op,
      "the PREMUL_SUM factor must be a one-element tensor, got ",
      supplement->tensor_factor.numel(),
      " elements");
  r.premulTensor = supplement->tensor_factor;
}

} // namespace

Reduction toReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType type) {
  const tcc_dtype_t dtype = toTccDtype(op, type);
  Reduction r{toTccRedop(op, reduceOp.op_), 1.0, at::Tensor()};
  TCC_CHECK(
      tcc_redop_supported(dtype, r.op) == TCC_OK,
      op,
      "reduce op ",
      tcc_redop_name(r.op),
      " is not supported for dtype ",
      tcc_dtype_name(dtype),
      " (",
      type,
      ")");
  if (r.op == TCC_PREMUL_SUM) {
    premulFactor(op, reduceOp, r);
  }
  return r;
}

void checkTensor(const char* op, const at::Tensor& t, const char* role) {
  TCC_CHECK(t.defined(), op, "the ", role, " tensor is undefined");
  if (t.is_cuda()) {
    TCC_CHECK(
        cuda::kBuilt,
        op,
        "the ",
        role,
        " tensor is on ",
        t.device(),
        " but tccomm was built without CUDA (torch without CUDA, or no CUDA toolkit / nccl.h "
        "when tccomm was built; see setup.py)");
  } else {
    TCC_CHECK(
        t.device().is_cpu(),
        op,
        "the ",
        role,
        " tensor is on ",
        t.device(),
        "; tccomm supports CPU and CUDA tensors only");
  }
  TCC_CHECK(
      t.layout() == at::kStrided,
      op,
      "the ",
      role,
      " tensor has layout ",
      t.layout(),
      "; only dense (strided) tensors are supported");
  toTccDtype(op, t.scalar_type());
}

void checkTensorLike(const char* op, const at::Tensor& t, const at::Tensor& like, const char* role) {
  checkTensor(op, t, role);
  TCC_CHECK(
      t.device() == like.device(),
      op,
      "mixed devices: the ",
      role,
      " tensor is on ",
      t.device(),
      " but the op's first tensor is on ",
      like.device(),
      " (one op moves CPU tensors or tensors of one CUDA device)");
  TCC_CHECK(
      t.scalar_type() == like.scalar_type(),
      op,
      "mixed dtypes: the ",
      role,
      " tensor is ",
      t.scalar_type(),
      " but the op's first tensor is ",
      like.scalar_type());
}

at::Tensor& singleTensor(const char* op, std::vector<at::Tensor>& tensors, const char* role) {
  TCC_CHECK(
      tensors.size() == 1,
      op,
      "expected exactly one ",
      role,
      " tensor per process, got ",
      tensors.size(),
      " (tccomm moves one tensor per process per op)");
  checkTensor(op, tensors[0], role);
  return tensors[0];
}

int checkRank(const char* op, const char* role, int64_t rank, int size) {
  TCC_CHECK(
      rank >= 0 && rank < size, op, role, " rank ", rank, " is out of range [0, ", size, ")");
  return static_cast<int>(rank);
}

size_t rowElements(const char* op, const at::Tensor& t, const char* role) {
  TCC_CHECK(t.dim() >= 1, op, "the ", role, " tensor must have at least one dimension");
  size_t row = 1;
  for (const auto d : c10::irange(int64_t{1}, t.dim())) {
    row *= static_cast<size_t>(t.size(d));
  }
  return row;
}

tcc_buf_t sliceBuf(const tcc_buf_t& whole, size_t offset, size_t count) {
  tcc_buf_t b = whole;
  b.ptr = static_cast<char*>(whole.ptr) + offset * tcc_dtype_size(whole.dtype);
  b.count = count;
  return b;
}

tcc_buf_t Buffers::describe(const at::Tensor& contiguous) {
  keepAlive_.push_back(contiguous);
  tcc_buf_t b{};
  b.ptr = contiguous.numel() > 0 ? contiguous.data_ptr() : nullptr;
  b.count = static_cast<size_t>(contiguous.numel());
  b.dtype = toTccDtype(op_, contiguous.scalar_type());
  if (contiguous.is_cuda()) {
    b.device = contiguous.get_device();
    // The core orders its NCCL stream after the caller's current stream.
    b.stream = cuda::currentStream(contiguous.get_device());
  } else {
    b.device = -1;
    b.stream = nullptr;
  }
  device_ = b.device;
  return b;
}

tcc_buf_t Buffers::input(const at::Tensor& t) {
  return describe(t.contiguous());
}

tcc_buf_t Buffers::staged(const at::Tensor& t, bool copyIn) {
  if (t.is_contiguous()) {
    return describe(t);
  }
  TCC_CHECK(
      at::has_internal_overlap(t) != at::MemOverlap::Yes,
      op_,
      "an output tensor has overlapping memory (e.g. made by expand()); "
      "it cannot receive data");
  at::Tensor staging = copyIn ? t.contiguous() : at::empty(t.sizes(), t.options());
  copyBack_.emplace_back(t, staging);
  return describe(staging);
}

tcc_buf_t Buffers::output(const at::Tensor& t) {
  return staged(t, /*copyIn=*/false);
}

tcc_buf_t Buffers::inout(const at::Tensor& t) {
  return staged(t, /*copyIn=*/true);
}

void Buffers::copyBack() {
  // Autograd does not track what the core wrote; the copy-back must not
  // either (outputs may be leaves that require grad).
  at::NoGradGuard noGrad;
  for (auto& [destination, staging] : copyBack_) {
    destination.copy_(staging);
  }
}

void Buffers::dropCopyBack() {
  copyBack_.clear();
}

void Buffers::clear() {
  keepAlive_.clear();
  copyBack_.clear();
}

} // namespace tccomm
