// ops.cpp - torch.ops.tccomm.*: the bootstrap of a tccomm group.
//
// Python reaches the C++ side only through these TorchScript ops (no binding library).
//   endpoint_open(addr)  opens this process's endpoint, returns its blob.
//   endpoint_close(blob) closes an endpoint that will not be attached.
//   attach(carrier, blobs, rank, size, timeout_ms, name)
//                        creates the communicator from every rank's blob and
//                        installs a TccBackend on `carrier` (a ProcessGroup),
//                        from which Python takes it with _get_backend().
//   build_info()         JSON: whether the CUDA path was built, the nccl.h it
//                        was built with and the NCCL found at run time.
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "backend.hpp"
#include "tccomm.h"

namespace tccomm {
namespace {

// Endpoints opened by this process and not attached yet, keyed by their
// blob (it holds the endpoint's random token, so it is unique).
class EndpointRegistry {
 public:
  void add(std::string blob, tcc_endpoint_t* ep) {
    std::lock_guard<std::mutex> lock(mutex_);
    endpoints_[std::move(blob)] = ep;
  }
  // Removes and returns the endpoint of `blob`, or nullptr.
  tcc_endpoint_t* take(const std::string& blob) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = endpoints_.find(blob);
    if (it == endpoints_.end()) {
      return nullptr;
    }
    tcc_endpoint_t* ep = it->second;
    endpoints_.erase(it);
    return ep;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, tcc_endpoint_t*> endpoints_;
};

EndpointRegistry& registry() {
  static auto* r = new EndpointRegistry(); // never destroyed: used until exit
  return *r;
}

std::string blobKey(const char* op, const at::Tensor& blob) {
  TORCH_CHECK(
      blob.device().is_cpu() && blob.scalar_type() == at::kByte && blob.is_contiguous() &&
          blob.numel() == TCC_ENDPOINT_BLOB_SIZE,
      "tccomm: ",
      op,
      ": expected an endpoint blob (a contiguous CPU uint8 tensor of ",
      TCC_ENDPOINT_BLOB_SIZE,
      " bytes)");
  return std::string(static_cast<const char*>(blob.data_ptr()), TCC_ENDPOINT_BLOB_SIZE);
}

at::Tensor endpointOpen(std::string advertiseAddr) {
  char err[512] = {0};
  tcc_endpoint_t* ep = nullptr;
  at::Tensor blob = at::empty({TCC_ENDPOINT_BLOB_SIZE}, at::kByte);
  const tcc_result_t r = tcc_endpoint_open(
      advertiseAddr.c_str(), &ep, static_cast<uint8_t*>(blob.data_ptr()), err, sizeof err);
  if (r != TCC_OK) {
    C10_THROW_ERROR(
        DistNetworkError,
        c10::str(
            "tccomm: endpoint_open(",
            advertiseAddr,
            "): ",
            err[0] != '\0' ? err : tcc_result_string(r)));
  }
  registry().add(blobKey("endpoint_open", blob), ep);
  return blob;
}

void endpointClose(const at::Tensor& blob) {
  tcc_endpoint_t* ep = registry().take(blobKey("endpoint_close", blob));
  if (ep != nullptr) {
    tcc_endpoint_close(ep);
  }
}

void attach(
    const c10::intrusive_ptr<c10d::ProcessGroup>& carrier,
    const at::Tensor& blobs,
    int64_t rank,
    int64_t size,
    int64_t timeoutMs,
    std::string name) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "tccomm: attach: rank ", rank, " is out of range [0, ", size, ")");
  TORCH_CHECK(timeoutMs > 0, "tccomm: attach: the timeout must be positive, got ", timeoutMs, " ms");
  TORCH_CHECK(
      blobs.device().is_cpu() && blobs.scalar_type() == at::kByte && blobs.is_contiguous() &&
          blobs.numel() == size * TCC_ENDPOINT_BLOB_SIZE,
      "tccomm: attach: expected the blobs of all ranks (a contiguous CPU uint8 tensor of ",
      size,
      " x ",
      TCC_ENDPOINT_BLOB_SIZE,
      " bytes)");
  const auto* all = static_cast<const uint8_t*>(blobs.data_ptr());
  const std::string mine(reinterpret_cast<const char*>(all) + rank * TCC_ENDPOINT_BLOB_SIZE, TCC_ENDPOINT_BLOB_SIZE);
  tcc_endpoint_t* ep = registry().take(mine);
  TORCH_CHECK(
      ep != nullptr,
      "tccomm: attach: the blob of rank ",
      rank,
      " is not an endpoint opened by this process (or it was attached already)");

  tcc_comm_config_t cfg{};
  cfg.rank = static_cast<int>(rank);
  cfg.size = static_cast<int>(size);
  cfg.timeout_ms = timeoutMs;
  cfg.name = name.c_str();
  cfg.transport = TCC_TRANSPORT_AUTO;
  char err[512] = {0};
  tcc_comm_t* comm = nullptr;
  // Consumes ep whatever the result.
  const tcc_result_t r = tcc_comm_create(&cfg, ep, all, &comm, err, sizeof err);
  if (r != TCC_OK) {
    C10_THROW_ERROR(
        DistBackendError,
        c10::str(
            "tccomm: creating communicator '",
            name,
            "' (rank ",
            rank,
            " of ",
            size,
            ") failed: ",
            err[0] != '\0' ? err : tcc_result_string(r)));
  }
  auto backend = c10::make_intrusive<TccBackend>(
      comm, static_cast<int>(rank), static_cast<int>(size), std::chrono::milliseconds(timeoutMs), name);
  carrier->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
}

std::string buildInfo() {
  int runtime = 0;
  char err[512] = {0};
  std::string runtimeJson = "null";
  std::string errorJson = "\"\"";
  if (tcc_cuda_built()) {
    if (tcc_nccl_runtime_version(&runtime, err, sizeof err) == TCC_OK) {
      runtimeJson = std::to_string(runtime);
    } else {
      std::string quoted;
      for (const char* p = err; *p != '\0'; ++p) {
        if (*p == '"' || *p == '\\') {
          quoted += '\\';
        }
        quoted += *p;
      }
      errorJson = "\"" + quoted + "\"";
    }
  }
  return c10::str(
      "{\"cuda\": ",
      tcc_cuda_built() ? "true" : "false",
      ", \"nccl_header_version\": ",
      tcc_nccl_header_version(),
      ", \"nccl_runtime_version\": ",
      runtimeJson,
      ", \"nccl_error\": ",
      errorJson,
      "}");
}

} // namespace
} // namespace tccomm

TORCH_LIBRARY(tccomm, m) {
  m.def("build_info() -> str", &tccomm::buildInfo);
  m.def("endpoint_open(str advertise_addr) -> Tensor", &tccomm::endpointOpen);
  m.def("endpoint_close(Tensor blob) -> ()", &tccomm::endpointClose);
  m.def(
      "attach(__torch__.torch.classes.c10d.ProcessGroup carrier, Tensor blobs, int rank, "
      "int size, int timeout_ms, str name) -> ()",
      &tccomm::attach);
}
