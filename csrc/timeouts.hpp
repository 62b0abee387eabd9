// timeouts.hpp - the longest timeout the shim passes on.
#pragma once
#include <algorithm>
#include <chrono>

namespace tccomm {

// "Practically no timeout" (as in torchcomm_backend/_create.py): far beyond
// any job, far below where now + timeout in nanoseconds could overflow
// int64, in the core, in the store or in std::chrono::steady_clock.
constexpr std::chrono::milliseconds kMaxTimeout{100LL * 365 * 24 * 3600 * 1000};

inline std::chrono::milliseconds clampTimeout(std::chrono::milliseconds timeout) {
  return std::min(timeout, kMaxTimeout);
}

} // namespace tccomm
