// torch_compat.hpp - what the torch the shim is compiled against offers.
//
// The shim builds against torch 2.11 and newer. Each macro names one piece of
// torch's C++ API that appeared after 2.11, so the code that uses it says why
// it is conditional; everything else is common to every supported version.
#pragma once

#include <torch/headeronly/version.h>

#define TCCOMM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// 2.12: OpType::REDUCE_SCATTER_TENSOR_COALESCED (before it, such work is
// OpType::COALESCED, as nccl's is), and ParamCommsDebugInfo's sequence number
// and isAsynchronizedOp fields (the profiler's record_param_comms).
#if TCCOMM_TORCH_AT_LEAST(2, 12)
#define TCCOMM_HAS_REDUCE_SCATTER_COALESCED_OPTYPE 1
#define TCCOMM_HAS_PARAM_COMMS_SEQUENCE 1
#endif

// 2.13: ProcessGroup::hasBackendForDeviceType (before it, the group's
// getDeviceTypes() answers the same question).
#if TCCOMM_TORCH_AT_LEAST(2, 13)
#define TCCOMM_HAS_BACKEND_FOR_DEVICE_TYPE 1
#endif

// 2.14: Backend::gather_into_tensor (dist.gather_single),
// OpType::ALLGATHER_INTO_TENSOR_COALESCED, and a virtual
// Backend::setBoundDeviceId: init_process_group(device_id=...) reaches the
// backend through it (eager NCCL init).
#if TCCOMM_TORCH_AT_LEAST(2, 14)
#define TCCOMM_HAS_GATHER_INTO_TENSOR 1
#define TCCOMM_HAS_ALLGATHER_COALESCED_OPTYPE 1
#define TCCOMM_HAS_BOUND_DEVICE 1
#endif
