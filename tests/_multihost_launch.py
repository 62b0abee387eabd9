"""Parent side of the multi-host tests: one torchrun per simulated host
(tests/_netns.py), all at once, as on a real multi-node job:

    torchrun --nnodes H --node-rank k --nproc-per-node P_k
             --master-addr <host 0's address> --master-port <port> _multihost_job.py ...

Each torchrun's output (its workers' included) goes to OUT_DIR/host<k>.log;
the ranks report events in OUT_DIR/rank<R>.jsonl and, with TCCOMM_DEBUG=INFO,
write the core's log lines to OUT_DIR/tccomm.<hostname>.<pid>.log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _netns

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_multihost_job.py")


def torchrun() -> list[str]:
    """The torchrun of the interpreter running the tests."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


class JobFailed(AssertionError):
    pass


class Job:
    """A torchrun job over every host of `cluster`, `nproc` ranks per host
    (or nproc[k] on host k)."""

    def __init__(self, cluster: _netns.Cluster, nproc: int | list[int], scenarios: list[str], out_dir: str,
                 env: dict[str, str] | None = None):
        self.cluster, self.out_dir = cluster, out_dir
        self.per_host = list(nproc) if isinstance(nproc, (list, tuple)) else [nproc] * cluster.n
        assert len(self.per_host) == cluster.n, (self.per_host, cluster.n)
        self.world = sum(self.per_host)
        os.makedirs(out_dir, exist_ok=True)
        e = {k: v for k, v in os.environ.items() if not k.startswith(("TCCOMM_", "MASTER_", "TORCHELASTIC_"))}
        e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                 TCCOMM_DEBUG="INFO", TCCOMM_DEBUG_FILE=os.path.join(out_dir, "tccomm.%h.%p.log"),
                 TCCOMM_MH_LAYOUT=",".join(map(str, self.per_host)))
        e.update(env or {})
        port = cluster.next_port()
        self.procs, self._logs = [], []
        for h in cluster.hosts:
            argv = torchrun() + [f"--nnodes={cluster.n}", f"--node-rank={h.index}",
                                 f"--nproc-per-node={self.per_host[h.index]}", f"--master-addr={cluster.hosts[0].addr}",
                                 f"--master-port={port}", JOB, out_dir, *scenarios]
            log = open(os.path.join(out_dir, f"host{h.index}.log"), "w")
            self._logs.append(log)
            self.procs.append(h.popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT))

    # -- what the ranks reported -------------------------------------------
    def events(self, rank: int) -> list[dict]:
        try:
            with open(os.path.join(self.out_dir, f"rank{rank}.jsonl")) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def find(self, rank: int, event: str, **match) -> dict | None:
        for ev in self.events(rank):
            if ev["event"] == event and all(ev.get(k) == v for k, v in match.items()):
                return ev
        return None

    def outputs(self, tail: int = 6000) -> str:
        """Every host's torchrun output (the last `tail` characters of each)."""
        parts = []
        for h in self.cluster.hosts:
            with open(os.path.join(self.out_dir, f"host{h.index}.log"), errors="replace") as f:
                text = f.read()
            rc = self.procs[h.index].poll()
            parts.append(f"----- host {h.index} ({h.hostname}, {h.addr}), torchrun exit {rc} -----\n"
                         + text[-tail:])
        return "\n".join(parts)

    # -- waiting -----------------------------------------------------------
    def wait_for(self, what: str, ready, timeout: float) -> None:
        """Polls ready() until it is true; JobFailed (with every host's output)
        after `timeout` seconds or when every torchrun ended first."""
        deadline = time.monotonic() + timeout
        while not ready():
            if all(p.poll() is not None for p in self.procs):
                if ready():
                    return
                self.fail(f"every torchrun exited before {what}")
            if time.monotonic() > deadline:
                self.fail(f"no {what} within {timeout:.0f} s")
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[int]:
        """Waits for every torchrun to exit; their exit codes."""
        self.wait_for("exit of every torchrun", lambda: all(p.poll() is not None for p in self.procs), timeout)
        return [p.returncode for p in self.procs]

    def fail(self, why: str) -> None:
        self.stop()
        raise JobFailed(f"{why}; logs in {self.out_dir}\n{self.outputs()}")

    def stop(self) -> None:
        """Kills every process of the job on every host (the hosts stay)."""
        for h in self.cluster.hosts:
            h.kill_all()
        for p in self.procs:
            p.wait()
        for log in self._logs:
            log.close()

