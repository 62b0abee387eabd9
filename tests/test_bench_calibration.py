"""bench_collectives.calibrated_iters, which both the torch.distributed sweep
and bench_mpi.py use to size their timed batches.

A simulated op stands in for the collectives: each timed run costs a fixed
skew (the ranks leaving the barrier before it at different times) plus a
steady time per iteration. The batch size must follow the steady time, not
the skew, and slow ops must not be run more than once to find that out.
"""

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_collectives  # noqa: E402  (imports no torch at module level)


def _args(max_iters=10**6, min_iters=3):
    # 0.25 s over 5 batches: 50 ms per batch, as the defaults give.
    return argparse.Namespace(time_per_point=0.25, samples=5, min_iters=min_iters, max_iters=max_iters)


class SimulatedOp:
    def __init__(self, skew_s, per_s):
        self.skew_s, self.per_s, self.runs = skew_s, per_s, []

    def __call__(self, n):
        self.runs.append(n)
        return (self.skew_s + n * self.per_s) / n


def test_batches_follow_the_steady_time_not_the_skew():
    op = SimulatedOp(skew_s=2e-3, per_s=20e-6)  # 2 ms skew, 20 us per call
    iters = bench_collectives.calibrated_iters(op, _args())
    steady = 0.05 / 20e-6  # 2500 calls fill a 50 ms batch
    assert 0.85 * steady <= iters <= steady, (iters, op.runs)
    # One call alone would have sized it by 2.02 ms: 24 calls.
    assert op.runs[:3] == [1, 2, 4] and all(b == 2 * a for a, b in zip(op.runs, op.runs[1:])), op.runs
    # The last run lasted a quarter of a batch or more, the one before less.
    last, before = op.runs[-1], op.runs[-2]
    assert op(last) * last >= 0.0125 > op(before) * before


def test_a_slow_op_runs_once():
    op = SimulatedOp(skew_s=1e-3, per_s=0.1)  # 100 ms per call
    assert bench_collectives.calibrated_iters(op, _args()) == 3  # --min-iters
    assert op.runs == [1]


@pytest.mark.parametrize("max_iters", [1, 16, 2000])
def test_max_iters_bounds_the_runs_and_the_batches(max_iters):
    op = SimulatedOp(skew_s=0.0, per_s=1e-7)  # 0.1 us per call
    iters = bench_collectives.calibrated_iters(op, _args(max_iters=max_iters, min_iters=1))
    assert iters == max_iters
    assert max(op.runs) <= max_iters
