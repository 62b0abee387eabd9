"""The native extension (torchcomm_backend._C): loaded on first use, not when
the package is imported, so that registering the backend stays cheap."""

import importlib
import json
import os

_extension = None


_REBUILD = ("rebuild tccomm against this torch: `pip install --no-build-isolation -e .` in its source "
            "tree, or `pip wheel --no-build-isolation --no-deps -w dist .` there and install that wheel")


def _describe(version, cuda, cxx11_abi):
    return (f"torch {version} ({f'CUDA {cuda}' if cuda else 'CPU only'}, "
            f"{'C++11' if cxx11_abi else 'pre-C++11'} ABI)")


def check_build_torch():
    """Raises ImportError unless the running torch is the one the extension
    was built for (torchcomm_backend/_build_torch.py, written by setup.py).

    The extension links against torch's C++ libraries, whose ABI changes
    between releases: under another torch it would fail with an undefined
    symbol at best. Checked before _C is imported; deliberately strict (no
    override): the cure is a rebuild, which the message names."""
    import torch

    try:
        from torchcomm_backend import _build_torch as built
    except ImportError:
        raise ImportError("torchcomm_backend._C cannot be checked against this torch: its build "
                          "recorded no torch (torchcomm_backend/_build_torch.py is missing); "
                          + _REBUILD) from None
    want = (built.VERSION, built.CUDA, bool(built.CXX11_ABI))
    have = (str(torch.__version__), torch.version.cuda, bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    if want != have:
        raise ImportError(f"torchcomm_backend._C was built for {_describe(*want)}, but this environment "
                          f"has {_describe(*have)}; the extension needs exactly the torch it was built "
                          f"for: {_REBUILD}")


def load_extension():
    """Loads torchcomm_backend._C (once), which registers torch.ops.tccomm.*.
    Raises ImportError, saying which torch it needs, when the extension was
    built for another torch."""
    global _extension
    if _extension is None:
        check_build_torch()
        _extension = importlib.import_module("torchcomm_backend._C")
    return _extension


def build_info():
    """What the extension was built with, e.g.
    {"cuda": True, "nccl_header_version": 23007, "nccl_runtime_version": 23007,
     "nccl_error": ""} (runtime version None, with the reason, when NCCL
    cannot be loaded)."""
    load_extension()
    import torch

    return json.loads(torch.ops.tccomm.build_info())


def dump_flight_recorder(path=None):
    """Writes the flight recorder's dump of every tccomm group of this
    process, in the format of torch's flight recorder, to `path` (default:
    TORCH_FR_DUMP_TEMP_FILE followed by the global rank). Returns the file
    written, or None when the recorder is off (TORCH_FR_BUFFER_SIZE unset
    or 0). Analyse the dumps of all ranks with
    `python -m torch.distributed.flight_recorder.fr_trace <dir>`."""
    load_extension()
    import torch

    written = torch.ops.tccomm.dump_flight_recorder(os.fspath(path) if path is not None else "")
    return written or None
