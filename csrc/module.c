/*
 * module.c - the CPython face of torchcomm_backend._C.
 *
 * Importing it loads the shared object, and loading runs the C++ static
 * registrations (TORCH_LIBRARY(tccomm, ...)): most of what Python needs is
 * reached through torch.ops.tccomm.* and torch.distributed. The module's
 * own functions are the TorchComm API's synchronous collectives
 * (direct_ops.cpp), which skip torch's binding. Import torch first, so that
 * c10 / torch_cpu (and the c10d TorchBind classes) are already loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* direct_ops.cpp */
#define DIRECT_OPS(X) \
  X(all_reduce) X(reduce) X(broadcast) X(all_gather_single) X(reduce_scatter_single) X(all_to_all_single) X(barrier) \
      X(send) X(recv)
#define DECLARE(name) PyObject *tccomm_direct_##name(PyObject *, PyObject *const *, Py_ssize_t);
DIRECT_OPS(DECLARE)

#define ENTRY(name) {"direct_" #name, (PyCFunction)(void (*)(void))tccomm_direct_##name, METH_FASTCALL, NULL},
static PyMethodDef tccomm_methods[] = {DIRECT_OPS(ENTRY){NULL, NULL, 0, NULL}};

static struct PyModuleDef tccomm_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_C",
    .m_doc = "tccomm native extension: loading it registers torch.ops.tccomm.*; direct_*: the TorchComm API's synchronous collectives",
    .m_size = -1,
    .m_methods = tccomm_methods,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&tccomm_module); }
