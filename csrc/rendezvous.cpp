// rendezvous.cpp - see rendezvous.hpp.
#include "rendezvous.hpp"
#include "core_error.hpp"
#include "timeouts.hpp"

#include <memory>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

namespace tccomm {
namespace {

constexpr const char* kKeyPrefix = "tccomm/endpoint";

struct EndpointCloser {
  void operator()(tcc_endpoint_t* ep) const {
    tcc_endpoint_close(ep);
  }
};
using EndpointPtr = std::unique_ptr<tcc_endpoint_t, EndpointCloser>;

// Publishes this rank's blob and returns every rank's, in rank order.
std::vector<uint8_t> exchangeBlobs(
    c10d::Store& store,
    int rank,
    int size,
    const std::vector<uint8_t>& blob,
    std::chrono::milliseconds timeout,
    const std::string& name) {
  // A group name (and so the store prefix) comes back after
  // destroy_process_group(); the per-rank generation counter keeps this
  // incarnation's keys apart from any earlier one's. Every rank counts the
  // same creations, so all ranks agree on it.
  const int64_t generation = store.add(c10::str(kKeyPrefix, "/generation/", rank), 1);
  const std::string prefix = c10::str(kKeyPrefix, "/", generation, "/");
  store.set(prefix + std::to_string(rank), blob);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& err) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      try {
        if (!store.check({keys[r]})) {
          missing.push_back(r);
        }
      } catch (const std::exception&) {
        missing.push_back(r);
      }
    }
    if (missing.empty()) {
      throw;
    }
    C10_THROW_ERROR(
        DistStoreError,
        c10::str(
            "tccomm: creating '",
            name,
            "' (rank ",
            rank,
            " of ",
            size,
            "): rank(s) ",
            missing,
            " did not publish their endpoint within ",
            timeout.count(),
            " ms (",
            err.what(),
            ")"));
  }
  std::vector<uint8_t> all;
  all.reserve(static_cast<size_t>(size) * TCC_ENDPOINT_BLOB_SIZE);
  for (const auto& key : keys) {
    const std::vector<uint8_t> value = store.get(key);
    TORCH_CHECK(
        value.size() == TCC_ENDPOINT_BLOB_SIZE,
        "tccomm: creating '",
        name,
        "': the endpoint blob under '",
        key,
        "' has ",
        value.size(),
        " bytes, expected ",
        TCC_ENDPOINT_BLOB_SIZE,
        " (mixed tccomm versions?)");
    all.insert(all.end(), value.begin(), value.end());
  }
  return all;
}

} // namespace

c10::intrusive_ptr<TccBackend> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& name,
    const std::string& advertiseAddr,
    tcc_transport_t transport) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "tccomm: creating '", name, "': rank ", rank, " is out of range [0, ", size, ")");
  // c10d carries timeouts as int64 microseconds: timedelta.max arrives
  // wrapped around to a negative value, which can only mean a huge timeout.
  if (timeout.count() < 0 || timeout > kMaxTimeout) {
    timeout = kMaxTimeout;
  }
  TORCH_CHECK(timeout.count() > 0, "tccomm: creating '", name, "': the timeout must be positive, got ", timeout.count(), " ms");

  tcc_endpoint_t* rawEp = nullptr;
  std::vector<uint8_t> blob(TCC_ENDPOINT_BLOB_SIZE);
  tcc_result_t r = tcc_endpoint_open(advertiseAddr.c_str(), &rawEp, blob.data());
  if (r != TCC_OK) {
    throwCoreError(r, CallKind::Network, c10::str("tccomm: creating '", name, "': opening an endpoint on ", advertiseAddr));
  }
  EndpointPtr ep(rawEp);
  const std::vector<uint8_t> blobs = exchangeBlobs(*store, rank, size, blob, timeout, name);

  tcc_comm_config_t cfg{};
  cfg.rank = rank;
  cfg.size = size;
  cfg.timeout_ms = timeout.count();
  cfg.name = name.c_str();
  cfg.transport = transport;
  tcc_comm_t* comm = nullptr;
  // Consumes the endpoint whatever the result.
  r = tcc_comm_create(&cfg, ep.release(), blobs.data(), &comm);
  if (r != TCC_OK) {
    throwCoreError(
        r, CallKind::Setup, c10::str("tccomm: creating communicator '", name, "' (rank ", rank, " of ", size, ") failed"));
  }
  return c10::make_intrusive<TccBackend>(comm, rank, size, timeout, name, advertiseAddr, transport);
}

} // namespace tccomm
