// core_error.cpp - see core_error.hpp.
#include "core_error.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

namespace tccomm {

std::string coreErrorMessage(tcc_result_t r) {
  const char* msg = tcc_last_error();
  return msg[0] != '\0' ? std::string(msg) : std::string("tccomm: ") + tcc_result_string(r);
}

void throwCoreError(tcc_result_t r, CallKind call, const std::string& context) {
  const std::string msg = context.empty() ? coreErrorMessage(r) : context + ": " + coreErrorMessage(r);
  if (call == CallKind::Network) {
    C10_THROW_ERROR(DistNetworkError, msg);
  }
  if (call == CallKind::Op && (r == TCC_ERR_INVALID || r == TCC_ERR_UNSUPPORTED)) {
    TORCH_CHECK(false, msg); // bad input: nothing was sent
  }
  C10_THROW_ERROR(DistBackendError, msg);
}

} // namespace tccomm
