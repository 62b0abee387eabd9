"""tccomm: a torch.distributed backend with a pure-C communication core.

    import torchcomm_backend  # optional: the torch.backends entry point does it
    torch.distributed.init_process_group("tccomm")

Importing this package only registers the backend name "tccomm" with
torch.distributed. The native extension (torchcomm_backend._C) is loaded the
first time a tccomm process group is created.

The TorchComm-style API (torchcomm_backend.comm) is loaded on first use:

    comm = torchcomm_backend.new_comm("tccomm", torch.device("cpu"))
    comm.all_reduce(t, torchcomm_backend.ReduceOp.SUM, async_op=False)
"""

import importlib

from torchcomm_backend._extension import build_info, dump_flight_recorder, load_extension

__version__ = "0.1.0"

__all__ = ["__version__", "build_info", "dump_flight_recorder", "load_extension", "new_comm", "ReduceOp", "TorchComm", "TorchWork",
           "TorchCommWindow"]

# name -> module of the lazily loaded API (the entry point must stay cheap).
_LAZY = {"new_comm": "comm", "TorchComm": "comm", "TorchWork": "_policy",
         "ReduceOp": "_options", "TorchCommWindow": "_window"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchcomm_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"torchcomm_backend.{module}"), name)
    globals()[name] = value
    return value


_BACKEND_NAME = "tccomm"


def _devices():
    """Devices the one tccomm backend object serves. Decided from torch
    alone (registration must stay cheap: no extension load, no CUDA init);
    a build that left CUDA out still refuses CUDA tensors with a clear error."""
    import torch

    return ["cpu", "cuda"] if torch.version.cuda else ["cpu"]


def _create_backend(opts, pg_options=None):
    # Imported here so that registration stays cheap.
    from torchcomm_backend._create import create

    return create(opts, pg_options)


def _register():
    import torch.distributed as dist

    if not dist.is_available():
        return
    if _BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return  # registered already (re-import, reload, entry point + import)
    dist.Backend.register_backend(
        _BACKEND_NAME, _create_backend, extended_api=True, devices=_devices()
    )


def _autoload():
    """Entry point (torch.backends), called from inside `import torch`.

    Registers the backend name with a lazy creator; loads nothing else.
    """
    _register()


# torch is imported only now: when this package is imported before torch,
# `import torch` runs the entry point, which needs _autoload defined above.
import torch  # noqa: E402,F401

_register()
