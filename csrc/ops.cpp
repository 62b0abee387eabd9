// ops.cpp - torch.ops.tccomm.*: the bootstrap of a tccomm group.
//
// Python reaches the C++ side only through these TorchScript ops (no binding library).
//   create(carrier, rank, size, timeout_ms, name, advertise_addr, transport="auto",
//          global_ranks=[])
//       creates the group's communicator through the carrier's store
//       (rendezvous.hpp) and installs a TccBackend on `carrier` (a
//       ProcessGroup), from which Python takes it with _get_backend().
//       transport: "auto" (the core decides; TCCOMM_TRANSPORT is honoured),
//       "shm" or "tcp". global_ranks: the members' global ranks (torch's
//       global_ranks_in_group), for the profiler's metadata.
//   build_info()
//       JSON: whether the CUDA path was built, the nccl.h it was built with
//       and the NCCL found at run time.
//   dump_flight_recorder(path="")
//       writes the flight recorder's dump of every group of this process
//       (flight_recorder.hpp) to `path` or to TORCH_FR_DUMP_TEMP_FILE<rank>;
//       returns the file written, "" when the recorder is off.
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "flight_recorder.hpp"
#include "rendezvous.hpp"

namespace tccomm {
namespace {

void create(
    const c10::intrusive_ptr<c10d::ProcessGroup>& carrier,
    int64_t rank,
    int64_t size,
    int64_t timeoutMs,
    std::string name,
    std::string advertiseAddr,
    std::string transport,
    std::vector<int64_t> globalRanks) {
  TORCH_CHECK(carrier->getStore(), "tccomm: create: the carrier process group has no store");
  TORCH_CHECK(
      transport == "auto" || transport == "shm" || transport == "tcp",
      "tccomm: create: transport must be auto, shm or tcp, got '",
      transport,
      "'");
  const tcc_transport_t choice = transport == "shm" ? TCC_TRANSPORT_SHM
      : transport == "tcp"                          ? TCC_TRANSPORT_TCP
                                                    : TCC_TRANSPORT_AUTO;
  auto backend = createBackend(
      carrier->getStore(),
      static_cast<int>(rank),
      static_cast<int>(size),
      std::chrono::milliseconds(timeoutMs),
      name,
      advertiseAddr,
      choice);
  backend->setGlobalRanks(std::vector<uint64_t>(globalRanks.begin(), globalRanks.end()));
  carrier->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
}

std::string dumpRecorder(std::string path) {
  return dumpFlightRecorder(path);
}

std::string buildInfo() {
  int runtime = 0;
  std::string runtimeJson = "null";
  std::string errorJson = "\"\"";
  if (tcc_cuda_built()) {
    if (tcc_nccl_runtime_version(&runtime) == TCC_OK) {
      runtimeJson = std::to_string(runtime);
    } else {
      std::string quoted;
      for (const char* p = tcc_last_error(); *p != '\0'; ++p) {
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
  m.def("dump_flight_recorder(str path=\"\") -> str", &tccomm::dumpRecorder);
  m.def(
      "create(__torch__.torch.classes.c10d.ProcessGroup carrier, int rank, int size, "
      "int timeout_ms, str name, str advertise_addr, str transport=\"auto\", int[] global_ranks=[]) -> ()",
      &tccomm::create);
}
