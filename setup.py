"""Builds torchcomm_backend._C: the C core, the C++ shim and the module stub.

Install into an environment that already has torch:

    pip install --no-build-isolation -e .

One extension, two languages:
  * C (csrc/module.c and every csrc/c_core/src/*.c) is compiled as C11 with the
    plain C compiler, before anything else, in BuildExt.build_extensions.
    torch's BuildExtension would route every source of an Extension through
    the C++ compiler with C++ flags, so the C objects reach the link as
    extra_objects instead of sources.
  * C++ (csrc/*.cpp) goes through torch's BuildExtension, which picks the C++
    standard torch's headers need (C++20 from torch 2.13 on; 2.14's headers
    refuse anything older).
The result links against c10 and torch_cpu only (no torch_python, no
binding library) with an rpath to torch/lib.
"""

import glob
import os

import torch
from setuptools import setup
from setuptools.extension import Extension
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(*parts):
    return os.path.relpath(os.path.join(ROOT, *parts), ROOT)


def absolute(*parts):
    # Include dirs must be absolute: ninja compiles from the build directory.
    return os.path.join(ROOT, *parts)


def sorted_glob(pattern):
    return sorted(rel(p) for p in glob.glob(os.path.join(ROOT, pattern)))


CORE_INCLUDE = [absolute("csrc", "c_core", "include"), absolute("csrc", "c_core", "src")]
# The core's file list changes as it grows: take whatever is there.
C_SOURCES = [rel("csrc", "module.c")] + sorted_glob("csrc/c_core/src/*.c")
C_HEADERS = sorted_glob("csrc/c_core/include/*.h") + sorted_glob("csrc/c_core/src/*.h")
C_FLAGS = ["-std=c11", "-ffp-contract=off", "-D_GNU_SOURCE", "-O3", "-pthread", "-Wall", "-Wextra"]

CXX_SOURCES = sorted_glob("csrc/*.cpp")
CXX_HEADERS = sorted_glob("csrc/*.hpp")
# torch's headers come in as system headers so -Wall -Wextra covers our files only.
TORCH_SYSTEM_INCLUDES = [
    flag for d in cpp_extension.include_paths() for flag in ("-isystem", d)
]
CXX_FLAGS = ["-O3", "-Wall", "-Wextra"] + TORCH_SYSTEM_INCLUDES

TORCH_LIB = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
LINK_FLAGS = [
    "-pthread",
    # Installed next to torch in site-packages, and wherever the build's torch lives.
    "-Wl,-rpath,$ORIGIN/../torch/lib",
    "-Wl,-rpath," + TORCH_LIB,
]
# The core needs libm, and libdl / librt on older glibc (NCCL is dlopen()ed).
LIBRARIES = ["c10", "torch_cpu", "m", "dl", "rt"]

# CUDA is not built yet. When it is, this is the one place to extend: if
# torch.version.cuda is set, add the CUDA define to C_FLAGS and CXX_FLAGS,
# cpp_extension.include_paths("cuda") to the includes and c10_cuda /
# torch_cuda (and cudart) to LIBRARIES.


class BuildExt(cpp_extension.BuildExtension):
    def build_extensions(self):
        c_objects = self._compile_c_sources()
        for ext in self.extensions:
            ext.extra_objects = c_objects + list(ext.extra_objects or [])
        super().build_extensions()

    def _compile_c_sources(self):
        # self.compiler is still the plain C compiler, configured like Python's
        # own (-fPIC, Python's include dir); BuildExtension wraps it only in super().
        return self.compiler.compile(
            C_SOURCES,
            output_dir=os.path.join(self.build_temp, "c"),
            include_dirs=CORE_INCLUDE,
            extra_postargs=C_FLAGS,
            depends=C_HEADERS,
        )


ext = Extension(
    name="torchcomm_backend._C",
    sources=CXX_SOURCES,
    include_dirs=[absolute("csrc", "c_core", "include")],
    library_dirs=[TORCH_LIB],
    libraries=LIBRARIES,
    extra_compile_args={"cxx": CXX_FLAGS},
    extra_link_args=LINK_FLAGS,
    language="c++",
    # A change to any C source or header relinks the extension.
    depends=C_SOURCES + C_HEADERS + CXX_HEADERS,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
