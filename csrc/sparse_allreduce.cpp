// sparse_allreduce.cpp - all_reduce (SUM) of a sparse COO tensor, as gloo
// offers it (DDP with nn.Embedding(sparse=True) reduces such gradients).
//
// Only torch knows sparse layouts, so this is a composition of the group's
// dense collectives, not a new algorithm: every rank contributes its
// coalesced indices and values (padded to the largest count, so one
// allgather of equal parts moves them), and every rank then sums the same
// concatenation, in rank order, with torch's coalesce. The result is
// therefore bit-identical on every rank, like the dense reductions.
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

#include "backend.hpp"

namespace tccomm {

namespace {

// What every rank must agree on, then the element count:
// [dtype, sparse dims, dense dims, size 0 .. size kMaxDims-1, nnz].
constexpr int64_t kMaxDims = 16;
constexpr int64_t kMetaLen = 3 + kMaxDims + 1;
constexpr int64_t kNnz = kMetaLen - 1;

at::Tensor describe(const at::Tensor& t) {
  auto meta = at::zeros({kMetaLen}, at::kLong);
  auto m = meta.accessor<int64_t, 1>();
  m[0] = static_cast<int64_t>(t.scalar_type());
  m[1] = t.sparse_dim();
  m[2] = t.dense_dim();
  for (int64_t d = 0; d < t.dim(); d++) {
    m[3 + d] = t.size(d);
  }
  m[kNnz] = t._nnz();
  return meta;
}

} // namespace

c10::intrusive_ptr<c10d::Work> TccBackend::sparseAllreduce(at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  TCC_CHECK(tensor.layout() == at::kSparse, op, "sparse tensors must have the COO layout, not ", tensor.layout());
  TCC_CHECK(
      opts.reduceOp == c10d::ReduceOp::SUM,
      op,
      "sparse tensors are reduced with SUM only (as on gloo), not ",
      opts.reduceOp.op_);
  TCC_CHECK(tensor.device().is_cpu(), op, "sparse tensors must be on the CPU, not ", tensor.device());
  TCC_CHECK(tensor.dim() <= kMaxDims, op, "sparse tensors of more than ", kMaxDims, " dimensions are not supported");
  at::NoGradGuard noGrad;
  const at::Tensor mine = tensor.coalesce();

  c10d::AllgatherOptions gather; // the allreduce's timeout (or the group's) bounds each step
  gather.timeout = opts.timeout;
  auto meta = describe(mine);
  auto metas = at::empty({size_ * kMetaLen}, at::kLong);
  _allgather_base(metas, meta, gather)->wait();
  const auto all = metas.view({size_, kMetaLen});
  int64_t maxNnz = 0;
  std::vector<int64_t> nnz(size_);
  for (int r = 0; r < size_; r++) {
    TCC_CHECK(
        all[r].narrow(0, 0, kNnz).equal(meta.narrow(0, 0, kNnz)),
        op,
        "rank ",
        r,
        "'s sparse tensor differs in dtype, shape or sparse/dense dimensions from this rank's (",
        mine.scalar_type(),
        ", ",
        mine.sizes(),
        ", ",
        mine.sparse_dim(),
        " sparse dims)");
    nnz[r] = all[r][kNnz].item<int64_t>();
    maxNnz = std::max(maxNnz, nnz[r]);
  }

  const int64_t myNnz = mine._nnz();
  auto indices = at::zeros({mine.sparse_dim(), maxNnz}, at::kLong);
  indices.narrow(1, 0, myNnz).copy_(mine._indices());
  std::vector<int64_t> valueShape = mine._values().sizes().vec();
  valueShape[0] = maxNnz;
  auto values = at::zeros(valueShape, mine._values().options());
  values.narrow(0, 0, myNnz).copy_(mine._values());

  valueShape[0] = size_ * maxNnz;
  auto allIndices = at::empty({size_, mine.sparse_dim(), maxNnz}, at::kLong);
  auto allValues = at::empty(valueShape, values.options());
  _allgather_base(allIndices, indices, gather)->wait();
  _allgather_base(allValues, values, gather)->wait();

  std::vector<at::Tensor> idx, val;
  for (int r = 0; r < size_; r++) {
    idx.push_back(allIndices[r].narrow(1, 0, nnz[r]));
    val.push_back(allValues.narrow(0, r * maxNnz, nnz[r]));
  }
  const auto sum = at::sparse_coo_tensor(at::cat(idx, 1), at::cat(val, 0), mine.sizes()).coalesce();
  tensor.copy_(sum);
  std::vector<at::Tensor> tensors{tensor};
  return TccWork::create(rank_, c10d::OpType::ALLREDUCE, op, {}, tensors, tensors);
}

} // namespace tccomm
