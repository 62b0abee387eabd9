// rendezvous.hpp - creating a tccomm group's backend over a c10d Store.
//
// Every rank opens an endpoint, publishes its blob in the store, reads every
// other rank's, and hands them all to the core, which connects the ranks.
// Used for a new process group (torch.ops.tccomm.create, from the Python
// creator) and for Backend::split.
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend.hpp"

namespace tccomm {

// Blocks until every rank has published its endpoint (or `timeout` passes,
// naming the ranks that did not). `advertiseAddr` is the IPv4 address peers
// use to reach this process; `transport` is the core's choice (AUTO: shared
// memory when every rank is on this host, unless TCCOMM_TRANSPORT says otherwise).
c10::intrusive_ptr<TccBackend> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& name,
    const std::string& advertiseAddr,
    tcc_transport_t transport);

} // namespace tccomm
