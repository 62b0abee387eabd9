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
    refuse anything older). It is compiled as one translation unit,
    csrc/shim.cpp, which includes every other file: torch's headers are most
    of a file's compile time, and this way they are parsed once.
The result links against c10 and torch_cpu only (no torch_python, no
binding library) with an rpath to torch/lib; with torch's CUDA build also
against c10_cuda, torch_cuda and cudart (see cuda_build_config()). NCCL is not
linked: the core finds the copy torch loaded at run time.

TCCOMM_BUILD_VARIANT picks a test build that is never shipped: the core's
Makefile configuration of that name, and the shim's flags plus those of
VARIANT_FLAGS below. Build it out of tree
(setup.py build_ext --build-lib DIR --build-temp DIR/tmp), as the scripts
that use it do.

The build is parallel: the core's Makefile runs while ninja compiles the C++
sources (each with one job per usable CPU, MAX_JOBS overrides). Without
ninja, torch's BuildExtension would compile the C++ sources one at a time, so
the `ninja` package (which scripts/setup_env.sh installs) is put on PATH when
no ninja is found there.

Next to the extension the build writes torchcomm_backend/_build_torch.py, the
torch it was built for (version, CUDA version, C++ ABI): the extension
refuses to load under any other torch (torchcomm_backend/_extension.py).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
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

# The one C++ source compiled (see csrc/shim.cpp); it includes the files
# below, the CUDA ones only with TCCOMM_WITH_CUDA (see cuda_build_config()).
SHIM_SOURCE = rel("csrc", "shim.cpp")
SHIM_PARTS = [p for p in sorted_glob("csrc/*.cpp") + sorted_glob("csrc/cuda/*.cpp") if p != SHIM_SOURCE]


def check_shim_parts():
    """Every shim file must be in csrc/shim.cpp: a file left out would
    build, and then fail to load, or silently lack its ops."""
    with open(absolute(SHIM_SOURCE)) as f:
        included = set(re.findall(r'^#include "([^"]+\.cpp)"', f.read(), re.MULTILINE))
    missing = [p for p in SHIM_PARTS if os.path.relpath(p, "csrc") not in included]
    if missing:
        raise SystemExit(f"tccomm: {', '.join(missing)} not included by {SHIM_SOURCE}: add an #include line there")


check_shim_parts()
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
    # cudart by soname (libcudart.so.N): at run time it is the copy torch loaded.
    LIBRARIES += ["c10_cuda", "torch_cuda", "cudart"]
    LIBRARY_DIRS += CUDA["lib_dirs"]
elif torch.version.cuda is not None:
    warnings.warn(f"tccomm: building without CUDA although torch has CUDA: {NO_CUDA_REASON}")


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def ensure_ninja():
    """Puts a ninja on PATH if none is there: torch's BuildExtension compiles
    in parallel only through ninja (else one source at a time). The `ninja`
    package installs its binary next to the interpreter, a bin/ directory
    that is not on PATH when pip is run as .venv/bin/pip. Returns the reason
    when no ninja can be found."""
    if cpp_extension.is_ninja_available():
        return None
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package: the binary and its directory

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in candidates:
        if os.access(os.path.join(d, "ninja"), os.X_OK):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            if cpp_extension.is_ninja_available():
                return None
    return "no ninja found (pip install ninja, as scripts/setup_env.sh does)"


# What the generated torchcomm_backend/_build_torch.py records; the import
# guard in torchcomm_backend/_extension.py compares it with the running torch.
BUILD_TORCH = {
    "version": str(torch.__version__),
    "cuda": torch.version.cuda,
    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
}


class BuildExt(cpp_extension.BuildExtension):
    def __init__(self, *args, **kwargs):
        # Before BuildExtension's __init__, which decides there whether to use ninja.
        no_ninja = ensure_ninja()
        if no_ninja:
            warnings.warn(f"tccomm: {no_ninja}: the C++ sources compile one at a time")
        super().__init__(*args, **kwargs)

    def build_extensions(self):
        # torch's ninja build uses MAX_JOBS, else ninja's default (CPUs + 2).
        os.environ.setdefault("MAX_JOBS", str(usable_cpus()))
        # Objects compiled against one torch's headers are never reused for
        # another (ninja does not track torch's headers, -isystem ones).
        self.build_temp = os.path.join(self.build_temp, "torch-" + "-".join(
            "".join(c if c.isalnum() or c in "._" else "_" for c in str(v)) for v in BUILD_TORCH.values()))
        # The core's Makefile runs while the C++ sources compile; the link
        # (the first thing that needs its library) waits for it.
        core = self._start_core()
        c_objects = self._compile_module_stub() + [os.path.join(CORE_DIR, "build", CORE_CONFIG, "libtccomm.a")]
        for ext in self.extensions:
            ext.extra_objects = c_objects + list(ext.extra_objects or [])
        link = self.compiler.link

        def link_after_core(*args, **kwargs):
            self._finish_core(core)
            return link(*args, **kwargs)

        self.compiler.link = link_after_core
        # An extension built for another torch is never "up to date".
        if any(self._read_build_torch(ext) != self._build_torch_text() for ext in self.extensions):
            self.force = True
        try:
            super().build_extensions()
        except BaseException:
            if not core.get("done"):  # let make finish; the compile error is the one to report
                core["done"] = True
                core["proc"].communicate()
            raise
        self._finish_core(core)  # the link was skipped: nothing was out of date
        for ext in self.extensions:
            self._write_build_torch(ext)

    def _start_core(self):
        """Starts the core's static library build (its Makefile, in parallel)."""
        cmd = ["make", "-C", CORE_DIR, f"-j{usable_cpus()}", "--no-print-directory", "-s", "lib",
               f"CONFIG={CORE_CONFIG}"]
        if CUDA:
            cmd += [f"NCCL_INCLUDE={CUDA['nccl_include']}", f"CUDA_INCLUDE={CUDA['cuda_include']}"]
        return {"proc": subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), "cmd": cmd}

    @staticmethod
    def _finish_core(core):
        """Waits for the core's build (once; later calls return at once)."""
        if core.get("done"):
            return
        core["done"] = True
        proc = core["proc"]
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, core["cmd"], out)
        built = out.strip().splitlines()[-1] if out.strip() else ""
        expected = os.path.join(CORE_DIR, "build", CORE_CONFIG, "libtccomm.a")
        if os.path.realpath(built) != os.path.realpath(expected):
            raise RuntimeError(f"tccomm: make lib built {built!r}, expected {expected!r}")

    @staticmethod
    def _build_torch_text():
        return ('"""Generated by setup.py: the torch this build of torchcomm_backend._C is for."""\n\n'
                + "".join(f"{k.upper()} = {v!r}\n" for k, v in BUILD_TORCH.items()))

    def _read_build_torch(self, ext):
        try:
            with open(os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "_build_torch.py")) as f:
                return f.read()
        except OSError:
            return None

    def _write_build_torch(self, ext):
        """Writes torchcomm_backend/_build_torch.py next to the built extension
        (into the wheel's tree), and into the source tree for an in-place or
        editable build, whose package is imported from there."""
        text = self._build_torch_text()
        dirs = {os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))}
        if self.inplace or getattr(self, "editable_mode", False):
            dirs.add(absolute("torchcomm_backend"))
        for d in sorted(dirs):
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "_build_torch.py"), "w") as f:
                f.write(text)

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
    sources=[SHIM_SOURCE],
    include_dirs=[absolute("csrc", "c_core", "include")],
    library_dirs=LIBRARY_DIRS,
    libraries=LIBRARIES,
    extra_compile_args={"cxx": CXX_FLAGS},
    extra_link_args=LINK_FLAGS,
    language="c++",
    # A change to any source or header rebuilds what needs it (ninja tracks
    # the files shim.cpp includes) and relinks the extension.
    depends=MODULE_SOURCES + CORE_FILES + SHIM_PARTS + CXX_HEADERS,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
