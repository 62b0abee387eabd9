"""How often this machine takes a CPU away from a running process, and for
how long: one process per CPU, each bound to its CPU, reads the clock in a
tight loop and counts the gaps between two reads longer than 0.1, 0.3 and
1 ms. Nothing else of the program runs meanwhile, so a gap is time the CPU
spent elsewhere: another task, an interrupt, or (in a virtual machine) the
host running something else on that CPU.

    python bench/cpu_gaps.py                 # every CPU this process may use, 10 s
    python bench/cpu_gaps.py --seconds 30 --cpus 0,1

A large collective needs every rank's CPU for the whole call: a gap on any
of them stops all of them (they wait for the one that stopped), so these
rates bound how steady such calls can be (bench/README, "Steadiness of
large all_reduces").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

THRESHOLDS_S = (100e-6, 300e-6, 1e-3)


def spin(cpu: int, seconds: float, out: "mp.Queue", started: "mp.Event | None" = None) -> None:
    os.sched_setaffinity(0, {cpu})
    clock = time.perf_counter
    counts = [0] * len(THRESHOLDS_S)
    lost = longest = 0.0
    start = last = clock()
    end = start + seconds
    if started is not None:
        started.set()
    while True:
        now = clock()
        gap = now - last
        last = now
        if gap > THRESHOLDS_S[0]:
            lost += gap
            longest = max(longest, gap)
            for i, threshold in enumerate(THRESHOLDS_S):
                counts[i] += gap > threshold
        if now >= end:
            break
    out.put((cpu, now - start, counts, lost, longest))


def measure(cpus: list[int], seconds: float) -> list[tuple]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=spin, args=(cpu, seconds, out)) for cpu in cpus]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    return sorted(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--cpus", default=None, help="comma-separated CPUs (default: every CPU this process may use)")
    a = p.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else allowed
    refused = [c for c in cpus if c not in allowed]
    if refused:
        raise SystemExit(f"cpu_gaps: CPU(s) {refused} are not among those this process may use ({allowed})")
    for cpu, elapsed, counts, lost, longest in measure(cpus, a.seconds):
        rates = ", ".join(f">{t * 1e3:g} ms {n} ({n / elapsed:.1f}/s)" for t, n in zip(THRESHOLDS_S, counts))
        print(f"cpu {cpu}: {elapsed:.1f} s, gaps {rates}; longest {longest * 1e3:.2f} ms; "
              f"{lost / elapsed:.2%} of the time lost in gaps", flush=True)


if __name__ == "__main__":
    main()
