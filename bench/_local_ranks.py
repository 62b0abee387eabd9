"""Starting a benchmark's ranks on this machine: a free port for the
env:// rendezvous and one Python process per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, argv_of: Callable[[int], list[str]], extra_env: dict[str, str] | None = None,
              timeout: float = 600) -> bool:
    """Runs `python *argv_of(rank)` for every rank with torch.distributed's
    env:// variables (and OMP_NUM_THREADS=1: one thread per rank, as the
    benchmarks time it) plus extra_env, and waits for all of them: True
    when every rank exited with status 0."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, *argv_of(rank)], env=env))
    codes = [p.wait(timeout=timeout) for p in procs]
    return all(code == 0 for code in codes)
