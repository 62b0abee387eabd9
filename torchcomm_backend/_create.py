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

from torchcomm_backend._extension import load_extension


def create(opts, pg_options=None):
    """Creator for dist.Backend.register_backend(..., extended_api=True).

    opts: torch's _DistributedBackendOptions (store already prefixed for the
    group and device, group_rank, group_size, timeout, group_id).
    """
    timeout = _as_timedelta(opts.timeout)
    group_id = getattr(opts, "group_id", "")
    name = f"tccomm:{group_id}" if group_id else "default"
    global_ranks = list(getattr(opts, "global_ranks_in_group", None) or [])
    carrier = create_group(opts.store, opts.group_rank, opts.group_size, timeout, name,
                           global_ranks=global_ranks)
    return carrier._get_backend(torch.device("cpu"))


def create_group(store, rank, size, timeout, name, transport="auto", global_ranks=()):
    """Rendezvous through `store` and a ProcessGroup carrying a tccomm backend.

    Shared by the c10d creator above and torchcomm_backend.new_comm.
    transport: "auto" (the core decides; TCCOMM_TRANSPORT is honoured), "shm" or "tcp".
    global_ranks: the members' global ranks, for the profiler's metadata.
    """
    load_extension()
    timeout_ms = _timeout_ms(timeout)
    carrier = dist.ProcessGroup(store, rank, size)
    # The rendezvous through the carrier's store happens in C++, where
    # Backend::split uses it too.
    torch.ops.tccomm.create(carrier.boxed(), rank, size, timeout_ms, name,
                            advertise_address(), transport, [int(r) for r in global_ranks])
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


# "Practically no timeout": far beyond any job, far below where a deadline in
# nanoseconds (now + timeout) could overflow int64, in the core or in torch.
_MAX_TIMEOUT_MS = 100 * 365 * 24 * 3600 * 1000


def _timeout_ms(timeout):
    """The group timeout in milliseconds, at least 1, at most _MAX_TIMEOUT_MS.

    c10d carries timeouts as int64 microseconds: timedelta.max reaches the
    creator wrapped around to a negative value, which can only mean such a
    huge timeout (a timeout is never meant to be negative).
    """
    td = _as_timedelta(timeout)
    if td < datetime.timedelta(0):
        return _MAX_TIMEOUT_MS
    return max(1, min(_MAX_TIMEOUT_MS, td // datetime.timedelta(milliseconds=1)))


def _as_timedelta(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
