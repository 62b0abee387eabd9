"""Builds torchcomm_backend._C: the C core, the C++ shim and the module stub.

Install into an environment that already has torch:

    pip install --no-build-isolation -e .

One extension, two languages:
  * The C core (csrc/c_core) is built by its own Makefile (`make lib`), the
    same rules and flags (-Werror included) that build the library its C
    tests, sanitizer runs and benchmarks use, compiled in parallel; the
    extension links that static library. csrc/module.c, the CPython module
    stub, is compiled here with the plain C compiler. torch's BuildExtension
    would route every source of an Extension through the C++ compiler with
    C++ flags, so the C parts reach the link as extra_objects.
  * C++ (csrc/*.cpp) goes through torch's BuildExtension, which picks the C++
    standard torch's headers need (C++20 from torch 2.13 on; 2.14's headers
    refuse anything older).
The result links against c10 and torch_cpu only (no torch_python, no
binding library) with an rpath to torch/lib; with torch's CUDA build also
against c10_cuda, torch_cuda and cudart (see cuda_build_config()). NCCL is not
linked: the core finds the copy torch loaded at run time.

TCCOMM_BUILD_VARIANT picks a test build that is never shipped: the core's
Makefile configuration of that name, and the shim's flags plus those of
VARIANT_FLAGS below. Build it out of tree
(setup.py build_ext --build-lib DIR --build-temp DIR/tmp), as the scripts
that use it do.
"""

import glob
import os
import shutil
import subprocess
import warnings

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
    return sorted(rel(p) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


CORE_DIR = absolute("csrc", "c_core")
CORE_INCLUDE = [absolute("csrc", "c_core", "include")]
# Only for relinking when the core changes; the Makefile picks the sources.
CORE_FILES = sorted_glob("csrc/c_core/include/*.h") + sorted_glob("csrc/c_core/src/**/*.[ch]") + [
    rel("csrc", "c_core", "Makefile")]
MODULE_SOURCES = [rel("csrc", "module.c")]
MODULE_FLAGS = ["-std=c11", "-pthread", "-Wall", "-Wextra", "-Werror"]

CXX_SOURCES = sorted_glob("csrc/*.cpp")
# CUDA-only shim code; left out of CPU-only builds (see cuda_build_config()).
CUDA_CXX_SOURCES = sorted_glob("csrc/cuda/*.cpp")
CXX_HEADERS = sorted_glob("csrc/*.hpp")
# torch's headers come in as system headers so -Wall -Wextra covers our files only.
TORCH_SYSTEM_INCLUDES = [
    flag for d in cpp_extension.include_paths() for flag in ("-isystem", d)
]
CXX_FLAGS = ["-O3", "-Wall", "-Wextra", "-Werror"] + TORCH_SYSTEM_INCLUDES

TORCH_LIB = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
LINK_FLAGS = [
    "-pthread",
    # Installed next to torch in site-packages, and wherever the build's torch lives.
    "-Wl,-rpath,$ORIGIN/../torch/lib",
    "-Wl,-rpath," + TORCH_LIB,
]
# The core needs libm, and libdl / librt on older glibc (NCCL is dlopen()ed).
LIBRARIES = ["c10", "torch_cpu", "m", "dl", "rt"]


def find_nccl_include(cuda_home):
    """The directory of nccl.h: NCCL_INCLUDE_DIR, the nvidia-nccl-cu* wheel
    torch depends on, or the CUDA toolkit."""
    candidates = [os.environ.get("NCCL_INCLUDE_DIR", "")]
    try:
        import nvidia.nccl  # the wheel torch's CUDA build depends on

        candidates += [os.path.join(p, "include") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "include"))
    candidates.append("/usr/include")
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "nccl.h")):
            return d
    return None


def find_cuda_home():
    """The toolkit root holding include/cuda_runtime_api.h. torch's own guess
    (cpp_extension.CUDA_HOME) can be the parent of a bin/ that only holds a
    link to nvcc (e.g. /usr/local), so the link's target is tried too."""
    candidates = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), cpp_extension.CUDA_HOME or ""]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "include", "cuda_runtime_api.h")):
            return d
    return None


def cuda_build_config():
    """Include dirs, library dirs and a reason, for building the CUDA path.

    Built whenever torch has CUDA and the headers are there (no GPU needed);
    otherwise left out with a warning that says why. TCCOMM_NO_CUDA=1 leaves
    it out on purpose."""
    if torch.version.cuda is None:
        return None, "torch is a CPU-only build"
    if os.environ.get("TCCOMM_NO_CUDA", "") not in ("", "0"):
        return None, "TCCOMM_NO_CUDA is set"
    cuda_home = find_cuda_home()
    if cuda_home is None:
        return None, f"no CUDA toolkit headers found (torch's guess: CUDA_HOME={cpp_extension.CUDA_HOME!r})"
    nccl_include = find_nccl_include(cuda_home)
    if nccl_include is None:
        return None, "nccl.h not found (install nvidia-nccl-cu* or set NCCL_INCLUDE_DIR)"
    lib_dirs = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")) if os.path.isdir(d)]
    return {"includes": [nccl_include, os.path.join(cuda_home, "include")], "nccl_include": nccl_include,
            "cuda_include": os.path.join(cuda_home, "include"), "lib_dirs": lib_dirs}, ""


# Test builds (TCCOMM_BUILD_VARIANT): the core's Makefile configuration of
# the same name, and for the shim the shipped flags plus these:
#   mutant  the C core's deliberate bugs, chosen at run time by
#           TCCOMM_MUTATION (csrc/c_core/src/core/mutation.h;
#           scripts/mutation_check.sh);
#   asan    AddressSanitizer + UBSan in the core and the shim, any report
#           fatal (scripts/asan_pytest.sh; needs libasan preloaded).
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]
VARIANT_FLAGS = {  # name: (module.c flags, C++ flags, link flags)
    "": ([], [], []),
    "mutant": ([], [], []),
    "asan": (SANITIZE, SANITIZE, ["-fsanitize=address,undefined"]),
}
VARIANT = os.environ.get("TCCOMM_BUILD_VARIANT", "")
if VARIANT not in VARIANT_FLAGS:
    raise SystemExit(f"tccomm: unknown TCCOMM_BUILD_VARIANT {VARIANT!r} (known: {sorted(VARIANT_FLAGS)[1:]})")
MODULE_FLAGS += VARIANT_FLAGS[VARIANT][0]
CXX_FLAGS += VARIANT_FLAGS[VARIANT][1]
LINK_FLAGS += VARIANT_FLAGS[VARIANT][2]

CUDA, NO_CUDA_REASON = cuda_build_config()
LIBRARY_DIRS = [TORCH_LIB]
# The core's Makefile configuration: the variant, "-cuda" with the NCCL executor.
CORE_CONFIG = (VARIANT or "release") + ("-cuda" if CUDA else "")
if CUDA:
    CXX_FLAGS += ["-DTCCOMM_WITH_CUDA"] + [f for d in CUDA["includes"] for f in ("-isystem", d)]
    CXX_SOURCES += CUDA_CXX_SOURCES
    # cudart by soname (libcudart.so.N): at run time it is the copy torch loaded.
    LIBRARIES += ["c10_cuda", "torch_cuda", "cudart"]
    LIBRARY_DIRS += CUDA["lib_dirs"]
elif torch.version.cuda is not None:
    warnings.warn(f"tccomm: building without CUDA although torch has CUDA: {NO_CUDA_REASON}")


class BuildExt(cpp_extension.BuildExtension):
    def build_extensions(self):
        c_objects = self._compile_module_stub() + [self._make_core()]
        for ext in self.extensions:
            ext.extra_objects = c_objects + list(ext.extra_objects or [])
        super().build_extensions()

    def _make_core(self):
        """Builds the core's static library with its Makefile; its path."""
        cmd = ["make", "-C", CORE_DIR, f"-j{os.cpu_count() or 1}", "--no-print-directory", "-s", "lib",
               f"CONFIG={CORE_CONFIG}"]
        if CUDA:
            cmd += [f"NCCL_INCLUDE={CUDA['nccl_include']}", f"CUDA_INCLUDE={CUDA['cuda_include']}"]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        return out.strip().splitlines()[-1]

    def _compile_module_stub(self):
        # self.compiler is still the plain C compiler, configured like Python's
        # own (-fPIC, Python's include dir); BuildExtension wraps it only in super().
        return self.compiler.compile(
            MODULE_SOURCES,
            output_dir=os.path.join(self.build_temp, "c"),
            include_dirs=CORE_INCLUDE,
            extra_postargs=MODULE_FLAGS,
        )


ext = Extension(
    name="torchcomm_backend._C",
    sources=CXX_SOURCES,
    include_dirs=[absolute("csrc", "c_core", "include")],
    library_dirs=LIBRARY_DIRS,
    libraries=LIBRARIES,
    extra_compile_args={"cxx": CXX_FLAGS},
    extra_link_args=LINK_FLAGS,
    language="c++",
    # A change to any C source or header relinks the extension.
    depends=MODULE_SOURCES + CORE_FILES + CXX_HEADERS + sorted_glob("csrc/cuda/*.hpp"),
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
