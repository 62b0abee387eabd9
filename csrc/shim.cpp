// The C++ shim as one translation unit: the file the build compiles.
//
// Every file below includes torch's headers (ATen/ATen.h comes with any c10d
// header), and parsing them is most of each file's compile time: about 40 s
// per file on two cores, for a dozen files. Compiled together, they are
// parsed once and the shim builds in the time of about two files. So the
// files share one scope: names private to a file still go in its anonymous
// namespace, and must not repeat another file's.
//
// setup.py refuses to build when a csrc/*.cpp or csrc/cuda/*.cpp is missing
// here.

#include "backend.cpp"
#include "core_error.cpp"
#include "direct_ops.cpp"
#include "flight_recorder.cpp"
#include "functional.cpp"
#include "ops.cpp"
#include "param_comms.cpp"
#include "rendezvous.cpp"
#include "sparse_allreduce.cpp"
#include "tensor_bufs.cpp"
#include "window_ops.cpp"
#include "work.cpp"

#ifdef TCCOMM_WITH_CUDA
#include "cuda/cuda_support.cpp"
#endif
