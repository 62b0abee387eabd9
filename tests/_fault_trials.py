"""Fault injection: groups of 2-4 ranks run a mixed workload (collectives of
several sizes, point-to-point, a subgroup) and one random rank goes away at a
random point: SIGKILLed, os._exit()ed, or it destroys its process group and
stays alive. Every survivor must raise within LIMIT_S seconds (the group's
timeout is 60 s), no process may hang, and no tccomm file may be left in
/dev/shm once all processes have exited.

    python tests/_fault_trials.py --transport shm --trials 50 --seed 1

prints one JSON line per trial and a summary line; the exit code is nonzero
if any trial failed. Ranks are forked from this process after torch is
imported once, so a trial costs a fraction of a second, not an interpreter
start per rank. tests/test_fault_injection.py runs a seeded part of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import select
import signal
import socket
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LIMIT_S = 2.0          # a survivor must raise within this after the fault
PG_TIMEOUT_S = 60.0    # the group's own timeout: far longer than LIMIT_S
TRIAL_DEADLINE_S = 30.0  # a trial still running after this has a hung rank
MODES = ("sigkill", "exit", "destroy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload_step(it: int, rank: int, world: int, sub) -> None:
    """One iteration; every rank issues the same ops in the same order."""
    small = torch.full((8,), float(rank + 1))
    dist.all_reduce(small)
    assert small[0].item() == world * (world + 1) / 2, small
    big = torch.full((1 << 18,), float(rank))  # 1 MiB: more than one shm window
    dist.all_reduce(big)
    root = it % world
    # 1 MiB to one root: the pipelined reduce, whose ranks do not all
    # need each other's results.
    r = torch.full((1 << 18,), float(rank))
    dist.reduce(r, dst=root)
    assert rank != root or r[-1].item() == world * (world - 1) / 2, r
    b = torch.full((1000,), float(rank))
    dist.broadcast(b, src=root)
    assert b[0].item() == root
    out = torch.empty(world * 64)
    dist.all_gather_into_tensor(out, torch.full((64,), float(rank)))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(4096)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4096,), float(rank)), nxt),
                                   dist.P2POp(dist.irecv, got, prv)])
    for q in reqs:
        q.wait()
    assert got[0].item() == prv
    if sub is not None:
        s = torch.ones(16)
        dist.all_reduce(s, group=sub)
    if it % 3 == 0:
        dist.barrier()


def rank_main(rank: int, world: int, port: int, transport: str, pipe_w: int,
              victim: int, mode: str, fault_after: int) -> None:
    os.environ["TCCOMM_TRANSPORT"] = transport
    out = os.fdopen(pipe_w, "w", buffering=1)

    def report(**kw):
        out.write(json.dumps({"rank": rank, **kw}) + "\n")

    try:
        dist.init_process_group("tccomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        sub_ranks = list(range(world - 1)) if world > 2 else [0, 1]
        sub = dist.new_group(sub_ranks)
        my_sub = sub if rank in sub_ranks else None
        workload_step(0, rank, world, my_sub)
        report(event="ready")
        it = 1
        while True:
            if rank == victim and mode != "sigkill" and it == fault_after:
                report(event="fault", t=time.time())
                if mode == "exit":
                    os._exit(3)
                dist.destroy_process_group()
                out.close()  # done reporting: the trial does not wait for this rank
                time.sleep(LIMIT_S + 1)  # alive, but out of the group, while the others notice
                os._exit(0)
            workload_step(it, rank, world, my_sub)
            it += 1
    except Exception as e:  # noqa: BLE001 - what the survivors must see
        report(event="raised", t=time.time(), msg=f"{type(e).__name__}: {e}"[:2000])
        os._exit(0)


def tccomm_shm_files() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("tccomm")}
    except FileNotFoundError:
        return set()


def run_trial(k: int, rng: random.Random, transport: str) -> dict:
    world = rng.choice((2, 3, 4))
    victim = rng.randrange(world)
    mode = rng.choice(MODES)
    fault_after = rng.randrange(1, 40)       # iteration at which exit/destroy happens
    kill_delay = rng.uniform(0.0, 0.5)       # SIGKILL this long after every rank is ready
    port = free_port()
    shm_before = tccomm_shm_files()
    pipes, pids = [], []
    for r in range(world):
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rd)
            try:
                rank_main(r, world, port, transport, wr, victim, mode, fault_after)
            finally:
                os._exit(1)
        os.close(wr)
        pipes.append(os.fdopen(rd))
        pids.append(pid)
    events: dict[int, list[dict]] = {r: [] for r in range(world)}
    fault_t = None
    start = time.time()
    open_pipes = {p.fileno(): (r, p) for r, p in enumerate(pipes)}
    ready = set()
    while open_pipes and time.time() - start < TRIAL_DEADLINE_S:
        rl, _, _ = select.select(list(open_pipes), [], [], 0.02)
        for fd in rl:
            r, p = open_pipes[fd]
            line = p.readline()
            if not line:
                del open_pipes[fd]
                continue
            ev = json.loads(line)
            events[r].append(ev)
            if ev["event"] == "ready":
                ready.add(r)
            if ev["event"] == "fault":
                fault_t = ev["t"]
        if mode == "sigkill" and fault_t is None and len(ready) == world:
            time.sleep(kill_delay)
            os.kill(pids[victim], signal.SIGKILL)
            fault_t = time.time()
    hung = []
    for r, pid in enumerate(pids):
        if open_pipes and any(rr == r for rr, _ in open_pipes.values()):
            hung.append(r)
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    for p in pipes:
        p.close()
    leftover = sorted(tccomm_shm_files() - shm_before)
    res = {"trial": k, "transport": transport, "world": world, "victim": victim, "mode": mode,
           "errors": []}
    if fault_t is None:
        res["errors"].append(f"the fault never happened (ready: {sorted(ready)}, "
                             f"events: {events})")
    if hung:
        res["errors"].append(f"rank(s) {hung} still running {TRIAL_DEADLINE_S:.0f} s after the start")
    for r in range(world):
        if r == victim:
            continue
        raised = [e for e in events[r] if e["event"] == "raised"]
        if not raised:
            if r not in hung:
                res["errors"].append(f"rank {r} ended without raising: {events[r]}")
            continue
        ev = raised[0]
        if fault_t is not None:
            dt = ev["t"] - fault_t
            res.setdefault("latency", {})[r] = round(dt, 3)
            if dt > LIMIT_S:
                res["errors"].append(f"rank {r} raised {dt:.2f} s after the fault: {ev['msg'][:300]}")
        res.setdefault("msgs", {})[r] = ev["msg"][:300]
    # Someone must have named the rank that went away and said why.
    why = "destroyed" if mode == "destroy" else "exited"
    if fault_t is not None and not any(
            f"rank {victim} " in m and why in m for m in res.get("msgs", {}).values()):
        res["errors"].append(f"no survivor's error names rank {victim} as {why}: {res.get('msgs')}")
    if leftover:
        res["errors"].append(f"left in /dev/shm: {leftover}")
        for f in leftover:
            try:
                os.unlink(os.path.join("/dev/shm", f))
            except OSError:
                pass
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", choices=("shm", "tcp"), required=True)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(f"{args.seed}-{args.transport}")
    failed, worst = 0, 0.0
    for k in range(args.trials):
        res = run_trial(k, rng, args.transport)
        worst = max([worst, *res.get("latency", {}).values()])
        failed += bool(res["errors"])
        print(json.dumps(res), flush=True)
    print(json.dumps({"summary": True, "transport": args.transport, "trials": args.trials,
                      "failed": failed, "worst_latency_s": round(worst, 3)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
