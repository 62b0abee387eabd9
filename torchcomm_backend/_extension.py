"""The native extension (torchcomm_backend._C): loaded on first use, not when
the package is imported, so that registering the backend stays cheap."""

import importlib
import json

_extension = None


def load_extension():
    """Loads torchcomm_backend._C (once), which registers torch.ops.tccomm.*."""
    global _extension
    if _extension is None:
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
