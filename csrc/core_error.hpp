// core_error.hpp - the one way the shim turns a failed call of the C core
// into a Python exception.
#pragma once

#include <string>

#include "tccomm.h"

namespace tccomm {

// What the caller was doing when the core refused, for the exception's type.
enum class CallKind {
  Op,       // a collective, point-to-point or window op
  Setup,    // creating a communicator or a window
  Network,  // opening the endpoint other ranks connect to
};

// The core's message for this thread's last failed call (it names the op,
// the group, the rank, the peer when there is one, and the cause), or the
// result's name when the core gave none.
std::string coreErrorMessage(tcc_result_t r);

// Raises the failure of a core call that returned r, its message after
// `context` when one is given. Bad input (TCC_ERR_INVALID,
// TCC_ERR_UNSUPPORTED) of an op raises c10::Error, as torch does for bad
// arguments; a network setup failure DistNetworkError; every other failure
// DistBackendError.
[[noreturn]] void throwCoreError(tcc_result_t r, CallKind call, const std::string& context = "");

} // namespace tccomm
