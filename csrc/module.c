/*
 * module.c - the CPython face of torchcomm_backend._C.
 *
 * The module itself is empty. Importing it loads the shared object, and
 * loading runs the C++ static registrations (TORCH_LIBRARY(tccomm, ...)),
 * which is all Python needs: everything else is reached through
 * torch.ops.tccomm.* and torch.distributed. Import torch first, so that
 * c10 / torch_cpu (and the c10d TorchBind classes) are already loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef tccomm_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_C",
    .m_doc = "tccomm native extension: loading it registers torch.ops.tccomm.*",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&tccomm_module); }
