"""One rank of a CUDA test group: python tests/_cuda_worker.py SCENARIO OUT_DIR

Spawned by tests/test_cuda.py, one process per rank, all on the one GPU
(cuda:0). With more than one rank every process claims its own host
(NCCL_HOSTID) so NCCL treats them as separate nodes over sockets on lo.
Every rank reports the scenario as one case (tests/_rank.py events in
OUT_DIR: its start, then pass or the failure) and exits 0 only on success.

Scenarios:
  ops       every op on CUDA tensors against references computed on the host
            with plain torch from every rank's known (signed) inputs, plus
            stream semantics, futures, coalescing, bad input
  eager     as `ops` for all_reduce, with init_process_group(device_id=...)
  graph     an all_reduce captured in a CUDA graph, replayed 10 times
  split     dist.split_group from an eagerly initialised group (its NCCL
            communicator split from the parent's): ops on the child in the
            child's rank order, a rank outside gets no group, the parent
            still works
  ddp       5 DDP steps on CUDA: same parameters as the same run on `nccl`
  timeout   a peer never joins: the op fails after the group's timeout
            naming op, group and rank; the process lives on
            (TCCOMM_ASYNC_ERROR_HANDLING=2)
  teardown  the same under the default error handling: the process is torn down
  tools     what torch's tools see of CUDA ops: the profiler's tccomm span,
            record_param_comms and NCCL's kernels on the device; the flight
            recorder's entry, named "nccl:all_reduce", completed
  selfcheck no GPU, no group: the host references and comparisons used by
            `ops` accept a right result (in another order of the ranks) and
            reject wrong ones

References and comparisons are tests/_reference.py's (the CPU suite's): NCCL
sums in an order of its own (floats within ref.reduction_bound); MIN, MAX,
integers, bool and moved data are compared exactly (moved data bit for bit).
"""

import datetime
import os
import sys
import time
import traceback

import _rank  # tests/ is this script's directory: first on sys.path

_rank.enable_stack_dumps()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _reference as ref  # noqa: E402

OUTDIR = ""  # set by main(): where the rank reports (and may write files)
RANK = 0    # set by main() from the environment torchrun-style launchers give
WORLD = 1
DEV = torch.device("cuda", 0)
GIVE_UP_S = 90  # teardown: how long a rank waits for what must end it sooner
FLOAT_NAMES = ref.FLOATS
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64",
               "uint8", "bool")  # NCCL reduces no int16
R = dist.ReduceOp
REDOPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")


def inp(key, rank, n, dtype, redop="SUM"):
    """Rank `rank`'s input for `key`: signed values (integers over their whole
    range, smaller for AVG so that sums do not wrap), deterministic on every rank."""
    return ref.make_input(("cuda", key), rank, n, dtype, ref.input_kind(redop))


def hostile(key, rank, n, dtype):
    """Hostile bit patterns (NaN payloads, -0.0, subnormals, integer extremes)
    for data that is only moved."""
    return ref.special_input(("cuda", key), rank, n, dtype)


def nccl_extra_roundings(redop, world):
    """NCCL computes a float AVG as a sum of x_i * (1/world): the rounded
    factor and its `world` products round more often than a sum divided once."""
    return world + 1 if redop == "AVG" else 0


def check_reduced(got, xs, dtype, redop, what):
    """`got` (any device) is the reduction of the host tensors `xs`."""
    exact = dtype not in FLOAT_NAMES or redop in ("MIN", "MAX")
    bound = None if exact else ref.reduction_bound(
        xs, dtype, redop, nccl_extra_roundings(redop, len(xs)))
    ref.compare(got.cpu(), ref.ref_reduce(xs, dtype, redop), what, exact, bound=bound)


def check_moved(got, expected, what):
    ref.compare(got.cpu(), expected, what, bits=True)


def expect_error(fn, *words):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        missing = [w for w in words if w.lower() not in msg.lower()]
        assert not missing, f"error lacks {missing}: {msg}"
        return msg
    raise AssertionError(f"no error raised; expected one naming {words}")


def on_gpu(t):
    return t.to(DEV)


# ---- ops ------------------------------------------------------------------

def check_all_reduce():
    n = 1001
    for dtype in DTYPE_NAMES:
        for redop in REDOPS:
            if ref.redop_error(dtype, redop):
                continue
            xs = [inp(("ar", dtype, redop), q, n, dtype, redop) for q in range(WORLD)]
            t = on_gpu(xs[RANK])
            dist.all_reduce(t, op=ref.make_redop(redop))
            check_reduced(t, xs, dtype, redop, f"all_reduce {redop} on {dtype}")
    for redop in ("BAND", "BOR"):
        xs = [inp(("bw", redop), q, 77, "bool") for q in range(WORLD)]
        t = on_gpu(xs[RANK])
        dist.all_reduce(t, op=getattr(R, redop))
        check_reduced(t, xs, "bool", redop, f"all_reduce {redop} on bool")


def check_movement():
    n = 513
    root = WORLD - 1
    for dtype in ("float32", "int16", "bfloat16", "bool", "float16"):
        def x(key, q, size=n, dtype=dtype):
            return hostile((key, dtype), q, size, dtype)
        dt = ref.tdtype(dtype)

        t = on_gpu(x("bc", RANK))
        dist.broadcast(t, src=root)
        check_moved(t, x("bc", root), f"broadcast {dtype}")

        outs = [torch.empty(n, dtype=dt, device=DEV) for _ in range(WORLD)]
        dist.all_gather(outs, on_gpu(x("ag", RANK)))
        check_moved(torch.cat(outs), torch.cat([x("ag", q) for q in range(WORLD)]),
                    f"all_gather {dtype}")

        out = torch.empty(WORLD * n, dtype=dt, device=DEV)
        dist.all_gather_into_tensor(out, on_gpu(x("agt", RANK)))
        check_moved(out, torch.cat([x("agt", q) for q in range(WORLD)]),
                    f"all_gather_into_tensor {dtype}")

        outs = [torch.empty(n, dtype=dt, device=DEV) for _ in range(WORLD)] if RANK == 0 else None
        dist.gather(on_gpu(x("ga", RANK)), outs, dst=0)
        if RANK == 0:
            check_moved(torch.cat(outs), torch.cat([x("ga", q) for q in range(WORLD)]),
                        f"gather {dtype}")

        ins = [on_gpu(x(("sc", j), root)) for j in range(WORLD)] if RANK == root else None
        out = torch.empty(n, dtype=dt, device=DEV)
        dist.scatter(out, ins, src=root)
        check_moved(out, x(("sc", RANK), root), f"scatter {dtype}")

        def rows(i, j):  # rows rank i sends to rank j: uneven
            return (i + 2 * j) % 3 + 1
        send = [rows(RANK, j) for j in range(WORLD)]
        recv = [rows(j, RANK) for j in range(WORLD)]

        def a2a_in(q):
            return x("a2a", q, sum(rows(q, j) for j in range(WORLD)) * 3).view(-1, 3)
        out = torch.empty(sum(recv), 3, dtype=dt, device=DEV)
        dist.all_to_all_single(out, on_gpu(a2a_in(RANK)), recv, send)
        parts = []
        for q in range(WORLD):
            off = sum(rows(q, j) for j in range(RANK))
            parts.append(a2a_in(q)[off:off + rows(q, RANK)])
        check_moved(out, torch.cat(parts), f"all_to_all_single uneven {dtype}")

        ins = [on_gpu(x(("a2al", j), RANK, 5 + j)) for j in range(WORLD)]
        outs = [torch.empty(5 + RANK, dtype=dt, device=DEV) for _ in range(WORLD)]
        dist.all_to_all(outs, ins)
        check_moved(torch.cat(outs), torch.cat([x(("a2al", RANK), q, 5 + RANK)
                                                for q in range(WORLD)]),
                    f"all_to_all list {dtype}")


def check_reductions_rooted():
    n = 300
    for dtype in ("float32", "float16", "int64"):
        xs = [inp(("rd", dtype), q, n, dtype) for q in range(WORLD)]
        t = on_gpu(xs[RANK])
        dist.reduce(t, dst=0, op=R.SUM)
        if RANK == 0:
            check_reduced(t, xs, dtype, "SUM", f"reduce SUM {dtype} at 0")

        ins = [[inp(("rs", dtype, j), q, 64, dtype) for j in range(WORLD)] for q in range(WORLD)]
        out = torch.empty(64, dtype=ref.tdtype(dtype), device=DEV)
        dist.reduce_scatter(out, [on_gpu(t) for t in ins[RANK]], op=R.MAX)
        check_reduced(out, [ins[q][RANK] for q in range(WORLD)], dtype, "MAX",
                      f"reduce_scatter list MAX {dtype}")

        full = [inp(("rst", dtype), q, 64 * WORLD, dtype) for q in range(WORLD)]
        out = torch.empty(64, dtype=ref.tdtype(dtype), device=DEV)
        dist.reduce_scatter_tensor(out, on_gpu(full[RANK]), op=R.SUM)
        check_reduced(out, [f[64 * RANK:64 * (RANK + 1)] for f in full], dtype, "SUM",
                      f"reduce_scatter_tensor SUM {dtype}")


def check_p2p():
    if WORLD == 1:
        return
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    x = on_gpu(hostile("p2p", RANK, 1000, "float32"))
    got = torch.empty(1000, device=DEV)
    if RANK % 2 == 0:
        dist.send(x, nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(x, nxt)
    check_moved(got, hostile("p2p", prv, 1000, "float32"), "send/recv ring")
    # batched, as one NCCL group
    got2 = torch.empty(1000, device=DEV)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got2, prv)])
    for q in reqs:
        q.wait()
    check_moved(got2, hostile("p2p", prv, 1000, "float32"), "batch_isend_irecv")


def check_semantics():
    # async op + wait: the caller's stream waits, so kernels queued after see the result
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.full((1 << 20,), float(RANK + 1), device=DEV)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        y = t * 2  # on s, after the wait
    torch.cuda.synchronize()
    expect = 2.0 * sum(range(1, WORLD + 1))
    assert torch.all(y == expect).item(), f"stream order after wait(): {y[:4]}"
    # future: device-aware, value is the output list
    t = torch.ones(10, device=DEV)
    fut = dist.all_reduce(t, async_op=True).get_future()
    val = fut.wait()
    assert torch.equal(val[0].cpu(), torch.full((10,), float(WORLD))), f"future value {val}"
    # then() chains on the device
    t = torch.ones(10, device=DEV)
    fut2 = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
    assert torch.equal(fut2.wait().cpu(), torch.full((10,), 3.0 * WORLD)), "future then()"
    # is_completed turns true without wait()
    w = dist.all_reduce(torch.ones(10, device=DEV), async_op=True)
    deadline = time.time() + 60
    while not w.is_completed():
        assert time.time() < deadline, "is_completed() never became true"
        time.sleep(0.001)
    # non-contiguous output (staged, copied back on the caller's stream)
    base = torch.zeros(8, 2, device=DEV)
    col = base[:, 0]
    col.fill_(1.0)
    dist.all_reduce(col)
    torch.cuda.synchronize()
    assert torch.equal(base[:, 0].cpu(), torch.full((8,), float(WORLD))) and base[:, 1].abs().sum().item() == 0
    # coalescing: one NCCL group
    ts = [torch.full((5,), float(i + RANK), device=DEV) for i in range(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    torch.cuda.synchronize()
    for i, t in enumerate(ts):
        assert torch.equal(t.cpu(), torch.full((5,), float(sum(i + r for r in range(WORLD))))), f"coalesced {i}"
    dist.barrier()


def check_bad_input():
    expect_error(lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16, device=DEV)), "allreduce", "int16")
    expect_error(lambda: dist.all_reduce(torch.ones(4, device=DEV), op=R.BAND), "band")
    outs = [torch.empty(4) for _ in range(WORLD)]
    expect_error(lambda: dist.all_gather(outs, torch.ones(4, device=DEV)), "all", "mixed devices")
    # still usable
    t = torch.ones(4, device=DEV)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.full((4,), float(WORLD))), "group unusable after bad input"


def scenario_ops():
    init()
    check_all_reduce()
    check_movement()
    check_reductions_rooted()
    check_p2p()
    check_semantics()
    check_bad_input()


def scenario_eager():
    init(device_id=DEV)
    check_all_reduce()


def scenario_graph():
    init()
    t = torch.ones(1 << 16, device=DEV)
    dist.all_reduce(t)  # creates the NCCL communicator outside the capture
    torch.cuda.synchronize()
    static = torch.zeros(1 << 16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static.mul_(1.0)
            dist.all_reduce(static)
    torch.cuda.synchronize()
    for i in range(10):
        static.fill_(float(RANK + i))
        g.replay()
        torch.cuda.synchronize()
        want = float(sum(r + i for r in range(WORLD)))
        assert torch.all(static == want).item(), f"replay {i}: {static[:4]} != {want}"


def scenario_split():
    init(device_id=DEV)
    ranks = list(range(WORLD - 1, -1, -2))  # reversed; every other rank
    child = dist.split_group(split_ranks=[ranks], group_desc="odd-one-out")
    if RANK not in ranks:
        assert child is None, f"rank {RANK} is outside {ranks} but got a group"
    else:
        assert dist.get_process_group_ranks(child) == ranks, dist.get_process_group_ranks(child)
        t = torch.full((1000,), float(RANK + 1), device=DEV)
        dist.all_reduce(t, group=child)
        want = float(sum(r + 1 for r in ranks))
        assert torch.all(t == want).item(), f"all_reduce on {ranks}: {t[:4]} != {want}"
        b = torch.full((7,), float(RANK), device=DEV)
        dist.broadcast(b, group_src=0, group=child)
        assert torch.all(b == float(ranks[0])).item(), f"broadcast from child rank 0 ({ranks[0]}): {b}"
    t = torch.full((5,), 1.0, device=DEV)
    dist.all_reduce(t)
    assert torch.all(t == float(WORLD)).item(), f"the parent after the split: {t}"
    torch.cuda.synchronize()


def scenario_tools():
    import pickle

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import torchcomm_backend

    init()
    t = torch.full((1 << 16,), float(RANK + 1), device=DEV)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(t)
        torch.cuda.synchronize()
    want = float(WORLD * (WORLD + 1) // 2)
    assert torch.all(t == want).item(), f"all_reduce: {t[:4]} != {want}"
    events = prof.events()
    names = {e.name for e in events}
    assert "tccomm:all_reduce" in names and "record_param_comms" in names, sorted(names)
    kernels = [e.name for e in events if e.device_type == DeviceType.CUDA and "nccl" in e.name.lower()]
    assert kernels, f"no NCCL kernel on the device side: {sorted(names)}"
    path = torchcomm_backend.dump_flight_recorder(os.path.join(OUTDIR, f"fr_{RANK}"))
    assert path is not None, "the flight recorder is off (TORCH_FR_BUFFER_SIZE)"
    with open(path, "rb") as f:
        entries = pickle.load(f)["entries"]
    assert [e["profiling_name"] for e in entries] == ["nccl:all_reduce"], entries
    assert entries[0]["state"] == "completed" and entries[0]["input_sizes"] == [[1 << 16]], entries[0]


def scenario_ddp():
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP
    init()
    nccl = dist.new_group(list(range(WORLD)), backend="nccl")
    torch.manual_seed(1234 + RANK)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEV)
    ref = copy.deepcopy(model)
    runs = {}
    for name, m, pg in (("tccomm", model, None), ("nccl", ref, nccl)):
        ddp = DDP(m, device_ids=[0], process_group=pg, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            g = torch.Generator().manual_seed(1000 * step + RANK)
            x, y = torch.randn(8, 16, generator=g).to(DEV), torch.randn(8, 4, generator=g).to(DEV)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        runs[name] = [p.detach().cpu() for p in m.parameters()]
    for k, (a, b) in enumerate(zip(runs["tccomm"], runs["nccl"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"parameter {k}: {m}")


def scenario_timeout():
    init(timeout=datetime.timedelta(seconds=5))
    t = torch.ones(8, device=DEV)
    dist.all_reduce(t)  # both ranks: the NCCL communicator exists
    torch.cuda.synchronize()
    store = dist.distributed_c10d._get_default_store()
    if RANK == 0:
        store.wait(["timeout/done"], datetime.timedelta(seconds=120))
        return
    try:
        w = dist.all_reduce(torch.ones(8, device=DEV), async_op=True)  # rank 0 never joins
        deadline = time.time() + 90
        while not w.is_completed():
            assert time.time() < deadline, "the op neither completed nor timed out in 90 s"
            time.sleep(0.05)
        msg = expect_error(w.wait, "allreduce", "rank 1", "timed out")
        assert "default" in msg or "tccomm:" in msg, f"the message does not name the group: {msg}"
        expect_error(lambda: dist.all_reduce(torch.ones(8, device=DEV)), "no longer usable")
        torch.cuda.synchronize()  # the aborted kernel has ended: this returns
    finally:
        store.set("timeout/done", "1")


def scenario_teardown():
    """Rank 1 issues an all_reduce that rank 0 never joins, under the default
    error handling: its process must be torn down (the test checks how it
    ended); rank 0 waits until the harness ends it."""
    init(timeout=datetime.timedelta(seconds=5))
    t = torch.ones(8, device=DEV)
    dist.all_reduce(t)  # both ranks: the NCCL communicator exists
    torch.cuda.synchronize()
    if RANK == 0:
        store = dist.distributed_c10d._get_default_store()
        store.wait(["teardown/never"], datetime.timedelta(seconds=GIVE_UP_S))
        return
    dist.all_reduce(torch.ones(8, device=DEV), async_op=True).wait()
    torch.cuda.synchronize()
    time.sleep(GIVE_UP_S)
    raise AssertionError(f"the process was not torn down {GIVE_UP_S} s after its op timed out")


def scenario_selfcheck():
    """The references and comparisons `ops` relies on, without a GPU: a
    right result (the ranks combined in reverse order, or rounded every
    step as NCCL may) passes; a wrong AVG divisor, a dropped rank, a lost
    NaN payload or a flipped sign bit fails."""
    for world in (2, 3, 4):
        for dtype in DTYPE_NAMES:
            for redop in REDOPS:
                if ref.redop_error(dtype, redop):
                    continue
                xs = [inp(("self", dtype, redop), q, 1001, dtype, redop) for q in range(world)]
                what = f"selfcheck W={world} {redop} on {dtype}"
                check_reduced(ref.ref_reduce(xs[::-1], dtype, redop), xs, dtype, redop, what)
                if dtype in ("float16", "bfloat16"):
                    check_reduced(ref.ref_reduce(xs[::-1], dtype, redop, accumulate=dtype),
                                  xs, dtype, redop, what + " (rounded every step)")
                wrong = [ref.ref_reduce(xs[:-1], dtype, redop)]  # a rank left out
                if redop == "AVG" and dtype in FLOAT_NAMES:
                    total = ref.ref_reduce(xs, dtype, "SUM").double()
                    wrong.append((total / (world - 1)).to(ref.tdtype(dtype)))
                for bad in wrong:
                    try:
                        check_reduced(bad, xs, dtype, redop, what + " (wrong result)")
                    except AssertionError:
                        continue
                    raise AssertionError(f"{what}: a wrong result passed the check")
    for dtype in ("float32", "int16", "bfloat16", "bool", "float16"):
        x = hostile("self", 0, 513, dtype)
        check_moved(x.clone(), x, f"selfcheck moved {dtype}")
        bits = ref.bits_of(x).clone()
        if dtype in FLOAT_NAMES:  # another NaN payload: equal as a value, not as bits
            bits[torch.isnan(x).nonzero()[0, 0]] ^= 4
        else:
            bits[bits.numel() // 2] ^= 1
        bad = bits.view(x.dtype)
        try:
            check_moved(bad, x, f"selfcheck moved {dtype} (one bit flipped)")
        except AssertionError:
            continue
        raise AssertionError(f"selfcheck moved {dtype}: a flipped bit passed the check")


def init(**kw):
    torch.cuda.set_device(0)
    dist.init_process_group("tccomm", **kw)


def main():
    global RANK, WORLD, OUTDIR
    scenario, outdir = sys.argv[1], sys.argv[2]
    OUTDIR = outdir
    RANK = int(os.environ.get("RANK", "0"))
    WORLD = int(os.environ.get("WORLD_SIZE", "1"))
    events = _rank.Events(outdir, RANK)
    events.emit(event="start", case=scenario, t=time.time())
    status, msg = "pass", ""
    try:
        globals()[f"scenario_{scenario}"]()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        status, msg = "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    events.emit(event="result", case=scenario, status=status, msg=msg)
    # Ends at once, as it always has: the verdict is the reported result and
    # the exit code; the interpreter's teardown is not what these scenarios check.
    _rank.leave_now(0 if status == "pass" else 1)


if __name__ == "__main__":
    main()
