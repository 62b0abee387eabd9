// functional.cpp - tccomm's kernels for torch.ops._c10d_functional.
//
// torch implements the functional collectives (what funcol and torch.compile
// emit) once for every backend, as CompositeExplicitAutograd kernels that go
// through ProcessGroup's generic dispatch: ProcessGroup::allreduce -> the
// c10d::allreduce_ op -> its CPU (or CUDA) kernel -> Backend::allreduce. We
// register kernels for the CPU key, and in a build with CUDA for the CUDA
// key, which the dispatcher prefers to composite ones:
//   * when the group's backend for that key's device type is a TccBackend
//     they call it directly and register the work, so torch's wait_tensor
//     (not replaced) waits on it;
//   * on any other group (gloo, nccl, a fake group, a group whose tccomm
//     serves only the other device type, ...) they hand the untouched
//     argument stack to torch's own kernel for that key, captured before
//     ours took its place, so those groups behave exactly as without tccomm.
// One implementation serves every key: the kernels and what they displaced
// are templates over the device type (DeviceKeys below gives its backend
// key); the registration blocks at the end name the keys.
// The kernels are boxed: the group argument is `Any` (a group name or a
// ProcessGroup object) and both forms are read from the IValue.
//
// CUDA ops keep torch's stream semantics: the TccBackend enqueues them after
// the work already on the caller's current stream, and torch's wait_tensor
// calls Work::wait(), which for a TccWork of CUDA ops makes the waiting
// thread's current stream wait for them without blocking the host
// (work.cpp), as ProcessGroupNCCL's works do.
//
// torch (2.14) also gives these ops Python autograd functions (registered
// when funcol is imported), which every call enters even when no gradient is
// needed. Our AutogradCPU (AutogradCUDA) kernels skip that detour for tccomm
// groups (and for wait_tensor) when no input requires grad, and hand every
// other call to whatever torch has registered for autograd.
//
// TCCOMM_FUNCOL_FASTPATH=0 in the environment when the extension is loaded
// skips the registration: every group then takes torch's kernels.
// torch.ops.tccomm.functional_fast_path_calls() counts the ops served here.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "backend.hpp"
#include "tensor_bufs.hpp"

namespace tccomm {
namespace {

// Per op: where the group argument sits among the op's arguments (the same
// for every dispatch key).
struct OpInfo {
  size_t numArgs = 0;
  size_t groupArg = 0;
};

// Whether the group has a backend for `device` (getBackend throws if not).
bool hasBackendFor(c10d::ProcessGroup& pg, c10::DeviceType device) {
#ifdef TCCOMM_HAS_BACKEND_FOR_DEVICE_TYPE
  return pg.hasBackendForDeviceType(device);
#else
  for (const auto& d : pg.getDeviceTypes()) {
    if (d.type() == device) {
      return true;
    }
  }
  return false;
#endif
}

// The group's TccBackend for `device`, or null when the group's backend for
// that device type is another one. Keeps the backend alive while an op uses it.
c10::intrusive_ptr<c10d::Backend> tccBackendOf(const c10::IValue& group, c10::DeviceType device) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  if (group.isString()) {
    pg = c10d::resolve_process_group(group.toStringRef());
  } else if (group.isCapsule()) {
    // A ProcessGroup passed from Python reaches an `Any` argument as a
    // capsule (torch's kernels read it the same way).
    pg = c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(group.toCapsule());
  } else if (group.isCustomClass()) {
    pg = group.toCustomClass<c10d::ProcessGroup>();
  }
  if (!pg || !hasBackendFor(*pg, device)) {
    return {};
  }
  auto backend = pg->getBackend(device);
  if (dynamic_cast<TccBackend*>(backend.get()) == nullptr) {
    return {};
  }
  return backend;
}

// torch's functional collectives name reductions in lower case strings.
c10d::ReduceOp reduceOpOf(const char* op, const std::string& name) {
  static const std::pair<const char*, c10d::ReduceOp::RedOpType> kOps[] = {
      {"sum", c10d::ReduceOp::SUM},
      {"avg", c10d::ReduceOp::AVG},
      {"product", c10d::ReduceOp::PRODUCT},
      {"min", c10d::ReduceOp::MIN},
      {"max", c10d::ReduceOp::MAX},
      {"band", c10d::ReduceOp::BAND},
      {"bor", c10d::ReduceOp::BOR},
      {"bxor", c10d::ReduceOp::BXOR},
  };
  for (const auto& [text, type] : kOps) {
    if (name == text) {
      return c10d::ReduceOp(type);
    }
  }
  TCC_CHECK(false, op, "unknown reduce op '", name, "'");
}

void checkGroupSize(const char* op, int64_t groupSize, const c10d::Backend& backend) {
  TCC_CHECK(
      groupSize == backend.getSize(),
      op,
      "group_size ",
      groupSize,
      " does not match the group's size ",
      backend.getSize());
}

// A new contiguous tensor of `sizes` with like's dtype and device, for an
// op's output. CPU memory comes straight from the allocator, without a
// round trip through the dispatcher (about 0.1 us of a small op's 4).
at::Tensor newOutput(at::IntArrayRef sizes, const at::Tensor& like) {
  if (like.is_cpu()) {
    return at::Tensor(at::detail::empty_cpu(sizes, like.scalar_type(), false, at::MemoryFormat::Contiguous));
  }
  return at::empty(sizes, like.options().memory_format(at::MemoryFormat::Contiguous));
}

// The output of an all-gather: the input's shape with dim 0 x groupSize.
at::Tensor allGatherOutput(const char* op, const at::Tensor& input, int64_t groupSize) {
  TCC_CHECK(input.dim() > 0, op, "the input must have at least one dimension");
  auto sizes = input.sizes().vec();
  sizes[0] *= groupSize;
  return newOutput(sizes, input);
}

// The output of a reduce-scatter: the input's shape with dim 0 / groupSize.
at::Tensor reduceScatterOutput(const char* op, const at::Tensor& input, int64_t groupSize) {
  TCC_CHECK(input.dim() > 0, op, "the input must have at least one dimension");
  TCC_CHECK(
      input.size(0) % groupSize == 0,
      op,
      "dim 0 of the input (",
      input.size(0),
      ") is not divisible by the group size ",
      groupSize);
  auto sizes = input.sizes().vec();
  sizes[0] /= groupSize;
  return newOutput(sizes, input);
}

std::vector<int64_t> intsOf(const c10::IValue& v) {
  if (v.isIntList()) {
    return v.toIntVector();
  }
  std::vector<int64_t> out;
  for (const c10::SymInt& s : v.toSymIntVector()) {
    out.push_back(s.guard_int(__FILE__, __LINE__));
  }
  return out;
}

// One handler per op: runs it on a tccomm group and returns its result.
// `args` are the op's arguments as the schema lists them.
using Args = c10::ArrayRef<c10::IValue>;
using Handler = c10::IValue (*)(const char* op, c10d::Backend& backend, Args args);

// Functional ops leave their outputs in flight: wait_tensor waits on them.
void registerWork(const std::vector<at::Tensor>& outputs, const c10::intrusive_ptr<c10d::Work>& work) {
  for (const auto& t : outputs) {
    c10d::register_work(t, work);
  }
}

// all_reduce reduces out of place into a new tensor: the core reads the
// input where it is (a copy first would cost more than a small op).
template <bool kInplace>
c10::IValue allReduce(const char* op, c10d::Backend& backend, Args args) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduceOpOf(op, args[1].toStringRef());
  at::Tensor t = args[0].toTensor();
  if (kInplace) {
    std::vector<at::Tensor> tensors{t};
    c10d::register_work(t, backend.allreduce(tensors, opts));
    return args[0];
  }
  at::Tensor out = newOutput(t.sizes(), t);
  c10d::register_work(out, static_cast<TccBackend&>(backend).allreduceInto(t, out, opts));
  return out;
}

template <bool kInplace>
c10::IValue allReduceCoalesced(const char* op, c10d::Backend& backend, Args args) {
  c10d::AllreduceCoalescedOptions opts;
  opts.reduceOp = reduceOpOf(op, args[1].toStringRef());
  std::vector<at::Tensor> tensors = args[0].toTensorVector();
  if (!kInplace) {
    for (auto& t : tensors) {
      t = t.clone(at::MemoryFormat::Contiguous);
    }
  }
  registerWork(tensors, backend.allreduce_coalesced(tensors, opts));
  return kInplace ? args[0] : c10::IValue(std::move(tensors));
}

// all_gather_into_tensor(input, group_size, group) and its _out form.
template <bool kOut>
c10::IValue allGather(const char* op, c10d::Backend& backend, Args args) {
  const int64_t groupSize = args[1].toInt();
  checkGroupSize(op, groupSize, backend);
  at::Tensor input = args[0].toTensor();
  at::Tensor output = kOut ? args[3].toTensor() : allGatherOutput(op, input, groupSize);
  c10d::register_work(output, backend._allgather_base(output, input));
  return output;
}

c10::IValue allGatherCoalesced(const char* op, c10d::Backend& backend, Args args) {
  const int64_t groupSize = args[1].toInt();
  checkGroupSize(op, groupSize, backend);
  std::vector<at::Tensor> inputs = args[0].toTensorVector();
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (const auto& t : inputs) {
    outputs.push_back(allGatherOutput(op, t, groupSize));
  }
  registerWork(outputs, backend.allgather_into_tensor_coalesced(outputs, inputs));
  return outputs;
}

// reduce_scatter_tensor(input, reduce_op, group_size, group) and its _out form.
template <bool kOut>
c10::IValue reduceScatter(const char* op, c10d::Backend& backend, Args args) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = reduceOpOf(op, args[1].toStringRef());
  const int64_t groupSize = args[2].toInt();
  checkGroupSize(op, groupSize, backend);
  at::Tensor input = args[0].toTensor();
  at::Tensor output = kOut ? args[4].toTensor() : reduceScatterOutput(op, input, groupSize);
  c10d::register_work(output, backend._reduce_scatter_base(output, input, opts));
  return output;
}

c10::IValue reduceScatterCoalesced(const char* op, c10d::Backend& backend, Args args) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = reduceOpOf(op, args[1].toStringRef());
  const int64_t groupSize = args[2].toInt();
  checkGroupSize(op, groupSize, backend);
  std::vector<at::Tensor> inputs = args[0].toTensorVector();
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (const auto& t : inputs) {
    outputs.push_back(reduceScatterOutput(op, t, groupSize));
  }
  registerWork(outputs, backend.reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  return outputs;
}

// all_to_all_single(input, output_split_sizes, input_split_sizes, group):
// the output has sum(output_split_sizes) rows, as in torch's kernel.
c10::IValue allToAllSingle(const char* op, c10d::Backend& backend, Args args) {
  at::Tensor input = args[0].toTensor();
  std::vector<int64_t> outputSplits = intsOf(args[1]);
  std::vector<int64_t> inputSplits = intsOf(args[2]);
  TCC_CHECK(input.dim() > 0, op, "the input must have at least one dimension");
  auto sizes = input.sizes().vec();
  sizes[0] = 0;
  for (int64_t s : outputSplits) {
    sizes[0] += s;
  }
  at::Tensor output = newOutput(sizes, input);
  c10d::register_work(output, backend.alltoall_base(output, input, outputSplits, inputSplits));
  return output;
}

template <bool kInplace>
c10::IValue broadcast(const char*, c10d::Backend& backend, Args args) {
  c10d::BroadcastOptions opts;
  opts.rootRank = args[1].toInt();
  at::Tensor t = args[0].toTensor();
  if (!kInplace) {
    t = t.clone(at::MemoryFormat::Contiguous);
  }
  std::vector<at::Tensor> tensors{t};
  c10d::register_work(t, backend.broadcast(tensors, opts));
  return kInplace ? args[0] : c10::IValue(std::move(t));
}

struct FuncOp {
  const char* name;
  Handler handler;
};

// wait_tensor is not among them: torch's own finds our work in its registry.
constexpr FuncOp kOps[] = {
    {"all_reduce", allReduce<false>},
    {"all_reduce_", allReduce<true>},
    {"all_reduce_coalesced", allReduceCoalesced<false>},
    {"all_reduce_coalesced_", allReduceCoalesced<true>},
    {"all_gather_into_tensor", allGather<false>},
    {"all_gather_into_tensor_out", allGather<true>},
    {"all_gather_into_tensor_coalesced", allGatherCoalesced},
    {"reduce_scatter_tensor", reduceScatter<false>},
    {"reduce_scatter_tensor_out", reduceScatter<true>},
    {"reduce_scatter_tensor_coalesced", reduceScatterCoalesced},
    {"all_to_all_single", allToAllSingle},
    {"broadcast", broadcast<false>},
    {"broadcast_", broadcast<true>},
};
constexpr size_t kNumOps = sizeof(kOps) / sizeof(kOps[0]);

OpInfo opInfo[kNumOps];

// The backend dispatch key of a device type's dense tensors: where our
// kernels for that device type go (its autograd kernels go to the matching
// Autograd<key>, named by the registration blocks at the end).
template <c10::DeviceType kDevice>
struct DeviceKeys;

template <>
struct DeviceKeys<c10::DeviceType::CPU> {
  static constexpr c10::DispatchKey kBackend = c10::DispatchKey::CPU;
};

template <>
struct DeviceKeys<c10::DeviceType::CUDA> {
  static constexpr c10::DispatchKey kBackend = c10::DispatchKey::CUDA;
};

// Per op: a copy of torch's kernel for kDevice's backend key that our
// registration displaced; it stays callable (its validity token dies only
// with the operator, at exit).
template <c10::DeviceType kDevice>
std::optional<c10::SafeKernelFunction> torchKernel[kNumOps];

// Ops served by this path since the process started, on every device type:
// lets tests check that tccomm groups take it and that other groups do not.
std::atomic<int64_t> fastPathCalls{0};

template <c10::DeviceType kDevice, size_t kIndex>
void kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const OpInfo& info = opInfo[kIndex];
  auto backend = tccBackendOf(torch::jit::peek(*stack, info.groupArg, info.numArgs), kDevice);
  if (!backend) {
    torchKernel<kDevice>[kIndex]->callBoxed(handle, keys, stack);
    return;
  }
  fastPathCalls.fetch_add(1, std::memory_order_relaxed);
  const auto scope = static_cast<const TccBackend&>(*backend).errorScope();
  c10::IValue result = kOps[kIndex].handler(kOps[kIndex].name, *backend, torch::jit::last(*stack, info.numArgs));
  torch::jit::drop(*stack, info.numArgs);
  torch::jit::push(*stack, std::move(result));
}

// True when autograd has something to record for this call: grad mode is
// on and a tensor argument requires grad.
bool needsGrad(c10::ArrayRef<c10::IValue> args) {
  if (!c10::GradMode::is_enabled()) {
    return false;
  }
  for (const auto& a : args) {
    if (a.isTensor() && a.toTensor().requires_grad()) {
      return true;
    }
    if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorVector()) {
        if (t.requires_grad()) {
          return true;
        }
      }
    }
  }
  return false;
}

// Whatever torch has for autograd on this op now: the Autograd alias key
// fills every autograd runtime key alike, and we replace only AutogradCPU
// (and AutogradCUDA), so AutogradOther still holds it (the Python autograd
// functions that importing funcol registers, or the autograd fallback).
void callTorchAutograd(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  handle.getComputedKernelForDispatchKey(c10::DispatchKey::AutogradOther).callBoxed(handle, keys, stack);
}

// Without a gradient to track, torch's autograd kernels for these ops only
// redispatch below autograd; from Python that detour costs more than the
// collective itself on small tensors. On a tccomm group (or for wait_tensor,
// which has no group) we do the same redispatch in C++.
void belowAutograd(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowAutograd guard;
  handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

template <c10::DeviceType kDevice, size_t kIndex>
void autogradKernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const OpInfo& info = opInfo[kIndex];
  auto args = torch::jit::last(*stack, info.numArgs);
  if (!needsGrad(args) && tccBackendOf(args[info.groupArg], kDevice)) {
    belowAutograd(handle, keys, stack);
  } else {
    callTorchAutograd(handle, keys, stack);
  }
}

void waitTensorAutogradKernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (!needsGrad(torch::jit::last(*stack, 1))) {
    belowAutograd(handle, keys, stack);
  } else {
    callTorchAutograd(handle, keys, stack);
  }
}

bool fastPathEnabled() {
  const char* v = std::getenv("TCCOMM_FUNCOL_FASTPATH");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

} // namespace
} // namespace tccomm

namespace tccomm {
namespace {

// Records where op kIndex takes its group (the same for every key).
template <size_t kIndex>
c10::OperatorHandle describe() {
  const char* name = kOps[kIndex].name;
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((std::string("_c10d_functional::") + name).c_str(), "");
  const auto& schema = handle.schema();
  OpInfo& info = opInfo[kIndex];
  info.numArgs = schema.arguments().size();
  const auto groupArg = schema.argumentIndexWithName("group_name");
  TORCH_INTERNAL_ASSERT(groupArg.has_value(), "tccomm: _c10d_functional::", name, " has no group_name argument");
  info.groupArg = *groupArg;
  return handle;
}

// Captures torch's kernel of op kIndex for kDevice's backend key, then
// installs ours in its place (m is the library block of that key).
template <c10::DeviceType kDevice, size_t kIndex>
void install(torch::Library& m) {
  const auto handle = describe<kIndex>();
  torchKernel<kDevice>[kIndex].emplace(handle.getComputedKernelForDispatchKey(DeviceKeys<kDevice>::kBackend));
  m.impl(kOps[kIndex].name, torch::CppFunction::makeFromBoxedFunction<&kernel<kDevice, kIndex>>());
}

template <c10::DeviceType kDevice, size_t... kIndices>
void installAll(torch::Library& m, std::index_sequence<kIndices...>) {
  (install<kDevice, kIndices>(m), ...);
}

// The autograd kernels need what install() recorded: their registration
// block comes after the backend key's (static initializers of one file run
// in order).
template <c10::DeviceType kDevice, size_t... kIndices>
void installAutogradAll(torch::Library& m, std::index_sequence<kIndices...>) {
  TORCH_INTERNAL_ASSERT(
      (torchKernel<kDevice>[kIndices].has_value() && ...), "tccomm: functional ops not installed yet for ", kDevice);
  (m.impl(kOps[kIndices].name, torch::CppFunction::makeFromBoxedFunction<&autogradKernel<kDevice, kIndices>>()), ...);
  m.impl("wait_tensor", torch::CppFunction::makeFromBoxedFunction<&waitTensorAutogradKernel>());
}

// The registration blocks of kDevice's backend key and autograd key.
template <c10::DeviceType kDevice>
void registerBackendKey(torch::Library& m) {
  if (fastPathEnabled()) {
    installAll<kDevice>(m, std::make_index_sequence<kNumOps>());
  }
}

template <c10::DeviceType kDevice>
void registerAutogradKey(torch::Library& m) {
  if (fastPathEnabled()) {
    installAutogradAll<kDevice>(m, std::make_index_sequence<kNumOps>());
  }
}

} // namespace
} // namespace tccomm

TORCH_LIBRARY_FRAGMENT(tccomm, m) {
  m.def("functional_fast_path_calls() -> int", [] { return tccomm::fastPathCalls.load(); });
}

// One pair of blocks per device type served: each block names its key (the
// macro needs it spelled out), the templates do the rest.
TORCH_LIBRARY_IMPL(_c10d_functional, CPU, m) {
  tccomm::registerBackendKey<c10::DeviceType::CPU>(m);
}

TORCH_LIBRARY_IMPL(_c10d_functional, AutogradCPU, m) {
  tccomm::registerAutogradKey<c10::DeviceType::CPU>(m);
}

// Only a build with the CUDA path: without it a tccomm group refuses CUDA
// tensors, and every group keeps torch's CUDA kernels.
#ifdef TCCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(_c10d_functional, CUDA, m) {
  tccomm::registerBackendKey<c10::DeviceType::CUDA>(m);
}

TORCH_LIBRARY_IMPL(_c10d_functional, AutogradCUDA, m) {
  tccomm::registerAutogradKey<c10::DeviceType::CUDA>(m);
}
#endif
