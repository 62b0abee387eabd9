"""bench/cpu_gaps.py: a spinner stopped from outside for 30 ms (SIGSTOP,
then SIGCONT) must count that gap in every band and report it as its
longest; the command prints one line per CPU asked for and refuses a CPU
this process may not use. No rate of the machine's own gaps is judged."""

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import cpu_gaps  # noqa: E402

LINE = re.compile(r"cpu (\d+): [\d.]+ s, gaps >0.1 ms (\d+) \([\d.]+/s\), >0.3 ms (\d+) \([\d.]+/s\), "
                  r">1 ms (\d+) \([\d.]+/s\); longest ([\d.]+) ms; [\d.]+% of the time lost in gaps")


def test_a_stopped_spinner_counts_the_gap():
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    cpu = min(os.sched_getaffinity(0))
    started = ctx.Event()
    proc = ctx.Process(target=cpu_gaps.spin, args=(cpu, 1.0, out, started))
    proc.start()
    assert started.wait(timeout=30)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.03)
    os.kill(proc.pid, signal.SIGCONT)
    got_cpu, elapsed, counts, lost, longest = out.get(timeout=30)
    proc.join(timeout=30)
    assert got_cpu == cpu and elapsed >= 1.0
    assert all(n >= 1 for n in counts), counts
    assert counts[0] >= counts[1] >= counts[2]
    assert 0.03 <= longest < 30 and lost >= longest, (longest, lost)


def test_one_line_per_cpu_and_a_cpu_out_of_reach_refused():
    allowed = sorted(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "cpu_gaps.py"), "--seconds", "0.2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [LINE.fullmatch(line) for line in proc.stdout.splitlines()]
    assert all(lines) and [int(m.group(1)) for m in lines] == allowed, proc.stdout
    for m in lines:
        over_01, over_03, over_1 = (int(m.group(i)) for i in (2, 3, 4))
        assert over_01 >= over_03 >= over_1, m.group(0)
    outside = max(allowed) + 1
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "cpu_gaps.py"), "--seconds", "0.1", "--cpus",
                           str(outside)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"CPU(s) [{outside}] are not among" in proc.stderr, proc.stderr[-2000:]
