"""Simulated hosts on one machine, for multi-host runs (tests, benchmarks).

Each simulated host is a set of Linux namespaces held open by one process
(its "holder", started with `unshare`):
  * a network namespace with loopback and one interface, eth0, whose other
    end is a port of a bridge in a "switch" namespace of its own, so that
    every host reaches every other (addresses 10.211.0.1, .2, ... /24 by
    default; nothing routes anywhere else);
  * a UTS namespace: its own hostname;
  * a mount namespace: a fresh tmpfs on /dev/shm (ranks on different hosts
    cannot see each other's segments) and an /etc/hosts naming every host;
  * a PID namespace whose init is the holder: killing the holder kills
    everything on the host, and `kill -KILL -1` inside kills everything but
    the holder (Host.kill_all, a host dying while the others go on).
The root namespace is never touched: no interface, address or route is
created there, so clusters of parallel runs cannot collide (each has its own
switch; only the hostnames carry the pid, for readable logs).

Commands run on a host through `nsenter -t <holder> -n -u -m -p`.

Teardown: Cluster is a context manager; clusters still open at interpreter
exit are closed by atexit; and every holder dies with the process that made
the cluster (PR_SET_PDEATHSIG on `unshare`, whose --kill-child passes it on
to the holder), so even a SIGKILLed test run leaves nothing behind: once
their processes are gone the kernel frees the namespaces and the veth pairs.

Where namespaces cannot be made (not root, no `ip`/`unshare`/`nsenter`, a
kernel or sandbox that refuses), Cluster raises NamespaceUnavailable with the
command and its stderr.

Manual use: scripts/sim_hosts.sh (which runs this file; --help).
Only the standard library is used here.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "10.211.0"   # host k has SUBNET.(k+1)/24
START_TIMEOUT = 10.0  # seconds for a holder to report its namespaces ready


class NamespaceUnavailable(RuntimeError):
    """Simulated hosts cannot be created here; the message says why."""


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it ends
    (PR_SET_PDEATHSIG = 1). Create clusters from a long-lived thread."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _child_of(pid: int) -> int | None:
    """The pid of a child of `pid` (unshare --fork has exactly one)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The field after the parenthesised command name is the state, then the ppid.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            return int(entry)
    return None


class _Holder:
    """One `unshare` process and the holder it forked into the new namespaces.

    `script` (sh) sets the namespaces up, prints "ready" and then execs
    `sleep infinity` as the holder that keeps them alive."""

    def __init__(self, ns_flags: list[str], script: str, what: str):
        self.cmd = ["unshare", *ns_flags, "--fork", "--kill-child", "sh", "-c",
                    "set -e\n" + script + "\necho ready\nexec sleep infinity </dev/null >/dev/null 2>&1"]
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        except OSError as e:
            raise NamespaceUnavailable(f"cannot start {what}: {shlex.join(self.cmd)}: {e}") from e
        self.pid = None
        self._wait_ready(what)

    def _wait_ready(self, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        line = b""
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.05)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 64)
                line += chunk
                if not chunk:  # EOF: it failed
                    break
            elif self.proc.poll() is not None:
                break
        if line.strip() != b"ready":
            self.kill()
            err = self.proc.stderr.read().decode(errors="replace").strip()
            raise NamespaceUnavailable(
                f"cannot create {what}: `{shlex.join(self.cmd[:-1])} '<setup script>'` "
                f"exited {self.proc.returncode}: {err or line.decode(errors='replace') or 'no output'}")
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.pid = _child_of(self.proc.pid)
        if self.pid is None:
            self.kill()
            raise NamespaceUnavailable(f"cannot find the namespace holder forked by unshare (pid {self.proc.pid})")

    def nsenter(self, flags: list[str]) -> list[str]:
        return ["nsenter", f"--target={self.pid}", *flags]

    def kill(self) -> None:
        """Kills the holder (and with it everything in its PID namespace).
        unshare waits for the holder, which exits only once every process
        of its PID namespace is gone, so unshare's exit means all are."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # --kill-child still takes the holder down
            self.proc.wait()


def _run(argv: list[str], what: str, stdin: str | None = None) -> None:
    """Runs a setup command; NamespaceUnavailable with its stderr if it fails."""
    r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        shown = shlex.join(argv) + (f" <<< {stdin!r}" if stdin else "")
        raise NamespaceUnavailable(f"{what}: `{shown}` exited {r.returncode}: {r.stderr.strip()}")


class Host:
    """One simulated host of a Cluster."""

    def __init__(self, index: int, hostname: str, addr: str, holder: _Holder):
        self.index, self.hostname, self.addr = index, hostname, addr
        self._holder = holder

    @property
    def pid(self) -> int:
        """The holder's pid (in the root PID namespace)."""
        return self._holder.pid

    def argv(self, cmd: list[str], cwd: str | None = None) -> list[str]:
        """`cmd` as a command line that runs it on this host, in `cwd`
        (default: the current directory; the same paths exist there)."""
        return self._holder.nsenter(["--net", "--uts", "--mount", "--pid",
                                     f"--wd={cwd or os.getcwd()}", "--"]) + list(cmd)

    def popen(self, cmd: list[str], cwd: str | None = None, **kw) -> subprocess.Popen:
        """Starts `cmd` on this host (Popen keywords as usual). The process
        you get is nsenter's, which waits for `cmd` and returns its exit code."""
        return subprocess.Popen(self.argv(cmd, cwd), **kw)

    def run(self, cmd: list[str], cwd: str | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd, cwd), **kw)

    def kill_all(self) -> None:
        """SIGKILLs every process on this host at once (one kill(-1) inside
        its PID namespace), as when a machine dies; the host itself stays
        and can run new commands."""
        self.run(["sh", "-c", "kill -KILL -1 2>/dev/null || true"], timeout=30)


class Cluster:
    """n simulated hosts joined by one switch (see the module docstring).

    rate/burst/latency: when rate is given (tc syntax: "1gbit", "100mbit"),
    every host's link is shaped with a token bucket (tc tbf) in both
    directions. shm_size: the size of each host's /dev/shm tmpfs ("512m";
    default: tmpfs's own default)."""

    def __init__(self, n: int, subnet: str = SUBNET, rate: str | None = None, burst: str = "256kb",
                 latency: str = "50ms", shm_size: str | None = None, name: str | None = None):
        if not 1 <= n <= 250:
            raise ValueError(f"a cluster has 1..250 hosts, not {n}")
        self.n, self.subnet = n, subnet
        self.rate, self.burst, self.latency, self.shm_size = rate, burst, latency, shm_size
        self.name = name or f"tcc{os.getpid()}"
        self.hosts: list[Host] = []
        self._switch: _Holder | None = None
        self._tmp: str | None = None
        self._next_port = 29500

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        _check_tools()
        _OPEN.add(self)
        try:
            self._tmp = tempfile.mkdtemp(prefix=f"{self.name}-")
            hostnames = [f"{self.name}-h{k}" for k in range(self.n)]
            addrs = [f"{self.subnet}.{k + 1}" for k in range(self.n)]
            etc_hosts = os.path.join(self._tmp, "hosts")
            with open(etc_hosts, "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, hostnames)))
            self._switch = _Holder(["--net"], "ip link set lo up\nip link add br0 type bridge\nip link set br0 up",
                                   "the switch namespace")
            for k in range(self.n):
                self._add_host(k, hostnames[k], addrs[k], etc_hosts)
        except BaseException:
            self.close()
            raise

    def _add_host(self, k: int, hostname: str, addr: str, etc_hosts: str) -> None:
        shm_opts = "mode=1777" + (f",size={self.shm_size}" if self.shm_size else "")
        script = (f"hostname {shlex.quote(hostname)}\n"
                  f"mount -t tmpfs -o {shm_opts} tmpfs /dev/shm\n"
                  f"mount --bind {shlex.quote(etc_hosts)} /etc/hosts\n"
                  "ip link set lo up")
        holder = _Holder(["--net", "--uts", "--mount", "--pid", "--mount-proc"], script, f"host {hostname}")
        self.hosts.append(Host(k, hostname, addr, holder))  # before the wiring: close() finds it
        port = f"p{k}"
        switch_cmds = [f"link add {port} type veth peer name eth0 netns {holder.pid}",
                       f"link set {port} master br0", f"link set {port} up"]
        _run(self._switch.nsenter(["--net", "ip", "-batch", "-"]), f"wiring host {hostname} to the switch",
             "\n".join(switch_cmds) + "\n")
        _run(holder.nsenter(["--net", "ip", "-batch", "-"]), f"configuring eth0 of {hostname}",
             f"addr add {addr}/24 dev eth0\nlink set eth0 up\n")
        if self.rate:
            tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
            _run(holder.nsenter(["--net", "tc", "qdisc", "replace", "dev", "eth0", *tbf]),
                 f"shaping {hostname}'s uplink")
            _run(self._switch.nsenter(["--net", "tc", "qdisc", "replace", "dev", port, *tbf]),
                 f"shaping {hostname}'s downlink")

    def close(self) -> None:
        """Kills every host (and everything running on it) and the switch."""
        for h in self.hosts:
            h._holder.kill()
        self.hosts = []
        if self._switch is not None:
            self._switch.kill()
            self._switch = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        _OPEN.discard(self)

    # -- use ---------------------------------------------------------------
    def next_port(self) -> int:
        """A port for a new job's rendezvous. Each cluster's network is its
        own, so nothing else can hold it; a fresh one per job keeps a
        previous job's sockets in TIME_WAIT out of the way."""
        self._next_port += 1
        return self._next_port


_OPEN: set[Cluster] = set()


@atexit.register
def _close_all() -> None:
    for c in list(_OPEN):
        c.close()


def _check_tools() -> None:
    missing = [t for t in ("unshare", "nsenter", "ip", "mount", "hostname") if shutil.which(t) is None]
    if missing:
        raise NamespaceUnavailable(f"simulated hosts need {', '.join(missing)} on PATH (util-linux, iproute2)")


# ----------------------------------------------------------------------
# command line (scripts/sim_hosts.sh)
# ----------------------------------------------------------------------

def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="sim_hosts.sh",
        description="Simulate N hosts on this machine (root). Without a command: print how to enter "
                    "each host and wait for Ctrl-C. With one (after --, e.g. `3 -- hostname`): run it on every host at "
                    "once, {rank}, {nhosts}, {addr}, {hostname} and {master} (host 0's address) "
                    "replaced per host; exit with the highest exit code. Everything is torn down at the end.")
    p.add_argument("hosts", type=int)
    p.add_argument("--rate", help="shape every link to this rate, e.g. 1gbit (tc tbf)")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--latency", default="50ms", help="tbf's queueing limit (not a delay)")
    p.add_argument("--shm-size", help="each host's /dev/shm size, e.g. 1g")
    cut = argv.index("--") if "--" in argv else len(argv)
    a, cmd = p.parse_args(argv[:cut]), argv[cut + 1:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the cluster is closed
    try:
        with Cluster(a.hosts, rate=a.rate, burst=a.burst, latency=a.latency, shm_size=a.shm_size) as c:
            if not cmd:
                for h in c.hosts:
                    print(f"{h.hostname} {h.addr}: {shlex.join(h.argv(['bash']))}")
                print("Ctrl-C tears them down.", flush=True)
                try:
                    signal.pause()
                except KeyboardInterrupt:
                    pass
                return 0
            subs = lambda h: {"rank": h.index, "nhosts": c.n, "addr": h.addr,  # noqa: E731
                              "hostname": h.hostname, "master": c.hosts[0].addr}
            procs = [h.popen([w.format(**subs(h)) for w in cmd]) for h in c.hosts]
            return max(p.wait() for p in procs)
    except NamespaceUnavailable as e:
        print(f"sim_hosts: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
