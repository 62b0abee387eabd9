"""Concurrency: groups used from several threads at once, and processes
forked after init (DataLoader workers) that come and go while the group
stays usable.

c10d requires every rank to issue a group's ops in the same order. Each
case below makes that order well defined: either every thread has a group
of its own, or the threads take turns through a lock in a fixed order.
References are plain torch on every rank's recomputed inputs.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from _dist_ops import all_gather_tensor
from _reference import ref_reduce
from _registry import add
from _cases_coverage import GROUP_SPECS, SUITE

THREADS = 4
OPS_PER_THREAD = 6
THREAD_JOIN_S = 60.0  # bounded-hang detection only (below the harness's 75 s)


class _Threads:
    """Runs body(k) on THREADS threads. The values are checked after
    every thread has ended (a wrong value must not stop a thread half-way
    through its ops: the other ranks would wait on the rest). A thread that
    raises sets `stop`, so that threads waiting for their turn give up."""

    def __init__(self, what: str):
        self.what = what
        self.stop = threading.Event()
        self.errors: dict[int, BaseException] = {}
        self.checks: list = []  # (thread, check) in the order the ops were issued

    def run(self, body) -> None:
        def main(k):
            try:
                body(k)
            except BaseException as e:  # noqa: BLE001 - reported below
                self.errors[k] = e
                self.stop.set()

        threads = [threading.Thread(target=main, args=(k,), name=f"{self.what}-{k}",
                                    daemon=True) for k in range(THREADS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + THREAD_JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"{self.what}: threads {stuck} still running after {THREAD_JOIN_S:.0f} s"
        for k in sorted(self.errors):
            e = self.errors[k]
            raise AssertionError(f"{self.what}, thread {k}: {type(e).__name__}: {e}") from e
        for k, check in self.checks:
            try:
                check()
            except AssertionError as e:
                raise AssertionError(f"{self.what}, thread {k}: {e}") from None


def _thread_op(ctx, k: int, j: int, g, members: list[int]):
    """Op j of thread k on group g; returns (work, check)."""
    r = ctx.rank
    tag = f"t{k}o{j}"
    n = 100 + 37 * k + j
    if j % 3 == 0:  # integers: the sum is exact on every backend
        t = ctx.inp(r, n, "int64", tag=tag)
        w = dist.all_reduce(t, group=g, async_op=True)
        exp = ref_reduce([ctx.inp(q, n, "int64", tag=tag) for q in members], "int64", "SUM")
        return w, lambda: ctx.compare(t, exp, f"all_reduce {j}")
    if j % 3 == 1:
        root = members[(k + j) % len(members)]
        exp = ctx.inp(root, n, "int32", tag=tag)
        t = exp.clone() if r == root else ctx.garbage(n, "int32")
        w = dist.broadcast(t, src=root, group=g, async_op=True)
        return w, lambda: ctx.compare(t, exp, f"broadcast {j} from {root}")
    out = ctx.garbage(len(members) * n, "int64")
    w = all_gather_tensor(out, ctx.inp(r, n, "int64", tag=tag), group=g, async_op=True)
    exp = torch.cat([ctx.inp(q, n, "int64", tag=tag) for q in members])
    return w, lambda: ctx.compare(out, exp, f"all_gather_into_tensor {j}")


def c_threads_own_groups(ctx):
    """4 threads per rank, each with a group of its own over every rank
    (created in different member orders), issue async ops and wait on them
    concurrently with the other threads."""
    W = ctx.world
    orders = [list(range(W)), list(reversed(range(W))), list(range(1, W)) + [0],
              [W - 1] + list(range(W - 1))]
    groups = [dist.new_group(orders[k % len(orders)]) for k in range(THREADS)]
    members = list(range(W))

    threads = _Threads("threads with a group each")

    def thread(k):
        for j in range(OPS_PER_THREAD):
            w, check = _thread_op(ctx, k, j, groups[k], members)
            w.wait()
            threads.checks.append((k, check))

    try:
        threads.run(thread)
    finally:
        for g in groups:
            dist.destroy_process_group(g)
    ctx.check_usable(what="after the threads' groups were destroyed")


def c_threads_share_group(ctx):
    """4 threads per rank share the default group: they issue their ops
    through a lock in a fixed turn order (thread k issues its op j at turn
    j * 4 + k, so every rank issues the same sequence) and wait for them
    outside the lock, concurrently with each other's issuing."""
    members = list(range(ctx.world))
    cond = threading.Condition()
    turn = [0]

    threads = _Threads("threads sharing the default group")

    def thread(k):
        pending = []
        for j in range(OPS_PER_THREAD):
            with cond:
                my_turn = j * THREADS + k
                cond.wait_for(lambda: turn[0] == my_turn or threads.stop.is_set(),
                              timeout=THREAD_JOIN_S)
                if turn[0] != my_turn:
                    why = ": another thread failed" if threads.stop.is_set() else ""
                    raise RuntimeError(f"gave up waiting for turn {my_turn} "
                                       f"(turn is {turn[0]}{why})")
                pending.append(_thread_op(ctx, k, j, None, members))
                turn[0] += 1
                cond.notify_all()
            if j % 2 == 1:  # wait for some right away, for the others at the end
                for w, check in pending:
                    w.wait()
                    threads.checks.append((k, check))
                pending.clear()
        for w, check in pending:
            w.wait()
            threads.checks.append((k, check))

    def thread_or_stop(k):
        try:
            thread(k)
        except BaseException:
            threads.stop.set()
            raise
        finally:
            with cond:  # a failed thread wakes the others (they see `stop`)
                cond.notify_all()

    threads.run(thread_or_stop)
    ctx.check_usable(what="after the threads")


# --------------------------------------------------------------------------
# fork after init
# --------------------------------------------------------------------------

class RankSquares(torch.utils.data.Dataset):
    """Item i of rank r: (i * i + 1000 * r) four times; `exit_at` makes the
    worker that loads that item exit on the spot."""

    def __init__(self, rank: int, n: int, exit_at: int | None = None):
        self.rank, self.n, self.exit_at = rank, n, exit_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.exit_at:
            os._exit(7)
        info = torch.utils.data.get_worker_info()
        return (torch.full((4,), float(i * i + 1000 * self.rank), dtype=torch.float64),
                torch.tensor(info.id if info is not None else -1))


CHILD_EXIT_S = 30.0  # bounded-hang detection only


def _wait_child(pid: int, limit_s: float):
    """The exit code of child `pid`; kills it and fails if it is still
    running after limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} still running {limit_s:.0f} s after it began "
                         "to exit (killed)")


def _loader(ds, workers: int = 2):
    return torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers,
                                       multiprocessing_context="fork")


def c_fork_dataloader(ctx):
    """A DataLoader with 2 fork workers, created after init: iterated fully
    with an all_reduce of every batch while the workers live; then the
    workers are gone and collectives still work. A worker that exits
    unexpectedly fails the DataLoader only; the group stays usable. A child
    forked after init that ends the way a program ends (exit handlers,
    static destructors) leaves its parent's group alone."""
    W, r = ctx.world, ctx.rank
    n = 22
    workers_seen = set()
    for b, (x, wid) in enumerate(_loader(RankSquares(r, n))):
        idx = torch.arange(4 * b, min(4 * b + 4, n), dtype=torch.float64)
        ctx.compare(x, (idx * idx + 1000 * r).unsqueeze(1).expand(-1, 4).contiguous(),
                    f"batch {b} from the DataLoader")
        workers_seen.update(wid.tolist())
        total = x.clone()
        dist.all_reduce(total)
        ctx.compare(total, (W * idx * idx + 1000 * sum(range(W))).unsqueeze(1)
                    .expand(-1, 4).contiguous(), f"all_reduce of batch {b} while workers live")
    assert workers_seen == {0, 1}, f"batches came from workers {sorted(workers_seen)}"
    ctx.check_usable(what="after the DataLoader's workers exited")

    # a worker that exits in the middle of an epoch, at its first item. One
    # worker, and nothing sent before it exits: a batch it had sent would
    # carry its tensor as a descriptor fetched from the worker on receipt,
    # which fails (EOFError) once the worker is gone; and while the failed
    # worker is registered with torch's SIGCHLD handler, the handler raises
    # on any child's exit (a second worker's at shutdown) wherever this
    # process happens to be. So the only SIGCHLD is the failed worker's
    # own, which lands in the loop, where its batch is awaited; the
    # shutdown then unregisters it before the fork below.
    epoch = iter(_loader(RankSquares(r, n, exit_at=0), workers=1))
    try:
        for _ in epoch:
            pass
    except RuntimeError as e:
        assert "exited unexpectedly" in str(e), \
            f"the DataLoader failed, but not on its worker's exit: {e}"
    else:
        raise AssertionError("a DataLoader worker called os._exit, yet the epoch completed")
    epoch._shutdown_workers()  # now, not whenever a collection frees it
    del epoch
    ctx.check_usable(what="after a DataLoader worker exited unexpectedly")

    # a child that ends the way a program ends: Python's exit handlers, then
    # the C library's exit (C atexit handlers, static destructors of torch
    # and of the extension), without the parent's cases running in it
    pid = os.fork()
    if pid == 0:
        try:
            atexit._run_exitfuncs()
            ctypes.CDLL(None).exit(0)
        finally:
            os._exit(1)
    status = _wait_child(pid, CHILD_EXIT_S)
    assert status == 0, f"forked child running the exit handlers ended with status {status}"
    ctx.check_usable(what="after a forked child ran the exit handlers")
    xs = [ctx.inp(q, 4099, "int32") for q in range(W)]
    outs = [ctx.garbage(4099, "int32") for _ in range(W)]
    dist.all_gather(outs, xs[r])
    for q in range(W):
        ctx.compare(outs[q], xs[q], f"all_gather[{q}] after the forked children")


def _register():
    add("threads-own_group_each", SUITE, c_threads_own_groups, specs=GROUP_SPECS)
    add("threads-share_group_in_turns", SUITE, c_threads_share_group, specs=GROUP_SPECS)
    add("fork-dataloader_workers", SUITE, c_fork_dataloader, specs=GROUP_SPECS)


_register()
