// direct_ops.cpp - the TorchComm API's synchronous collectives, send and
// recv, called from Python through the CPython C API
// (torchcomm_backend._C.direct_*).
//
// A synchronous TorchComm op used to go through torch's binding of Backend
// and Work: the binding's dispatcher converted the arguments, the backend
// returned a Work that became a Python object, and a second binding call
// waited on it. Counted with callgrind, that was about 16,000 of the 19,000
// instructions of an 8-byte all_reduce at one rank, the shim and the core
// about 3,000 (bench/README, "Instructions per call"). These functions call
// the same TccBackend methods and wait on their Work in C++, without the
// GIL, so what the shim does for an op (checks, sequence numbers, flight
// recorder, profiler, timeouts) is the same on both paths.
//
// Python reaches a group's backend by a handle, a small integer from
// torch.ops.tccomm.direct_handle(pg) (the one registry below); a handle
// whose backend is gone, or any other integer, is refused.
//
// Every function takes the handle first, then the op's tensors and
// integers, and returns None when the op completed. An error raised while
// the op is issued (a bad argument, a communicator that cannot be used) is
// raised, as the binding raised it; an op that was issued and then failed
// or timed out is returned as an exception object instead, so the caller's
// error policy can tell the two apart without parsing a message.
//
// Tensors are read with torch's inline THPVariable_Unpack after a type
// check against torch._C.TensorBase: nothing here links torch's Python
// library.
#include <Python.h>

#include <atomic>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "backend.hpp"

namespace tccomm {
namespace {

std::mutex directMutex;
// handle h is directBackends[h - 1]; never reused.
std::vector<c10::weak_intrusive_ptr<TccBackend>> directBackends;
std::atomic<int64_t> directCalls{0};

int64_t directHandle(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  auto backend = c10::dynamic_intrusive_pointer_cast<TccBackend>(pg->getBackend(c10::DeviceType::CPU));
  TORCH_CHECK_TYPE(backend, "tccomm: direct_handle: the group's CPU backend is not a tccomm backend");
  std::lock_guard<std::mutex> lock(directMutex);
  directBackends.emplace_back(backend);
  return static_cast<int64_t>(directBackends.size());
}

c10::intrusive_ptr<TccBackend> backendOf(PyObject* handle) {
  const long long h = PyLong_AsLongLong(handle);
  if (h == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    C10_THROW_ERROR(TypeError, "tccomm: the communicator handle must be an int");
  }
  std::lock_guard<std::mutex> lock(directMutex);
  TORCH_CHECK_VALUE(
      h >= 1 && static_cast<size_t>(h) <= directBackends.size(), "tccomm: ", h, " is not a communicator handle");
  auto backend = directBackends[static_cast<size_t>(h - 1)].lock();
  TORCH_CHECK_VALUE(backend, "tccomm: communicator handle ", h, ": its process group is gone");
  return backend;
}

PyTypeObject* tensorType() {
  // Resolved once, under the GIL; a failed lookup raises and is tried again.
  static PyTypeObject* type = nullptr;
  if (type == nullptr) {
    PyObject* torchC = PyImport_ImportModule("torch._C");
    PyObject* base = torchC ? PyObject_GetAttrString(torchC, "TensorBase") : nullptr;
    Py_XDECREF(torchC);
    if (base == nullptr || !PyType_Check(base)) {
      Py_XDECREF(base);
      PyErr_Clear();
      C10_THROW_ERROR(TypeError, "tccomm: torch._C.TensorBase is not a type in this torch");
    }
    type = reinterpret_cast<PyTypeObject*>(base); // kept for the life of the process
  }
  return type;
}

at::Tensor tensorArg(PyObject* obj, const char* op, const char* what) {
  if (!PyObject_TypeCheck(obj, tensorType())) {
    C10_THROW_ERROR(TypeError, c10::str("tccomm: ", op, ": ", what, " must be a tensor, got ", Py_TYPE(obj)->tp_name));
  }
  return THPVariable_Unpack(obj);
}

int64_t intArg(PyObject* obj, const char* op, const char* what) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    C10_THROW_ERROR(TypeError, c10::str("tccomm: ", op, ": ", what, " must be an int, got ", Py_TYPE(obj)->tp_name));
  }
  return v;
}

// A peer's rank: an int of C's range (the backend checks it against the group).
int peerArg(PyObject* obj, const char* op, const char* what) {
  const int64_t v = intArg(obj, op, what);
  TORCH_CHECK_VALUE(
      v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), "tccomm: ", op, ": ", what, " ",
      v, " is not a rank");
  return static_cast<int>(v);
}

c10d::ReduceOp reduceOpArg(PyObject* obj, const char* op) {
  const int64_t code = intArg(obj, op, "the reduce op");
  // PREMUL_SUM carries its factor in a supplement: not through here.
  TORCH_CHECK_VALUE(
      code >= c10d::ReduceOp::SUM && code <= c10d::ReduceOp::BXOR, "tccomm: ", op, ": reduce op code ", code,
      " is not one of SUM..BXOR");
  return c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(code));
}

// The GIL is let go while the op is issued and waited for, as torch's
// binding does; the tensors' last C++ references go while it is held.
class WithoutGil {
 public:
  WithoutGil() : state_(PyEval_SaveThread()) {}
  ~WithoutGil() {
    PyEval_RestoreThread(state_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

// The Python class and message of a C++ exception, as torch's binding
// translates them.
PyObject* distClass(const char* name) {
  PyObject* module = PyImport_ImportModule("torch.distributed");
  PyObject* cls = module ? PyObject_GetAttrString(module, name) : nullptr;
  Py_XDECREF(module);
  if (cls == nullptr) {
    PyErr_Clear();
    Py_INCREF(PyExc_RuntimeError);
    return PyExc_RuntimeError;
  }
  return cls;
}

std::pair<PyObject*, std::string> translate(const std::exception_ptr& failure) {
  auto borrowed = [](PyObject* cls) {
    Py_INCREF(cls);
    return cls;
  };
  try {
    std::rethrow_exception(failure);
  } catch (const c10::DistBackendError& e) {
    return {distClass("DistBackendError"), e.what_without_backtrace()};
  } catch (const c10::DistNetworkError& e) {
    return {distClass("DistNetworkError"), e.what_without_backtrace()};
  } catch (const c10::DistStoreError& e) {
    return {distClass("DistStoreError"), e.what_without_backtrace()};
  } catch (const c10::DistError& e) {
    return {distClass("DistError"), e.what_without_backtrace()};
  } catch (const c10::ValueError& e) {
    return {borrowed(PyExc_ValueError), e.what_without_backtrace()};
  } catch (const c10::TypeError& e) {
    return {borrowed(PyExc_TypeError), e.what_without_backtrace()};
  } catch (const c10::IndexError& e) {
    return {borrowed(PyExc_IndexError), e.what_without_backtrace()};
  } catch (const c10::NotImplementedError& e) {
    return {borrowed(PyExc_NotImplementedError), e.what_without_backtrace()};
  } catch (const c10::Error& e) {
    return {borrowed(PyExc_RuntimeError), e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {borrowed(PyExc_RuntimeError), e.what()};
  } catch (...) {
    return {borrowed(PyExc_RuntimeError), "tccomm: unknown C++ exception"};
  }
}

PyObject* raise(const std::exception_ptr& failure) {
  auto [cls, msg] = translate(failure);
  PyErr_SetString(cls, msg.c_str());
  Py_DECREF(cls);
  return nullptr;
}

// Runs issue() (which returns the op's Work) and waits for it without the
// GIL: None when it completed, the failure of the wait as an exception
// object, or NULL with the issue's error raised.
template <typename Issue>
PyObject* runSync(const char* op, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, Issue issue) {
  try {
    if (nargs != want) {
      C10_THROW_ERROR(TypeError, c10::str("tccomm: direct ", op, " takes ", want, " arguments, got ", nargs));
    }
    const auto backend = backendOf(args[0]);
    c10::intrusive_ptr<c10d::Work> work; // dropped with the GIL held
    std::exception_ptr waitFailure;
    {
      auto issued = issue(*backend, args); // the tensors it holds outlive the wait
      {
        WithoutGil nogil;
        work = issued();
        try {
          work->wait();
        } catch (...) {
          waitFailure = std::current_exception();
        }
      }
    }
    directCalls.fetch_add(1, std::memory_order_relaxed);
    if (waitFailure) {
      auto [cls, msg] = translate(waitFailure);
      PyObject* exc = PyObject_CallFunction(cls, "s", msg.c_str());
      Py_DECREF(cls);
      return exc;
    }
    Py_RETURN_NONE;
  } catch (...) {
    return raise(std::current_exception());
  }
}

} // namespace
} // namespace tccomm

// ---- the functions of torchcomm_backend._C (listed in module.c) ------------
// Each returns None, an exception object (the op failed once issued) or NULL.

using tccomm::intArg;
using tccomm::peerArg;
using tccomm::reduceOpArg;
using tccomm::runSync;
using tccomm::tensorArg;
using tccomm::TccBackend;

// direct_all_reduce(handle, tensor, reduce_op_code)
extern "C" PyObject* tccomm_direct_all_reduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("all_reduce", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    std::vector<at::Tensor> tensors{tensorArg(a[1], "all_reduce", "the tensor")};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduceOpArg(a[2], "all_reduce");
    return [&b, tensors = std::move(tensors), opts]() mutable { return b.allreduce(tensors, opts); };
  });
}

// direct_reduce(handle, tensor, root, reduce_op_code)
extern "C" PyObject* tccomm_direct_reduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("reduce", args, nargs, 4, [](TccBackend& b, PyObject* const* a) {
    std::vector<at::Tensor> tensors{tensorArg(a[1], "reduce", "the tensor")};
    c10d::ReduceOptions opts;
    opts.rootRank = peerArg(a[2], "reduce", "root");
    opts.reduceOp = reduceOpArg(a[3], "reduce");
    return [&b, tensors = std::move(tensors), opts]() mutable { return b.reduce(tensors, opts); };
  });
}

// direct_broadcast(handle, tensor, root)
extern "C" PyObject* tccomm_direct_broadcast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("broadcast", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    std::vector<at::Tensor> tensors{tensorArg(a[1], "broadcast", "the tensor")};
    c10d::BroadcastOptions opts;
    opts.rootRank = peerArg(a[2], "broadcast", "root");
    return [&b, tensors = std::move(tensors), opts]() mutable { return b.broadcast(tensors, opts); };
  });
}

// direct_all_gather_single(handle, output, input)
extern "C" PyObject* tccomm_direct_all_gather_single(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("all_gather_single", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    at::Tensor out = tensorArg(a[1], "all_gather_single", "the output");
    at::Tensor in = tensorArg(a[2], "all_gather_single", "the input");
    return [&b, out, in]() mutable { return b._allgather_base(out, in, c10d::AllgatherOptions()); };
  });
}

// direct_reduce_scatter_single(handle, output, input, reduce_op_code)
extern "C" PyObject* tccomm_direct_reduce_scatter_single(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("reduce_scatter_single", args, nargs, 4, [](TccBackend& b, PyObject* const* a) {
    at::Tensor out = tensorArg(a[1], "reduce_scatter_single", "the output");
    at::Tensor in = tensorArg(a[2], "reduce_scatter_single", "the input");
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduceOpArg(a[3], "reduce_scatter_single");
    return [&b, out, in, opts]() mutable { return b._reduce_scatter_base(out, in, opts); };
  });
}

// direct_all_to_all_single(handle, output, input): equal splits
extern "C" PyObject* tccomm_direct_all_to_all_single(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("all_to_all_single", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    at::Tensor out = tensorArg(a[1], "all_to_all_single", "the output");
    at::Tensor in = tensorArg(a[2], "all_to_all_single", "the input");
    return [&b, out, in]() mutable {
      std::vector<int64_t> outSplits, inSplits;
      return b.alltoall_base(out, in, outSplits, inSplits, c10d::AllToAllOptions());
    };
  });
}

// direct_send(handle, tensor, dst), tag 0
extern "C" PyObject* tccomm_direct_send(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("send", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    std::vector<at::Tensor> tensors{tensorArg(a[1], "send", "the tensor")};
    const int dst = peerArg(a[2], "send", "dst");
    return [&b, tensors = std::move(tensors), dst]() mutable { return b.send(tensors, dst, 0); };
  });
}

// direct_recv(handle, tensor, src), tag 0
extern "C" PyObject* tccomm_direct_recv(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("recv", args, nargs, 3, [](TccBackend& b, PyObject* const* a) {
    std::vector<at::Tensor> tensors{tensorArg(a[1], "recv", "the tensor")};
    const int src = peerArg(a[2], "recv", "src");
    return [&b, tensors = std::move(tensors), src]() mutable { return b.recv(tensors, src, 0); };
  });
}

// direct_barrier(handle)
extern "C" PyObject* tccomm_direct_barrier(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return runSync("barrier", args, nargs, 1, [](TccBackend& b, PyObject* const*) {
    return [&b]() { return b.barrier(c10d::BarrierOptions()); };
  });
}

TORCH_LIBRARY_FRAGMENT(tccomm, m) {
  m.def("direct_handle(__torch__.torch.classes.c10d.ProcessGroup pg) -> int", &tccomm::directHandle);
  m.def("direct_calls() -> int", [] { return tccomm::directCalls.load(); });
}
