#!/usr/bin/env bash
# Creates (or updates) a virtual environment with torch and builds tccomm into it.
#
#   scripts/setup_env.sh [VENV_DIR]          default: .venv in the repository root
#
#   TORCH_SPEC   the torch to install (default torch==2.14.1; on the project's
#                wheel mirror that is the CUDA build, which also runs on CPU;
#                torch==2.13.0 is the CPU-only build, also supported)
#   PYTHON       the interpreter that creates the venv (default python3)
#
# The extension is compiled against the venv's torch. A checkout holds one
# build (torchcomm_backend/_C*.so next to the sources), so the old build is
# removed first: a build made for another torch must never be loaded.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# ninja: torch's extension builder compiles the C++ sources in parallel only
# through ninja (without it, one at a time); setup.py finds this one even
# though the venv's bin/ is not on PATH. matplotlib: the benchmark's plots
# (bench/), never needed by the package itself.
echo "== installing $TORCH_SPEC numpy pytest expecttest ninja matplotlib"
"${PIP[@]}" install -q "$TORCH_SPEC" numpy pytest expecttest "setuptools>=64" wheel ninja matplotlib

echo "== building tccomm (pip install --no-build-isolation -e .)"
rm -rf "$ROOT/build" "$ROOT"/torchcomm_backend/_C*.so "$ROOT/torchcomm_backend/_build_torch.py"
"${PIP[@]}" install -q --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import torch, torch.distributed as dist
import torchcomm_backend
assert "tccomm" in dist.Backend.backend_list
print(f"== ready: torch {torch.__version__}, torchcomm_backend {torchcomm_backend.__version__}")
PY
