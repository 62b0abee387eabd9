#!/usr/bin/env python3
"""The nccl-tests-style sweep of bench_collectives.py across simulated hosts.

Needs root: the hosts are network, UTS, mount and PID namespaces on this
machine (tests/_netns.py), joined by one switch whose links are shaped to
--rate with a token bucket (tc tbf; a rate, not a delay: tbf adds none).
Each host runs one torchrun (--nnodes, --node-rank) whose ranks are
bench_collectives.py workers, so every point is verified and timed exactly
as on one host, tccomm and gloo in the same processes. The report adds, per
point, busbw as a fraction of the link rate and, for allreduce, the time
against its lower bound across hosts: every host's link must carry
2(H-1)/H of the message each way (N bytes on 2 hosts), whatever the
algorithm.

    sudo .venv/bin/python bench/bench_hosts.py --hosts 2 --per-host 2 --rate 10gbit
    sudo .venv/bin/python bench/bench_hosts.py --per-host 1,3 --rate 10gbit   # uneven hosts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_collectives as bc  # noqa: E402


def rate_bytes_per_s(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"--rate {rate!r}: give it as tc does, e.g. 10gbit or 500mbit")


def run_job(args, raw: str) -> None:
    import _netns

    worker = [os.path.abspath(os.path.join(HERE, "bench_collectives.py")), "--worker", "--results", raw,
              "--backends", args.backends, "--ops", args.ops, "--dtype", args.dtype,
              "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
              "--warmup", str(args.warmup), "--time-per-point", str(args.time_per_point),
              "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters),
              "--samples", str(args.samples)]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with _netns.Cluster(args.hosts, rate=args.rate, burst=args.burst) as c:
        master = c.hosts[0].addr
        procs = []
        for h, host in enumerate(c.hosts):
            cmd = [torchrun, "--nnodes", str(args.hosts), "--node-rank", str(h), "--nproc-per-node",
                   str(args.ranks[h]), "--master-addr", master, "--master-port", "29511", *worker]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning",
                       TCCOMM_SOCKET_ADDR=host.addr)
            procs.append(host.popen(cmd, env=env))
        deadline = time.monotonic() + args.timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
            except Exception:
                for q in procs:
                    q.kill()
                raise SystemExit(f"the benchmark did not finish within {args.timeout} s")
    if any(codes):
        if os.path.exists(raw):
            os.remove(raw)
        raise SystemExit(f"a host's torchrun failed (exit codes {codes}); no results written")


def link_report(args, rows: list[dict]) -> None:
    link = rate_bytes_per_s(args.rate)
    print(f"\nagainst the link ({args.rate} per host, each way; {layout(args)}):")
    print(f"{'op':<15}{'bytes':>10}" + "".join(f"{b + ' us':>14}{'busbw/link':>12}" for b in args.backends.split(","))
          + f"{'tccomm/gloo':>13}{'allreduce bound':>17}")
    keyed = {(r["op"], r["bytes"], r["backend"]): r for r in rows}
    for op, nbytes in sorted({(r["op"], r["bytes"]) for r in rows}):
        line = f"{op:<15}{bc.human(nbytes):>10}"
        for b in args.backends.split(","):
            r = keyed.get((op, nbytes, b))
            line += f"{r['time_us']:>14.1f}{r['busbw_GBps'] * 1e9 / link:>12.2f}" if r else f"{'-':>14}{'-':>12}"
        t, g = keyed.get((op, nbytes, "tccomm")), keyed.get((op, nbytes, "gloo"))
        line += f"{g['time_us'] / t['time_us']:>12.2f}x" if t and g else f"{'-':>13}"
        # Every host's link carries 2(H-1)/H of the message each way at least
        # (N on 2 hosts), whatever the algorithm.
        if op == "allreduce" and t:
            bound_s = 2 * (args.hosts - 1) / args.hosts * nbytes / link
            line += f"{bound_s * 1e6 / t['time_us']:>16.0%}"
        print(line)


def layout(args) -> str:
    """The hosts and their ranks in words: "2 hosts x 2 ranks", "hosts of 1 + 3 ranks"."""
    if len(set(args.ranks)) == 1:
        return f"{args.hosts} hosts x {args.ranks[0]} ranks"
    return "hosts of " + " + ".join(map(str, args.ranks)) + " ranks"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", default="2",
                   help="ranks on every host, or one count per host (1,3: uneven hosts; sets --hosts)")
    p.add_argument("--rate", default="10gbit", help="every host's link, tc syntax (10gbit, 500mbit)")
    p.add_argument("--burst", default="256kb", help="the token bucket's burst (tc tbf)")
    p.add_argument("--backends", default="tccomm,gloo")
    bc.add_sweep_options(p)
    args = p.parse_args()
    args.ranks = [int(k) for k in args.per_host.split(",")]
    if len(args.ranks) > 1:
        args.hosts = len(args.ranks)
    else:
        args.ranks *= args.hosts
    if os.geteuid() != 0:
        raise SystemExit("simulated hosts need root (network namespaces)")
    if args.quick:
        args.max_bytes = min(args.max_bytes, 1 << 20)
        args.time_per_point = min(args.time_per_point, 0.05)
        args.warmup = min(args.warmup, 2)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "hosts" + ("x".join(map(str, [args.hosts, args.ranks[0]])) if len(set(args.ranks)) == 1
                                                 else "+".join(map(str, args.ranks))) + "_" + time.strftime("%Y%m%d-%H%M%S"))
    raw = stem + ".jsonl"
    print(f"== simulated {layout(args)}, links {args.rate}, {args.backends}, "
          f"{bc.human(args.min_bytes)} .. {bc.human(args.max_bytes)}", flush=True)
    t0 = time.monotonic()
    run_job(args, raw)
    rows = [json.loads(line) for line in open(raw)]
    os.remove(raw)
    args.device, args.worker = "cpu", False
    bc.report(args, rows, bc.memcpy_bandwidth(), stem)
    link_report(args, rows)
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
