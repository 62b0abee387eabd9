"""One rank of a multi-host job (tests/test_multihost.py), started by torchrun
on a simulated host (tests/_netns.py):

    _multihost_job.py OUT_DIR SCENARIO [SCENARIO...]

Runs the scenarios in order on one tccomm world and reports events as JSON
lines in OUT_DIR/rank<R>.jsonl (tests/_rank.py): first
{"event": "hello", ...} (where this rank runs), then per scenario "start",
its own events and "result" (pass or fail with the reason). Every result is
checked here against a reference computed from the inputs every rank can
recompute; the parent checks the rest (hostnames, the debug logs, timing).

Ranks are laid out as torchrun lays them out: host k (GROUP_RANK) runs the
next LOCAL_WORLD_SIZE global ranks after those of hosts 0 .. k-1. Every
host's count comes from TCCOMM_MH_LAYOUT ("3,2": hosts of 3 and 2 ranks).
Environment: TCCOMM_MH_PG_TIMEOUT (seconds, the world's timeout; default 60),
TCCOMM_MH_VICTIM (the host whose processes the parent kills in "host_death").
"""

import datetime
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

import _rank

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
LAYOUT = [int(k) for k in os.environ["TCCOMM_MH_LAYOUT"].split(",")]
NODE, HOSTS = int(os.environ["GROUP_RANK"]), len(LAYOUT)
P = LAYOUT[NODE]
assert P == int(os.environ["LOCAL_WORLD_SIZE"]) and sum(LAYOUT) == WORLD, (LAYOUT, WORLD)
UNIFORM = len(set(LAYOUT)) == 1


def ranks_of(k: int) -> list[int]:
    """The global ranks of host k."""
    first = sum(LAYOUT[:k])
    return list(range(first, first + LAYOUT[k]))


def host_of(r: int) -> int:
    return next(k for k in range(HOSTS) if r in ranks_of(k))


def inp(r: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank r's input: small integers, exact in float32, distinct per rank."""
    return ((torch.arange(n, dtype=torch.int64) * (r + 1) + 100 * r + salt) % 100003).to(dtype)


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].flatten().tolist() if got.shape == want.shape else "shape"
        raise AssertionError(f"{what}: wrong result on rank {RANK} (first bad indices {bad}): "
                             f"got {got.flatten()[:8].tolist()} ... want {want.flatten()[:8].tolist()} ...")


def name_of(pg) -> str:
    """The name tccomm gives the communicator of `pg` (torchcomm_backend/_create.py)."""
    return f"tccomm:{pg.group_name}"


# ---------------------------------------------------------------------------
# scenarios: each takes the event sink, returns when its checks passed
# ---------------------------------------------------------------------------

def collectives(ev) -> None:
    """Every c10d collective and send/recv on the world, checked exactly."""
    W, r = WORLD, RANK
    for n in (7, 300_003):  # one message and one that TCP sends in many pieces
        t = inp(r, n)
        dist.all_reduce(t)
        check(f"all_reduce SUM n={n}", t, sum(inp(q, n) for q in range(W)))
    for n in (1001, 30_001):  # flat, and hierarchical where hosts hold several ranks
        t = (inp(r, n, torch.int64) % 17) - r
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check(f"all_reduce MAX int64 n={n}", t, torch.stack([(inp(q, n, torch.int64) % 17) - q for q in range(W)]).amax(0))

    # float16/bfloat16 sums: the float32 sum in the hierarchical order (each
    # host's ranks in rank order, then the hosts), rounded once. Fractions
    # make any second rounding show; 80 KB is a hierarchical size.
    for dtype in (torch.bfloat16, torch.float16):
        n = 40_001

        def frac(q):
            return ((inp(q, n) % 1000) / 7.0 + q / 3.0).to(dtype)

        t = frac(r)
        dist.all_reduce(t)
        host_sums = [sum(frac(q).float() for q in ranks_of(k)) for k in range(HOSTS)]
        check(f"all_reduce SUM {dtype} n={n}", t, sum(host_sums).to(dtype))

    for n in (513, 100_001):
        for src in sorted({W - 1, 1 % W}):  # the last rank, and one that leads no host
            t = inp(r, n)
            dist.broadcast(t, src=src)
            check(f"broadcast n={n} from {src}", t, inp(src, n))

    t = inp(r, 257, torch.int64)
    dist.reduce(t, dst=1)
    if r == 1:
        check("reduce", t, sum(inp(q, 257, torch.int64) for q in range(W)))

    outs = [torch.empty(65) for _ in range(W)]
    dist.all_gather(outs, inp(r, 65))
    check("all_gather", torch.stack(outs), torch.stack([inp(q, 65) for q in range(W)]))

    out = torch.empty(W * 33, dtype=torch.int64)
    dist.all_gather_into_tensor(out, inp(r, 33, torch.int64))
    check("all_gather_into_tensor", out, torch.cat([inp(q, 33, torch.int64) for q in range(W)]))

    for n in (41, 120_001):  # flat, and hierarchical (2.9 MB of input at 6 ranks, 2.4 MB at 5)
        out = torch.empty(n, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, inp(r, W * n, torch.int64))
        check(f"reduce_scatter_tensor n={n}", out, sum(inp(q, W * n, torch.int64) for q in range(W))[r * n:(r + 1) * n])
    out = torch.empty(W * 110_003)  # hierarchical from 2 MiB of output on uneven hosts
    dist.all_gather_into_tensor(out, inp(r, 110_003))
    check("all_gather_into_tensor n=110003", out, torch.cat([inp(q, 110_003) for q in range(W)]))

    # Uneven all_to_all: rank a sends split(a, b) elements to rank b, valued a*1000 + b*100 + i.
    def split(a, b):
        return (a + 2 * b) % 3 + 1

    def chunk(a, b):
        return torch.arange(split(a, b), dtype=torch.int64) + a * 1000 + b * 100

    send = torch.cat([chunk(r, b) for b in range(W)])
    recv = torch.empty(sum(split(a, r) for a in range(W)), dtype=torch.int64)
    dist.all_to_all_single(recv, send, output_split_sizes=[split(a, r) for a in range(W)],
                           input_split_sizes=[split(r, b) for b in range(W)])
    check("all_to_all_single (uneven)", recv, torch.cat([chunk(a, r) for a in range(W)]))

    gl = [torch.empty(9, dtype=torch.int64) for _ in range(W)] if r == W - 1 else None
    dist.gather(inp(r, 9, torch.int64), gl, dst=W - 1)
    if r == W - 1:
        check("gather", torch.stack(gl), torch.stack([inp(q, 9, torch.int64) for q in range(W)]))

    t = torch.empty(11)
    dist.scatter(t, [inp(q, 11, salt=7) for q in range(W)] if r == 0 else None, src=0)
    check("scatter", t, inp(r, 11, salt=7))

    dist.barrier()

    # A ring: every pair (r, r+1) sends, crossing hosts at each host boundary.
    nxt, prv = (r + 1) % W, (r - 1) % W
    req = dist.isend(inp(r, 20_001, salt=3), nxt, tag=5)
    t = torch.empty(20_001)
    dist.recv(t, prv, tag=5)
    req.wait()
    check(f"send/recv from rank {prv}", t, inp(prv, 20_001, salt=3))


def identity(ev) -> None:
    """Where every rank runs, as the ranks see it (the parent checks the names)."""
    where = [None] * WORLD
    dist.all_gather_object(where, (socket.gethostname(), NODE))
    for q, (host, node) in enumerate(where):
        assert node == host_of(q), f"rank {q} runs on host {node}, expected {host_of(q)}"
    names = {host for host, _ in where}
    assert len(names) == HOSTS, f"{HOSTS} hosts but {len(names)} host names: {where}"
    ev.emit(event="identity", ranks_hosts=[h for h, _ in where], group=name_of(dist.group.WORLD))


def _check_group(label: str, pg, members: list[int]) -> None:
    """all_reduce, broadcast from the last member and all_gather on `pg`."""
    n = len(members)
    t = inp(RANK, 129, torch.int64)
    dist.all_reduce(t, group=pg)
    check(f"{label}: all_reduce", t, sum(inp(q, 129, torch.int64) for q in members))
    t = inp(RANK, 31)
    dist.broadcast(t, group_src=n - 1, group=pg)
    check(f"{label}: broadcast", t, inp(members[-1], 31))
    outs = [torch.empty(17) for _ in range(n)]
    dist.all_gather(outs, inp(RANK, 17), group=pg)
    check(f"{label}: all_gather", torch.stack(outs), torch.stack([inp(q, 17) for q in members]))


def subgroups(ev) -> None:
    """A group per host, one of every host's first rank, one mixing both."""
    groups = {f"host{k}": ranks_of(k) for k in range(HOSTS)}
    groups["leaders"] = [ranks_of(k)[0] for k in range(HOSTS)]
    groups["mixed"] = sorted({0, 1, WORLD - 1})
    made = {label: dist.new_group(ranks) for label, ranks in groups.items()}  # every rank, same order
    mine = {}
    for label, ranks in groups.items():
        if RANK in ranks:
            _check_group(label, made[label], ranks)
            mine[label] = {"ranks": ranks, "name": name_of(made[label])}
    ev.emit(event="groups", case="subgroups", groups=mine)


def mesh(ev) -> None:
    """A 2-D DeviceMesh (hosts x ranks per host): each dimension's group."""
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh("cpu", (HOSTS, P), mesh_dim_names=("inter", "intra"))
    mine = {}
    for dim in ("inter", "intra"):
        pg = m.get_group(dim)
        members = dist.get_process_group_ranks(pg)
        want = ([q for q in range(WORLD) if q % P == RANK % P] if dim == "inter"
                else list(range(NODE * P, (NODE + 1) * P)))
        assert members == want, f"mesh dim {dim}: ranks {members}, expected {want}"
        t = inp(RANK, 1025, salt=11)
        dist.all_reduce(t, group=pg)
        check(f"mesh {dim}: all_reduce", t, sum(inp(q, 1025, salt=11) for q in members))
        mine[dim] = {"ranks": members, "name": name_of(pg)}
    ev.emit(event="groups", case="mesh", groups=mine)


def host_death(ev) -> None:
    """One all_reduce, then the ranks of the victim host wait to be killed
    (the parent kills them once every other rank is inside the next
    all_reduce): that one must fail, saying so, and a group without the
    victim must keep working."""
    victim = int(os.environ["TCCOMM_MH_VICTIM"])
    survivors = [q for q in range(WORLD) if host_of(q) != victim]
    spared = dist.new_group(survivors)
    t = inp(RANK, 1000)
    dist.all_reduce(t)
    check("all_reduce before the kill", t, sum(inp(q, 1000) for q in range(WORLD)))
    if NODE == victim:
        ev.emit(event="waiting")
        time.sleep(600)  # the parent kills this host
        raise AssertionError("the victim host was not killed")
    ev.emit(event="entering", t=time.time())
    t = inp(RANK, 1000)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        ev.emit(event="failed", t=time.time(), type=type(e).__name__, msg=str(e))
    else:
        raise AssertionError("all_reduce completed although a host was dead")
    t = inp(RANK, 1000)
    dist.all_reduce(t, group=spared)
    check("all_reduce among the survivors", t, sum(inp(q, 1000) for q in survivors))


SCENARIOS = {f.__name__: f for f in (collectives, identity, subgroups, mesh, host_death)}


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    _rank.enable_stack_dumps()
    ev = _rank.Events(out_dir, RANK)
    timeout = datetime.timedelta(seconds=float(os.environ.get("TCCOMM_MH_PG_TIMEOUT", "60")))
    dist.init_process_group("tccomm", timeout=timeout)
    ev.emit(event="hello", hostname=socket.gethostname(), pid=os.getpid(), node=NODE)
    ok = True
    for name in names:
        ev.emit(event="start", case=name, t=time.time())
        status, msg = "pass", ""
        try:
            SCENARIOS[name](ev)
        except Exception as e:  # noqa: BLE001
            status, msg, ok = "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}", False
        ev.emit(event="result", case=name, status=status, msg=msg)
    if "host_death" in names:  # the world is broken: leave without the teardown
        _rank.leave_now(0 if ok else 1)
    dist.destroy_process_group()
    ev.emit(event="done")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
