"""One rank of a CUDA test group: python tests/_cuda_worker.py SCENARIO RESULT_DIR

Spawned by tests/test_cuda.py, one process per rank, all on the one GPU
(cuda:0). With more than one rank every process claims its own host
(NCCL_HOSTID) so NCCL treats them as separate nodes over sockets on lo.
Every rank writes RESULT_DIR/rank<R>.txt: "ok" or the failure, and exits 0
only on success.

Scenarios:
  ops      every op on CUDA tensors, compared with the same op on CPU tensors
           through the same tccomm group (the CPU path is verified by the CPU
           suite), plus stream semantics, futures, coalescing, bad input
  eager    as `ops` for all_reduce, with init_process_group(device_id=...)
  graph    an all_reduce captured in a CUDA graph, replayed 10 times
  ddp      5 DDP steps on CUDA: same parameters as the same run on `nccl`
  timeout  a peer never joins: the op fails after the group's timeout
           naming op, group and rank; the process lives on
"""

import datetime
import faulthandler
import os
import sys
import time
import traceback
import zlib

faulthandler.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torchcomm_backend  # noqa: E402,F401

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEV = torch.device("cuda", 0)
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = FLOATS + (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)
R = dist.ReduceOp


def inp(key, rank, n, dtype):
    # crc32, not hash(): every rank must compute the same inputs for a key
    g = torch.Generator().manual_seed(zlib.crc32(repr((key, rank, n, str(dtype))).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype in FLOATS:
        return (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(1, 5, (n,), generator=g).to(dtype)


def same(cuda_t, cpu_t, what):
    got = cuda_t.cpu()
    if got.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(got.float(), cpu_t.float(), rtol=2e-2, atol=1e-2)
    elif got.dtype in FLOATS:
        ok = torch.allclose(got, cpu_t, rtol=1e-5, atol=1e-6)
    else:
        ok = torch.equal(got, cpu_t)
    assert ok, f"{what}: CUDA result differs from the CPU result\n cuda={got[:8]}\n cpu ={cpu_t[:8]}"


def expect_error(fn, *words):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        missing = [w for w in words if w.lower() not in msg.lower()]
        assert not missing, f"error lacks {missing}: {msg}"
        return msg
    raise AssertionError(f"no error raised; expected one naming {words}")


def both(fn):
    """Runs fn(device) on CUDA and on CPU; returns (cuda result, cpu result)."""
    out_cuda = fn(DEV)
    torch.cuda.synchronize()
    return out_cuda, fn(torch.device("cpu"))


# ---- ops ------------------------------------------------------------------

def check_all_reduce():
    ops = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, "PREMUL"]
    for dt in DTYPES:
        for op in ops:
            if dt == torch.bool and op in (R.AVG, "PREMUL"):
                continue
            if op == "PREMUL" and dt not in FLOATS:
                continue
            red = dist._make_nccl_premul_sum(0.5) if op == "PREMUL" else op

            def run(d, dt=dt, red=red):
                t = inp("ar", RANK, 1001, dt).to(d)
                dist.all_reduce(t, op=red)
                return t
            a, b = both(run)
            if op == R.AVG and dt not in FLOATS:
                assert (a.cpu().long() - b.long()).abs().max() <= 1, f"all_reduce AVG {dt}"
            else:
                same(a, b, f"all_reduce {op} {dt}")
    for op in (R.BAND, R.BOR):
        def run_bool(d, op=op):
            t = inp("bw", RANK, 77, torch.bool).to(d)
            dist.all_reduce(t, op=op)
            return t
        same(*both(run_bool), f"all_reduce {op} bool")


def check_movement():
    n = 513
    for dt in (torch.float32, torch.int16, torch.bfloat16, torch.bool):
        def bc(d):
            t = inp("bc", RANK, n, dt).to(d)
            dist.broadcast(t, src=WORLD - 1)
            return t
        same(*both(bc), f"broadcast {dt}")

        def ag(d):
            outs = [torch.empty(n, dtype=dt, device=d) for _ in range(WORLD)]
            dist.all_gather(outs, inp("ag", RANK, n, dt).to(d))
            return torch.cat(outs)
        same(*both(ag), f"all_gather {dt}")

        def agt(d):
            out = torch.empty(WORLD * n, dtype=dt, device=d)
            dist.all_gather_into_tensor(out, inp("agt", RANK, n, dt).to(d))
            return out
        same(*both(agt), f"all_gather_into_tensor {dt}")

        def ga(d):
            root = 0
            outs = [torch.empty(n, dtype=dt, device=d) for _ in range(WORLD)] if RANK == root else None
            dist.gather(inp("ga", RANK, n, dt).to(d), outs, dst=root)
            return torch.cat(outs) if RANK == root else torch.zeros(1)
        same(*both(ga), f"gather {dt}")

        def sc(d):
            root = WORLD - 1
            ins = [inp("sc", j, n, dt).to(d) for j in range(WORLD)] if RANK == root else None
            out = torch.empty(n, dtype=dt, device=d)
            dist.scatter(out, ins, src=root)
            return out
        same(*both(sc), f"scatter {dt}")

        def a2a(d):
            splits_in = [(RANK + j) % 3 + 1 for j in range(WORLD)]  # uneven
            splits_out = [(j + RANK) % 3 + 1 for j in range(WORLD)]
            x = inp("a2a", RANK, sum(splits_in) * 3, dt).view(-1, 3).to(d)
            out = torch.empty(sum(splits_out), 3, dtype=dt, device=d)
            dist.all_to_all_single(out, x, splits_out, splits_in)
            return out.flatten()
        same(*both(a2a), f"all_to_all_single uneven {dt}")

        def a2al(d):
            ins = [inp("a2al", RANK * 100 + j, 5 + j, dt).to(d) for j in range(WORLD)]
            outs = [torch.empty(5 + RANK, dtype=dt, device=d) for _ in range(WORLD)]
            dist.all_to_all(outs, ins)
            return torch.cat(outs)
        same(*both(a2al), f"all_to_all list {dt}")


def check_reductions_rooted():
    for dt in (torch.float32, torch.float16, torch.int64):
        def rd(d):
            t = inp("rd", RANK, 300, dt).to(d)
            dist.reduce(t, dst=0, op=R.SUM)
            return t if RANK == 0 else torch.zeros(1)
        same(*both(rd), f"reduce {dt}")

        def rs(d):
            ins = [inp("rs", RANK * 10 + j, 64, dt).to(d) for j in range(WORLD)]
            out = torch.empty(64, dtype=dt, device=d)
            dist.reduce_scatter(out, ins, op=R.MAX)
            return out
        same(*both(rs), f"reduce_scatter list {dt}")

        def rst(d):
            out = torch.empty(64, dtype=dt, device=d)
            dist.reduce_scatter_tensor(out, inp("rst", RANK, 64 * WORLD, dt).to(d), op=R.SUM)
            return out
        same(*both(rst), f"reduce_scatter_tensor {dt}")


def check_p2p():
    if WORLD == 1:
        return
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    for d in (DEV,):
        x = inp("p2p", RANK, 1000, torch.float32).to(d)
        got = torch.empty(1000, device=d)
        if RANK % 2 == 0:
            dist.send(x, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(x, nxt)
        same(got, inp("p2p", prv, 1000, torch.float32), "send/recv ring")
        # batched, as one NCCL group
        got2 = torch.empty(1000, device=d)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got2, prv)])
        for q in reqs:
            q.wait()
        same(got2, inp("p2p", prv, 1000, torch.float32), "batch_isend_irecv")


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


def init(**kw):
    torch.cuda.set_device(0)
    dist.init_process_group("tccomm", **kw)


def main():
    scenario, outdir = sys.argv[1], sys.argv[2]
    status = "ok"
    try:
        globals()[f"scenario_{scenario}"]()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        status = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    with open(os.path.join(outdir, f"rank{RANK}.txt"), "w") as f:
        f.write(status)
    sys.stdout.flush()
    os._exit(0 if status == "ok" else 1)


if __name__ == "__main__":
    main()
