"""Creation of a tccomm backend for one process group (the registered creator).

Every rank opens an endpoint, publishes its blob through the group's store,
reads everyone else's, and hands them all to the core, which connects the
ranks. The backend object travels back to torch.distributed through a
throw-away ProcessGroup (the "carrier"), so no Python binding of our own is needed.
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist

from torchcomm_backend import load_extension

_KEY_PREFIX = "tccomm/endpoint"


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
    timeout = _as_timedelta(timeout)
    timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    blob = torch.ops.tccomm.endpoint_open(advertise_address())
    try:
        blobs = _exchange_blobs(store, rank, size, blob, timeout, name)
        carrier = dist.ProcessGroup(store, rank, size)
        # attach consumes the endpoint, whatever happens.
        torch.ops.tccomm.attach(carrier.boxed(), blobs, rank, size, timeout_ms, name, transport)
    except BaseException:
        torch.ops.tccomm.endpoint_close(blob)  # a no-op once attach took it
        raise
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


def _exchange_blobs(store, rank, size, blob, timeout, name):
    """Publishes this rank's blob and returns every rank's, in rank order."""
    # A group name (and so the store prefix) comes back after
    # destroy_process_group(); the per-rank generation counter keeps this
    # incarnation's keys apart from any earlier one's. Every rank counts the
    # same creations, so all ranks agree on it.
    generation = store.add(f"{_KEY_PREFIX}/generation/{rank}", 1)
    prefix = f"{_KEY_PREFIX}/{generation}"
    store.set(f"{prefix}/{rank}", bytes(blob.tolist()))
    keys = [f"{prefix}/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except Exception as err:
        missing = [r for r, key in enumerate(keys) if not _has_key(store, key)]
        if not missing:
            raise
        raise dist.DistStoreError(
            f"tccomm: creating '{name}' (rank {rank} of {size}): rank(s) {missing} "
            f"did not publish their endpoint within {timeout} ({err})"
        ) from err
    parts = []
    for key in keys:
        value = store.get(key)
        if len(value) != blob.numel():
            raise RuntimeError(
                f"tccomm: creating '{name}': the endpoint blob under '{key}' has "
                f"{len(value)} bytes, expected {blob.numel()} (mixed tccomm versions?)"
            )
        parts.append(torch.frombuffer(bytearray(value), dtype=torch.uint8))
    return torch.cat(parts)


def _has_key(store, key):
    try:
        return store.check([key])
    except Exception:
        return False


def _as_timedelta(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
