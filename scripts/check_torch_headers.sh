#!/usr/bin/env bash
# Compiles the C++ shim against the headers of another torch, without
# installing that torch: the build's torch is one version, and this catches
# the shim using C++ API that an older (or newer) torch lacks.
#
#   scripts/check_torch_headers.sh [VERSION]     default 2.11.0, the oldest supported
#
# Downloads that torch's wheel (no dependencies) once into
# ${TMPDIR:-/tmp}/tccomm-torch-headers-VERSION, unpacks only its headers and
# compiles the shim (csrc/shim.cpp, which includes every csrc/*.cpp) with
# the flags of setup.py (-Wall -Wextra -Werror, the C++ standard that torch
# needs), syntax only. The CUDA part (csrc/cuda/*.cpp, TCCOMM_WITH_CUDA) is
# included when the wheel is a CUDA build and the CUDA toolkit's and NCCL's
# headers are found, as setup.py finds them. Exit code 0 when every file compiles, 1 when one does not, 3
# when the wheel could not be downloaded (nothing checked).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${1:-2.11.0}
PY=${PYTHON:-python3}
WORK=${TMPDIR:-/tmp}/tccomm-torch-headers-$VERSION
CXX=${CXX:-g++}

if [ ! -f "$WORK/torch/include/torch/headeronly/version.h" ]; then
  echo "== downloading torch==$VERSION (headers only are kept)"
  rm -rf "$WORK"
  mkdir -p "$WORK/wheel"
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: "torch==$VERSION" -d "$WORK/wheel"; then
    echo "could not download torch==$VERSION: nothing was checked"
    exit 3
  fi
  unzip -q -o "$WORK"/wheel/torch-*.whl 'torch/include/*' -d "$WORK"
  rm -rf "$WORK/wheel"
fi
INC=$WORK/torch/include
minor=$(sed -n 's/^#define TORCH_VERSION_MINOR \([0-9]*\)/\1/p' "$INC/torch/headeronly/version.h")
std=c++17
[ "${minor:-0}" -ge 13 ] && std=c++20  # as setup.py: torch's headers need C++20 from 2.13 on

flags=(-std=$std -fsyntax-only -O2 -fPIC -Wall -Wextra -Werror -D_GLIBCXX_USE_CXX11_ABI=1
       -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
       -I"$ROOT/csrc/c_core/include" -isystem "$INC" -isystem "$INC/torch/csrc/api/include"
       $("$PY" -c 'import sysconfig; print("-isystem", sysconfig.get_paths()["include"])'))
cuda_inc=
for d in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -n "$d" ] && [ -f "$d/include/cuda_runtime_api.h" ] && { cuda_inc=$d/include; break; }
done
nccl_inc=${NCCL_INCLUDE_DIR:-$("$PY" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null || true)}
if [ ! -f "$INC/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  what="without the CUDA path (this torch $VERSION wheel is a CPU-only build)"
elif [ -n "$cuda_inc" ] && [ -f "$nccl_inc/nccl.h" ]; then
  flags+=(-DTCCOMM_WITH_CUDA -isystem "$nccl_inc" -isystem "$cuda_inc")
  what="with the CUDA path"
else
  what="without the CUDA path (no CUDA toolkit or nccl.h headers found)"
fi

echo "== compiling the shim against torch $VERSION's headers ($std, $what)"
if ! "$CXX" "${flags[@]}" "$ROOT/csrc/shim.cpp"; then
  echo "the shim does not compile against torch $VERSION"
  exit 1
fi
echo "== the shim compiles against torch $VERSION"
