"""What this process holds that a destroyed group must give back: shared
memory mappings and sockets (read from /proc)."""

from __future__ import annotations

import os


def shm_mappings() -> list[str]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line or "memfd:" in line:
                out.append(line.split(None, 5)[-1].strip())
    return sorted(set(out))


def socket_count() -> int:
    return len(open_sockets())


def open_sockets(exclude_port: int | None = None) -> list[str]:
    """This process's open sockets, as readable descriptions; sockets with
    `exclude_port` at either end are left out."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    desc = {}
    for table in ("tcp", "tcp6", "udp", "udp6", "unix", "netlink", "raw", "raw6", "packet"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            if table in ("netlink", "raw", "raw6", "packet"):
                if parts and parts[-1] in inodes:
                    desc[parts[-1]] = f"{table} socket"
                continue
            if table == "unix":
                if len(parts) >= 7 and parts[6] in inodes:
                    desc[parts[6]] = "unix " + (parts[7] if len(parts) > 7 else "(anonymous)")
                continue
            if len(parts) > 9 and parts[9] in inodes:
                lport = int(parts[1].rsplit(":", 1)[1], 16)
                rport = int(parts[2].rsplit(":", 1)[1], 16)
                if exclude_port is not None and exclude_port in (lport, rport):
                    desc[parts[9]] = None
                else:
                    desc[parts[9]] = f"{table} port {lport} -> {rport} (state {parts[3]})"
    out = [desc.get(i, f"socket inode {i} (neither bound nor connected)") for i in sorted(inodes)]
    return sorted(d for d in out if d is not None)
