"""Creation of a tccomm backend for one process group (the registered creator).

Every rank opens an endpoint, publishes its blob through the group's store,
reads everyone else's, and hands them all to the core, which connects the
ranks (csrc/rendezvous.cpp). The backend object travels back to
torch.distributed through a throw-away ProcessGroup (the "carrier"), so no
Python binding of our own is needed.
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist

from torchcomm_backend import load_extension


def create(opts, pg_options=None):
    """Creator for dist.Backend.register_backend(..., extended_api=True).

    opts: torch's _DistributedBackendOptions (store already prefixed for the
    group and device, group_rank, group_size, timeout, group_id).
    """
    timeout = _as_timedelta(opts.timeout)
    group_id = getattr(opts, "group_id", "")
    name = f"tccomm:{group_id}" if group_id else "default"
    carrier = create_group(opts.store, opts.group_rank, opts.group_size, timeout, name)
    return carrier._get_backend(torch.device("cpu"))


def create_group(store, rank, size, timeout, name, transport="auto"):
    """Rendezvous through `store` and a ProcessGroup carrying a tccomm backend.

    Shared by the c10d creator above and torchcomm_backend.new_comm.
    transport: "auto" (the core decides; TCCOMM_TRANSPORT is honoured), "shm" or "tcp".
    """
    load_extension()
    timeout_ms = max(1, int(_as_timedelta(timeout).total_seconds() * 1000))
    carrier = dist.ProcessGroup(store, rank, size)
    # The rendezvous through the carrier's store happens in C++, where
    # Backend::split uses it too.
    torch.ops.tccomm.create(carrier.boxed(), rank, size, timeout_ms, name,
                            advertise_address(), transport)
    return carrier


def advertise_address():
    """The IPv4 address peers use to reach this process's endpoint.

    TCCOMM_SOCKET_ADDR if set; else the local address of the interface that
    routes to MASTER_ADDR (a UDP connect sends no packet); else 127.0.0.1.
    """
    addr = os.environ.get("TCCOMM_SOCKET_ADDR")
    if addr:
        return addr
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return s.getsockname()[0]
        except (OSError, ValueError):
            pass
    return "127.0.0.1"


def _as_timedelta(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
