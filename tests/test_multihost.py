"""tccomm jobs across simulated hosts (tests/_netns.py): one torchrun per host,
multi-node, as on a real cluster (tests/_multihost_launch.py), the ranks
running tests/_multihost_job.py.

Per layout (hosts x ranks per host, or hosts of different rank counts), one
job runs every scenario; each test reports one scenario of it:
  * every c10d collective and send/recv, results checked exactly on every rank;
  * the world spans hosts: each rank ran on its own host's hostname, and the
    core's INFO line says it chose the hybrid transport (shared memory
    within each host, tcp between hosts; tcp with one rank per host)
    because a rank is on another host;
  * subgroups within one host (shm) and across hosts (tcp), checked exactly;
  * a 2-D DeviceMesh (inter-host x intra-host), each dimension's group
    (not on hosts of different rank counts: a mesh is rectangular);
and on 3 hosts, a host whose processes are all killed at once while the
others wait in an all_reduce: they must fail at once, saying so.
Every test skips, saying why, where namespaces cannot be created.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import _netns
from _multihost_launch import Job

# A job runs several cases: twice the per-case hang limit of the other suites.
JOB_TIMEOUT = 2 * float(os.environ.get("TCCOMM_TEST_CASE_TIMEOUT", "75"))
# (hosts, ranks per host, or each host's ranks): (2, (3, 2)) is uneven, where
# all_gather and reduce_scatter go through the hosts' first ranks.
LAYOUTS = [(2, 2), (3, 1), (3, 2), (2, (3, 2))]
SCENARIOS = ["collectives", "identity", "subgroups", "mesh"]


def layout_id(layout):
    hosts, nproc = layout
    return f"{hosts}hosts-" + ("+".join(map(str, nproc)) if isinstance(nproc, tuple) else f"x{nproc}")


class Done:
    """A finished job: what its ranks reported, read back after the hosts are gone."""

    def __init__(self, job: Job, hostnames: list[str]):
        self.job, self.hostnames = job, hostnames
        self.world = job.world

    def node_of(self, rank: int) -> int:
        """The host (torchrun's node rank) that runs global rank `rank`."""
        first = 0
        for k, count in enumerate(self.job.per_host):
            if rank < first + count:
                return k
            first += count
        raise ValueError(rank)

    def host_of(self, rank: int) -> str:
        return self.hostnames[self.node_of(rank)]

    def result(self, rank: int, scenario: str) -> dict | None:
        return self.job.find(rank, "result", case=scenario)

    def log(self, rank: int) -> list[str]:
        """Rank's TCCOMM_DEBUG lines (its file is named by host and pid)."""
        hello = self.job.find(rank, "hello")
        path = os.path.join(self.job.out_dir, f"tccomm.{hello['hostname']}.{hello['pid']}.log")
        with open(path) as f:
            return f.read().splitlines()


_skip_reason: list[str] = []  # once namespaces failed, every test skips at once


@contextlib.contextmanager
def cluster(n: int):
    """n simulated hosts, or a skip saying why they cannot be made here."""
    if _skip_reason:
        pytest.skip(_skip_reason[0])
    c = _netns.Cluster(n)
    try:
        c.start()
    except _netns.NamespaceUnavailable as e:
        _skip_reason.append(f"cannot simulate hosts here: {e}")
        pytest.skip(_skip_reason[0])
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """layout -> Done: each layout's job runs once (on first use) on a
    cluster of its own; a failed job fails every test of its layout."""
    done: dict = {}

    def get(layout) -> Done:
        if layout not in done:
            hosts, nproc = layout
            try:
                with cluster(hosts) as c:
                    scenarios = [s for s in SCENARIOS if s != "mesh" or not isinstance(nproc, tuple)]
                    job = Job(c, nproc, scenarios, str(tmp_path_factory.mktemp(layout_id(layout))))
                    try:
                        codes = job.wait(JOB_TIMEOUT)
                    finally:
                        job.stop()
                    names = [h.hostname for h in c.hosts]
                if codes != [0] * hosts:
                    raise AssertionError(f"torchrun exit codes {codes}\n{job.outputs()}")
                done[layout] = Done(job, names)
            except AssertionError as e:  # JobFailed too
                done[layout] = e
        if isinstance(done[layout], Exception):
            pytest.fail(f"the {layout_id(layout)} job failed: {done[layout]}", pytrace=False)
        return done[layout]

    return get


def passed(d: Done, scenario: str) -> None:
    """Every rank reported a pass of `scenario`."""
    bad = []
    for r in range(d.world):
        res = d.result(r, scenario)
        if res is None or res["status"] != "pass":
            bad.append(f"rank {r}: " + (res["msg"] if res else "no result"))
    assert not bad, f"{scenario} failed:\n" + "\n".join(bad) + "\n" + d.job.outputs()


def expected_choice(d: Done, members: list[int]) -> str:
    """The INFO text (select.c) a group of these global ranks must log at
    creation: shm when all are on one host, tcp when each is on a host of
    its own, else the hybrid (shared memory within each host); the last two
    name the first group rank on another host than group rank 0."""
    hosts = [d.host_of(q) for q in members]
    other = next((i for i, h in enumerate(hosts) if h != hosts[0]), None)
    if other is None:
        return f"all {len(members)} ranks on host {hosts[0]} share /dev/shm: shm"
    how = "tcp" if len(set(hosts)) == len(hosts) else "shm within each host, tcp between hosts"
    return f"rank {other} is on another host ({hosts[other]}; rank 0 is on {hosts[0]}): {how}"


def transport_name(d: Done, members: list[int]) -> str:
    """tcc_comm_transport_name of a group of these global ranks."""
    hosts = [d.host_of(q) for q in members]
    return "shm" if len(set(hosts)) == 1 else "tcp" if len(set(hosts)) == len(hosts) else "shm+tcp"


def check_choice(d: Done, rank: int, name: str, members: list[int]) -> None:
    lines = [ln for ln in d.log(rank) if f"TCCOMM INFO communicator '{name}': " in ln]
    want = f"communicator '{name}': {expected_choice(d, members)}"
    assert len(lines) == 1 and lines[0].endswith(want), (
        f"rank {rank}, group {members}: expected one INFO line ending {want!r}; got {lines}")
    if transport_name(d, members) != "shm+tcp":
        return
    # A hybrid group also says how it split into hosts (hybrid_setup.c).
    hosts = list(dict.fromkeys(d.host_of(q) for q in members))  # in the order of their lowest rank
    sizes = [sum(d.host_of(q) == h for q in members) for h in hosts]
    mine = d.host_of(rank)
    index = [q for q in members if d.host_of(q) == mine].index(rank)
    # Uneven hosts: whether the leaders' allreduce overlaps the host phases.
    # All simulated hosts are one machine, so only where its CPUs cover
    # every rank of the group and every host's leader thread (TCCOMM_HIER_OVERLAP).
    overlap = len(members) + len(hosts) <= len(os.sched_getaffinity(0))
    leaders = ("" if len(set(sizes)) == 1
               else "; the leaders' allreduce overlaps the host phases (TCCOMM_HIER_OVERLAP)" if overlap
               else "; the leaders' allreduce runs in one piece (TCCOMM_HIER_OVERLAP)")
    want = (f"communicator '{name}' spans {len(hosts)} hosts (ranks per host {'+'.join(map(str, sizes))}"
            f"{'' if len(set(sizes)) == 1 else ', uneven'}): this rank is on host {hosts.index(mine)} at local "
            f"index {index}; shared memory with {sizes[hosts.index(mine)] - 1} rank(s) of its host, TCP to the "
            f"other hosts{leaders}")
    lines = [ln for ln in d.log(rank) if f"TCCOMM INFO communicator '{name}' spans" in ln]
    assert len(lines) == 1 and lines[0].endswith(want), (
        f"rank {rank}, group {members}: expected one INFO line ending {want!r}; got {lines}")


# ---------------------------------------------------------------------------


def test_environment():
    """The simulated hosts themselves: own hostnames and /dev/shm, TCP
    between them by address and by name, kill_all, and nothing left after close."""
    with cluster(3) as c:
        names = [h.run(["hostname"], capture_output=True, text=True).stdout.strip() for h in c.hosts]
        assert names == [h.hostname for h in c.hosts] and len(set(names)) == 3
        assert socket.gethostname() not in names
        c.hosts[0].run(["sh", "-c", "echo x > /dev/shm/mark"], check=True)
        seen = [h.run(["ls", "/dev/shm"], capture_output=True, text=True).stdout.split() for h in c.hosts]
        assert seen == [["mark"], [], []] and not os.path.exists("/dev/shm/mark")
        server = c.hosts[1].popen([sys.executable, "-c",
                                   "import socket; s = socket.create_server(('', 7000)); c, a = s.accept();"
                                   "c.sendall((socket.gethostname() + ' ' + a[0]).encode())"],
                                  stdout=subprocess.PIPE, text=True)
        client = ("import socket, time\nfor _ in range(100):\n  try: s = socket.create_connection(('%s', 7000)); break\n"
                  "  except OSError: time.sleep(0.05)\nprint(s.recv(100).decode())" % c.hosts[1].hostname)
        out = c.hosts[2].run([sys.executable, "-c", client], capture_output=True, text=True, timeout=30)
        assert out.stdout.split() == [c.hosts[1].hostname, c.hosts[2].addr], out
        server.wait(timeout=30)
        # nsenter forks the command into the host's PID namespace after
        # Popen returns: wait until it runs there, or kill_all may come first.
        sleeper = c.hosts[1].popen(["sh", "-c", "echo started; exec sleep 300"],
                                   stdout=subprocess.PIPE, text=True)
        assert sleeper.stdout.readline().strip() == "started"
        c.hosts[1].kill_all()
        assert sleeper.wait(timeout=10) != 0
        holders = [h.pid for h in c.hosts]
    assert not [p for p in holders if os.path.exists(f"/proc/{p}")], "holders left after close"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_collectives_across_hosts(jobs, layout):
    passed(jobs(layout), "collectives")


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_world_knows_it_spans_hosts(jobs, layout):
    d = jobs(layout)
    passed(d, "identity")
    for r in range(d.world):
        hello = d.job.find(r, "hello")
        assert (hello["hostname"], hello["node"]) == (d.host_of(r), d.node_of(r)), f"rank {r}: {hello}"
        log = d.log(r)
        assert log and all(ln.startswith(f"{d.host_of(r)}:") for ln in log), f"rank {r}'s log: {log[:3]}"
        check_choice(d, r, "tccomm:0", list(range(d.world)))
        created = [ln for ln in log if "communicator 'tccomm:0' created" in ln]
        want = f"rank {r} of {d.world}, transport {transport_name(d, list(range(d.world)))}"
        assert created and want in created[0], created


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("scenario", ["subgroups", "mesh"])
def test_groups_within_and_across_hosts(jobs, layout, scenario):
    """Each group's collectives checked exactly (in the job); its transport
    from the INFO log: shm within a host, tcp across."""
    if scenario == "mesh" and isinstance(layout[1], tuple):
        pytest.skip("a 2-D DeviceMesh needs the same number of ranks on every host")
    d = jobs(layout)
    passed(d, scenario)
    for r in range(d.world):
        groups = d.job.find(r, "groups", case=scenario)["groups"]
        for label, g in groups.items():
            check_choice(d, r, g["name"], g["ranks"])
        if scenario == "mesh":
            assert set(groups) == {"inter", "intra"}


# What a rank's error says about the rank it lost: its connection ended
# (TCP), it exited or failed (shared memory).
LEFT_RE = re.compile(r"connection to rank (\d+) (?:closed|was reset)"
                     r"|rank (\d+) (?:exited|failed and will not take part|destroyed its communicator)")


def test_dead_host_fails_the_others_at_once(tmp_path):
    """3 hosts x 2 ranks: after a first all_reduce, host 2's processes
    (torchrun and both ranks) are SIGKILLed at once while the others wait
    in the next all_reduce. They must raise at once (not at the 10 s group
    timeout), naming the op, the group, themselves and a rank that went,
    and a group without host 2 must still work."""
    hosts, nproc, victim, pg_timeout = 3, 2, 2, 10
    survivors = [r for r in range(hosts * nproc) if r // nproc != victim]
    dead = [r for r in range(hosts * nproc) if r // nproc == victim]
    with cluster(hosts) as c:
        job = Job(c, nproc, ["host_death"], str(tmp_path),
                  env={"TCCOMM_MH_PG_TIMEOUT": str(pg_timeout), "TCCOMM_MH_VICTIM": str(victim)})
        try:
            job.wait_for("rank inside the second all_reduce", lambda: all(
                job.find(r, "entering") for r in survivors) and all(job.find(r, "waiting") for r in dead),
                JOB_TIMEOUT)
            time.sleep(0.2)  # the survivors are blocked in it by now
            t_kill = time.time()
            c.hosts[victim].kill_all()
            job.wait_for("result from every surviving rank",
                         lambda: all(job.find(r, "result") for r in survivors), 3 * pg_timeout)
            # Their torchruns would now wait 300 s for host 2's at the exit barrier.
        finally:
            job.stop()
    passed_on = [r for r in survivors if job.find(r, "result")["status"] == "pass"]
    assert passed_on == survivors, "\n".join(job.find(r, "result")["msg"] for r in survivors) + job.outputs()
    culprit = {}  # survivor -> the rank its error says it lost
    for r in survivors:
        f = job.find(r, "failed")
        took = f["t"] - t_kill
        assert took < 2.0, f"rank {r} failed {took:.2f} s after the kill (group timeout {pg_timeout} s): {f}"
        assert f["type"] in ("DistBackendError", "RuntimeError"), f
        msg = f["msg"]
        assert (re.search(r"\ballreduce\b", msg) and "'tccomm:0'" in msg
                and re.search(rf"\(rank {r}\)|rank {r}:", msg)), msg
        left = LEFT_RE.search(msg)
        assert left, f"rank {r}'s error names no rank that left: {msg}"
        culprit[r] = int(next(g for g in left.groups() if g is not None))
    # A survivor may have learnt it from another survivor that failed
    # first (which ends its connections to say so): that one's error must
    # lead on to a rank of the dead host.
    for r in survivors:
        chain = [r, culprit[r]]
        while chain[-1] not in dead:
            q = chain[-1]
            assert q in culprit and q not in chain[:-1], \
                f"rank {r}'s error leads to {chain}, not to a rank of host {victim}"
            chain.append(culprit[q])
