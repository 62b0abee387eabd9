"""Cases of the TorchComm-style API tests, run inside every rank of a group
spawned by tests/test_torchcomm_api.py (through tests/_tc_worker.py).

A case is fn(comm, rank, size) run on every rank in order; it passes by
returning, skips by raising Skip and fails otherwise. Every expected value is
computed with plain torch from inputs that each rank can recompute for any
other rank (inputs(r) below), never with the API under test.
"""

import datetime
import time
import warnings

import torch
import torch.distributed as dist

import torchcomm_backend as tc

CASES = []  # (name, fn) in run order


class Skip(Exception):
    pass


def case(fn):
    CASES.append((fn.__name__, fn))
    return fn


def inputs(r, n=6, dtype=torch.float32):
    """Rank r's input: exact in every dtype used here."""
    return (torch.arange(n) % 5 + r + 1).to(dtype)


def check(got, want, what):
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


def run_both(fn):
    """Runs fn(async_op) for sync then async."""
    for async_op in (False, True):
        fn(async_op)


def finish(work, async_op):
    assert isinstance(work, tc.TorchWork)
    if async_op:
        work.wait()
    assert work.is_completed()


# ---- collectives ---------------------------------------------------------------

REFS = {
    "SUM": lambda xs: torch.stack(xs).sum(0),
    "PRODUCT": lambda xs: torch.stack(xs).prod(0),
    "MIN": lambda xs: torch.stack(xs).amin(0),
    "MAX": lambda xs: torch.stack(xs).amax(0),
    "BAND": lambda xs: _fold(xs, torch.bitwise_and),
    "BOR": lambda xs: _fold(xs, torch.bitwise_or),
    "BXOR": lambda xs: _fold(xs, torch.bitwise_xor),
}


def _fold(xs, f):
    out = xs[0].clone()
    for x in xs[1:]:
        out = f(out, x)
    return out


@case
def rank_and_size(comm, rank, size):
    assert comm.get_rank() == rank and comm.get_size() == size
    assert comm.get_backend() == "tccomm"


@case
def all_reduce_every_op(comm, rank, size):
    for name, ref in REFS.items():
        dtype = torch.int32 if name.startswith("B") else torch.float64
        want = ref([inputs(r, dtype=dtype) for r in range(size)])

        def go(async_op, name=name, dtype=dtype, want=want):
            t = inputs(rank, dtype=dtype)
            finish(comm.all_reduce(t, getattr(tc.ReduceOp, name), async_op=async_op), async_op)
            check(t, want, f"all_reduce {name} async={async_op}")
        run_both(go)
    t = inputs(rank, dtype=torch.float64)
    comm.all_reduce(t, tc.ReduceOp.AVG, async_op=False)
    check(t, torch.stack([inputs(r, dtype=torch.float64) for r in range(size)]).mean(0), "AVG")
    t = inputs(rank, dtype=torch.float64)
    comm.all_reduce(t, tc.ReduceOp.PREMUL_SUM(0.5), async_op=False)
    check(t, sum(inputs(r, dtype=torch.float64) * 0.5 for r in range(size)), "PREMUL_SUM(0.5)")


@case
def reduce_and_broadcast(comm, rank, size):
    root = size - 1

    def go(async_op):
        t = inputs(rank)
        finish(comm.reduce(t, root, tc.ReduceOp.MAX, async_op=async_op), async_op)
        if rank == root:
            check(t, torch.stack([inputs(r) for r in range(size)]).amax(0), "reduce MAX")
        b = inputs(rank) * 10
        finish(comm.broadcast(b, 1, async_op=async_op), async_op)
        check(b, inputs(1) * 10, "broadcast from 1")
    run_both(go)


@case
def all_gathers(comm, rank, size):
    def go(async_op):
        outs = [torch.empty(6) for _ in range(size)]
        finish(comm.all_gather(outs, inputs(rank), async_op=async_op), async_op)
        for r in range(size):
            check(outs[r], inputs(r), f"all_gather from {r}")
        out = torch.empty(size * 6)
        finish(comm.all_gather_single(out, inputs(rank), async_op=async_op), async_op)
        check(out, torch.cat([inputs(r) for r in range(size)]), "all_gather_single")
    run_both(go)


@case
def reduce_scatters(comm, rank, size):
    # Rank r's input for destination j: inputs(r * size + j).
    def go(async_op):
        ins = [inputs(rank * size + j) for j in range(size)]
        want = torch.stack([inputs(r * size + rank) for r in range(size)]).sum(0)
        out = torch.empty(6)
        finish(comm.reduce_scatter(out, ins, tc.ReduceOp.SUM, async_op=async_op), async_op)
        check(out, want, "reduce_scatter")
        out = torch.empty(6)
        finish(comm.reduce_scatter_single(out, torch.cat(ins), tc.ReduceOp.SUM, async_op=async_op), async_op)
        check(out, want, "reduce_scatter_single")
    run_both(go)


@case
def all_to_alls(comm, rank, size):
    def go(async_op):
        inp = torch.cat([inputs(rank * size + j, 2) for j in range(size)])
        out = torch.empty(2 * size)
        finish(comm.all_to_all_single(out, inp, async_op=async_op), async_op)
        check(out, torch.cat([inputs(r * size + rank, 2) for r in range(size)]), "all_to_all_single")
        outs = [torch.empty(3) for _ in range(size)]
        ins = [inputs(rank * size + j, 3) for j in range(size)]
        finish(comm.all_to_all(outs, ins, async_op=async_op), async_op)
        for r in range(size):
            check(outs[r], inputs(r * size + rank, 3), f"all_to_all from {r}")
        # Rank r sends r + j + 1 rows of 2 to rank j.
        rows = lambda r, j: r + j + 1  # noqa: E731
        in_splits = [rows(rank, j) for j in range(size)]
        out_splits = [rows(r, rank) for r in range(size)]
        inp = torch.cat([inputs(rank * 10 + j, 2 * rows(rank, j)).view(-1, 2) for j in range(size)])
        out = torch.empty(sum(out_splits), 2)
        finish(comm.all_to_all_v_single(out, inp, out_splits, in_splits, async_op=async_op), async_op)
        want = torch.cat([inputs(r * 10 + rank, 2 * rows(r, rank)).view(-1, 2) for r in range(size)])
        check(out, want, "all_to_all_v_single")
    run_both(go)


@case
def scatter_gather_barrier(comm, rank, size):
    root = 0

    def go(async_op):
        out = torch.empty(6)
        ins = [inputs(100 + j) for j in range(size)] if rank == root else []
        finish(comm.scatter(out, ins, root, async_op=async_op), async_op)
        check(out, inputs(100 + rank), "scatter")
        outs = [torch.empty(6) for _ in range(size)] if rank == root else []
        finish(comm.gather(outs, inputs(rank), root, async_op=async_op), async_op)
        if rank == root:
            for r in range(size):
                check(outs[r], inputs(r), f"gather from {r}")
        finish(comm.barrier(async_op=async_op), async_op)
    run_both(go)


@case
def send_recv_ring(comm, rank, size):
    if size < 2:
        raise Skip("needs 2 ranks")
    nxt, prv = (rank + 1) % size, (rank - 1) % size

    def go(async_op):
        got = torch.empty(6)
        # Even ranks send first: a ring with blocking ops must not deadlock.
        if rank % 2 == 0:
            finish(comm.send(inputs(rank), nxt, async_op=async_op), async_op)
            finish(comm.recv(got, prv, async_op=async_op), async_op)
        else:
            w = comm.recv(got, prv, async_op=True)
            finish(comm.send(inputs(rank), nxt, async_op=async_op), async_op)
            w.wait()
        check(got, inputs(prv), "recv from the previous rank")
    run_both(go)
    got = torch.empty(6)
    if rank == 0:
        comm.send(inputs(7), 1, async_op=False, timeout=datetime.timedelta(seconds=30))
    elif rank == 1:
        comm.recv(got, 0, async_op=False, timeout=30)
        check(got, inputs(7), "send/recv with a per-op timeout")


# ---- split -------------------------------------------------------------------------


@case
def split_groups(comm, rank, size):
    # Reversed order: rank i of the child is ranks[i].
    rev = list(range(size))[::-1]
    child = comm.split(rev)
    assert child.get_rank() == size - 1 - rank and child.get_size() == size
    t = torch.tensor([float(child.get_rank())])
    child.broadcast(t, 0, async_op=False)  # child rank 0 is parent rank size-1
    check(t, torch.tensor([0.0]), "broadcast in the reversed child")
    # Evens and odds, each their own group.
    mine = [r for r in range(size) if r % 2 == rank % 2]
    half = comm.split(mine)
    assert half.get_size() == len(mine) and half.get_rank() == mine.index(rank)
    t = torch.tensor([float(rank)])
    half.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.tensor([float(sum(mine))]), "all_reduce in the half")
    # A split of a split.
    grand = half.split([half.get_rank()])
    assert grand.get_size() == 1
    # Ranks outside every new group pass [] and get None.
    first = [0] if rank == 0 else []
    solo = comm.split(first)
    assert (solo is None) == (rank != 0)
    # A list without this rank is an error.
    if size > 1:
        other = [(rank + 1) % size]
        try:
            comm.split(other)
        except ValueError as e:
            assert "not in" in str(e), e
        else:
            raise AssertionError("split without this rank did not raise")
    for c in (grand, half, child, solo):
        if c is not None:
            c.finalize()
    comm.barrier(async_op=False)


# ---- errors, timeouts, hints ----------------------------------------------------------------


@case
def bad_input_keeps_comm_usable(comm, rank, size):
    for call, needle in [
        (lambda: comm.broadcast(torch.ones(2), size, async_op=False), "root"),
        (lambda: comm.all_reduce(torch.ones(2), tc.ReduceOp.PREMUL_SUM, async_op=False), "factor"),
        (lambda: comm.all_reduce(torch.ones(2), "sum", async_op=False), "ReduceOp"),
        (lambda: comm.all_reduce(torch.ones(2), tc.ReduceOp.BAND, async_op=False), "BAND"),
        (lambda: comm.all_gather_single(torch.empty(1), torch.ones(2), async_op=False), "elements"),
        (lambda: comm.all_reduce(torch.ones(2), tc.ReduceOp.SUM, timeout=-1), "positive"),
    ]:
        try:
            call()
        except (RuntimeError, ValueError, TypeError) as e:
            assert needle.lower() in str(e).lower(), f"{needle!r} not in: {e}"
        else:
            raise AssertionError(f"no error for a call that should fail on {needle}")
    t = torch.ones(3)
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.full((3,), float(size)), "all_reduce after bad input")


@case
def hints_validated(comm, rank, size):
    for hints, needle in [({"torchcomm::tccomm::no_such_hint": "1"}, "unknown tccomm hint"),
                          ({"torchcomm::tccomm::transport": "carrier-pigeon"}, "must be one of")]:
        try:
            comm.split(list(range(size)), hints=hints)
        except ValueError as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"hints {hints} accepted")
    try:
        comm.barrier(async_op=False, hints={"torchcomm::tccomm::transport": "shm"})
    except ValueError as e:
        assert "unknown tccomm hint" in str(e), e  # a communicator hint, not a per-op one
    else:
        raise AssertionError("per-op transport hint accepted")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comm.barrier(async_op=False, hints={"torchcomm::ncclx::high_priority_stream": "true"})
    assert any("not a tccomm hint" in str(w.message) for w in seen), [str(w.message) for w in seen]
    # A known hint takes effect: this child talks TCP, so it cannot have windows.
    tcp = comm.split(list(range(size)), hints={"torchcomm::tccomm::transport": "tcp"})
    t = torch.ones(2)
    tcp.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.full((2,), float(size)), "all_reduce over the tcp child")
    try:
        tcp.new_window().tensor_register(torch.zeros(4))
    except RuntimeError as e:
        assert "shared-memory" in str(e) and "tcp" in str(e), e
    else:
        raise AssertionError("a window over tcp was created")
    tcp.finalize()


@case
def timeout_makes_comm_unusable(comm, rank, size):
    if size < 2:
        raise Skip("needs 2 ranks")
    sub = comm.split(list(range(size)))  # the parent was created with abort off
    for _ in range(2):  # the default options of all_reduce SUM are now reused (TorchComm._opts)
        t = torch.ones(2)
        sub.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
        check(t, torch.full((2,), float(size)), "all_reduce SUM before the timeout")
    if rank == 0:
        try:
            sub.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False, timeout=1)
        except dist.DistBackendError as e:
            assert "timed out" in str(e) and "all_reduce" in str(e) and "[op timeout 1000 ms]" in str(e), e
        else:
            raise AssertionError("all_reduce without the other ranks did not time out")
        for call in (lambda: sub.barrier(async_op=False),
                     lambda: sub.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False)):
            try:
                call()
            except dist.DistBackendError as e:
                assert "unusable after all_reduce" in str(e), e
            else:
                raise AssertionError("the communicator stayed usable after a timeout")
    # The others stay members until rank 0 has seen its timeout: a rank that
    # finalizes is noticed at once, and the op would fail saying so instead.
    comm.barrier(async_op=False)
    sub.finalize()
    p2p = comm.split(list(range(size)))
    if rank == 1:
        w = p2p.recv(torch.empty(2), 0, async_op=True, timeout=datetime.timedelta(seconds=1))
        try:
            w.wait()
        except dist.DistBackendError as e:
            assert "recv" in str(e) and "timed out" in str(e), e
        else:
            raise AssertionError("recv without a send did not time out")
    comm.barrier(async_op=False)
    p2p.finalize()
    comm.barrier(async_op=False)


@case
def direct_path_serves_sync_ops(comm, rank, size):
    """Synchronous collectives with the default hints and timeout take the
    direct path (csrc/direct_ops.cpp); the rest the binding. The results of
    both are checked by the cases above (run_both); here: which path ran, the
    same errors on both, and the error policy for an op that fails once issued."""
    calls = torch.ops.tccomm.direct_calls
    before = calls()
    t = inputs(rank)
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.stack([inputs(r) for r in range(size)]).sum(0), "direct all_reduce")
    t = inputs(rank)
    comm.reduce(t, 0, tc.ReduceOp.MIN, async_op=False)
    if rank == 0:
        check(t, torch.stack([inputs(r) for r in range(size)]).amin(0), "direct reduce")
    t = inputs(rank)
    comm.broadcast(t, size - 1, async_op=False)
    check(t, inputs(size - 1), "direct broadcast")
    out = torch.empty(6 * size)
    comm.all_gather_single(out, inputs(rank), async_op=False)
    check(out, torch.cat([inputs(r) for r in range(size)]), "direct all_gather_single")
    out = torch.empty(6)
    comm.reduce_scatter_single(out, torch.cat([inputs(rank * size + j) for j in range(size)]), tc.ReduceOp.MAX,
                               async_op=False)
    check(out, torch.stack([inputs(r * size + rank) for r in range(size)]).amax(0), "direct reduce_scatter_single")
    out = torch.empty(2 * size)
    comm.all_to_all_single(out, torch.cat([inputs(rank * size + j, 2) for j in range(size)]), async_op=False)
    check(out, torch.cat([inputs(r * size + rank, 2) for r in range(size)]), "direct all_to_all_single")
    comm.barrier(async_op=False)
    assert calls() - before == 7, f"{calls() - before} of 7 synchronous ops took the direct path"
    if rank < 2 and size >= 2:  # send and recv between ranks 0 and 1
        before = calls()
        got = torch.empty(6)
        if rank == 0:
            comm.send(inputs(0), 1, async_op=False)
            comm.recv(got, 1, async_op=False)
        else:
            comm.recv(got, 0, async_op=False)
            comm.send(inputs(1), 0, async_op=False)
        check(got, inputs(1 - rank), "direct recv")
        assert calls() - before == 2, f"{calls() - before} of send and recv took the direct path"
    before = calls()
    comm.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=True).wait()
    comm.all_reduce(torch.ones(2), tc.ReduceOp.PREMUL_SUM(2.0), async_op=False)
    comm.all_reduce(torch.ones(2), dist.ReduceOp.SUM, async_op=False)  # a c10d op: the binding converts it
    comm.broadcast(torch.ones(2), 0, async_op=False, timeout=30)
    comm.barrier(async_op=False, hints={"torchcomm::ncclx::high_priority_stream": "true"})
    assert calls() == before, f"{calls() - before} ops with options of their own took the direct path"

    # Bad input: the same exception, word for word, on both paths; nothing changes.
    for what, call in [
        ("all_gather_single output too small", lambda a: comm.all_gather_single(torch.empty(1), torch.ones(2),
                                                                                async_op=a)),
        ("broadcast root out of range", lambda a: comm.broadcast(torch.ones(2), size, async_op=a)),
        ("reduce root negative", lambda a: comm.reduce(torch.ones(2), -1, tc.ReduceOp.SUM, async_op=a)),
        ("BAND on floats", lambda a: comm.all_reduce(torch.ones(2), tc.ReduceOp.BAND, async_op=a)),
        ("reduce_scatter_single sizes", lambda a: comm.reduce_scatter_single(torch.empty(2), torch.ones(2 * size + 1),
                                                                             tc.ReduceOp.SUM, async_op=a)),
        ("all_to_all_single sizes", lambda a: comm.all_to_all_single(torch.empty(size), torch.ones(size + 1),
                                                                     async_op=a)),
        ("a list for a tensor", lambda a: comm.all_reduce([torch.ones(2)], tc.ReduceOp.SUM, async_op=a)),
        ("send to itself", lambda a: comm.send(torch.ones(2), rank, async_op=a)),
        ("recv from a rank out of range", lambda a: comm.recv(torch.empty(2), size, async_op=a)),
    ]:
        seen = []
        for async_op in (False, True):
            try:
                call(async_op)
            except Exception as e:  # noqa: BLE001  (compared below)
                seen.append((type(e).__name__, str(e)))
            else:
                raise AssertionError(f"{what}: no error (async_op={async_op})")
        assert seen[0] == seen[1] or (what == "a list for a tensor" and seen[0][0] == seen[1][0] == "TypeError"), \
            f"{what}: direct path {seen[0]} against binding {seen[1]}"
    t = torch.ones(3)
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.full((3,), float(size)), "all_reduce after bad input")

    if size < 2:
        return
    # Issued, then failed: rank 0 waits in an all_reduce the others never
    # join (they finalize instead); the error policy makes the communicator unusable.
    sub = comm.split(list(range(size)))
    sub.barrier(async_op=False)
    if rank == 0:
        try:
            sub.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False)
        except dist.DistBackendError as e:
            assert f"all_reduce on communicator '{sub.get_name()}'" in str(e) and "destroyed its" in str(e), e
        else:
            raise AssertionError("all_reduce whose peers left did not fail")
        try:
            sub.barrier(async_op=False)
        except dist.DistBackendError as e:
            assert "unusable after all_reduce" in str(e), e
        else:
            raise AssertionError("the communicator stayed usable after a failed op")
    else:
        time.sleep(0.5)  # rank 0 is waiting in its all_reduce by now
    sub.finalize()
    comm.barrier(async_op=False)


# ---- windows ------------------------------------------------------------------------------


@case
def window_puts_signals_views(comm, rank, size):
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    win = comm.new_window()
    buf = torch.zeros(4 * size)
    same = win.tensor_register(buf)
    assert same is buf and torch.equal(buf, torch.zeros(4 * size))
    comm.barrier(async_op=False)
    # Everyone puts 2 values at offset 4*rank of every rank (itself included)
    # and signals it; after waiting for all, each buffer is fully known.
    for d in range(size):
        w = win.put(torch.full((2,), float(rank + 1)), d, 4 * rank, async_op=True)
        w.wait()
        win.signal(d, async_op=False)
    for p in range(size):
        win.wait_signal(p, async_op=False)
    want = torch.zeros(4 * size)
    for p in range(size):
        want[4 * p:4 * p + 2] = p + 1
    check(buf, want, "registered tensor after the puts")
    # The next rank's buffer is complete only once it has waited for its
    # own signals: a put from a third rank may still be on its way.
    comm.barrier(async_op=False)
    view = win.map_remote_tensor(nxt)
    check(view, want, "view of the next rank")
    comm.barrier(async_op=False)  # everyone checked before the next put
    # Signal order: a second put + signal is seen only after the second wait.
    win.put(torch.tensor([-1.0]), nxt, 4 * rank + 3)
    win.signal(nxt)
    win.wait_signal(prv)
    assert buf[4 * prv + 3].item() == -1.0
    # Bad arguments raise and change nothing.
    for call, needle in [(lambda: win.put(torch.ones(2), size, 0), "out of range"),
                         (lambda: win.put(torch.ones(2), nxt, 4 * size - 1), "do not fit"),
                         (lambda: win.put(torch.ones(2, dtype=torch.int32), nxt, 0), "window holds"),
                         (lambda: win.map_remote_tensor(size), "out of range")]:
        try:
            call()
        except (RuntimeError, ValueError, TypeError) as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"no error for {needle}")
    comm.barrier(async_op=False)
    win.tensor_deregister()
    # The tensor and the view keep their memory.
    assert buf[4 * prv + 3].item() == -1.0 and view[0].item() == 1.0
    try:
        win.put(torch.ones(1), nxt, 0)
    except RuntimeError as e:
        assert "no tensor is registered" in str(e), e
    else:
        raise AssertionError("put after deregistration")
    # Windows with different sizes per rank: views are 1-D then.
    win2 = comm.new_window()
    win2.tensor_register(torch.zeros(rank + 1, dtype=torch.int64))
    comm.barrier(async_op=False)
    assert win2.map_remote_tensor(nxt).shape == (nxt + 1,)
    comm.barrier(async_op=False)
    win2.tensor_deregister()


@case
def window_bad_registration_fails_everywhere(comm, rank, size):
    # Rank 0's tensor cannot be registered: every rank fails at once.
    t = torch.zeros(4, 2).t() if rank == 0 else torch.zeros(8)
    win = comm.new_window()
    try:
        win.tensor_register(t)
    except (RuntimeError, ValueError) as e:
        needle = "contiguous" if rank == 0 else "rank 0 could not register"
        assert needle in str(e), e
    else:
        raise AssertionError("registration went through")
    t = torch.ones(2)
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    check(t, torch.full((2,), float(size)), "all_reduce after the failed registration")


@case
def wait_signal_times_out(comm, rank, size):
    sub = comm.split(list(range(size)))
    win = sub.new_window()
    win.tensor_register(torch.zeros(2))
    try:
        win.wait_signal((rank + 1) % size, timeout=datetime.timedelta(milliseconds=300))
    except dist.DistBackendError as e:
        assert "timed out" in str(e) and "wait_signal" in str(e), e
    else:
        raise AssertionError("wait_signal without a signal returned")
    win.tensor_deregister()
    sub.finalize()
    comm.barrier(async_op=False)


@case
def finalize_then_ops_raise(comm, rank, size):
    sub = comm.split(list(range(size)))
    # Ops issued before, so their options are cached: the cache must not
    # skip the check that the communicator is still usable.
    sub.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False)
    sub.broadcast(torch.ones(2), 0, async_op=False)
    sub.finalize()
    for what, call in [("barrier", lambda: sub.barrier(async_op=False)),
                       ("all_reduce", lambda: sub.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False)),
                       ("broadcast", lambda: sub.broadcast(torch.ones(2), 0, async_op=False))]:
        try:
            call()
        except RuntimeError as e:
            assert "finalized" in str(e) and what in str(e), e
        else:
            raise AssertionError(f"{what} after finalize")
