"""Features: async work, coalesced ops, p2p, objects, barrier, groups,
non-contiguous tensors, transports, re-init and the resources a destroyed
group gives back (suite "feat", reported by tests/test_features.py)."""

from __future__ import annotations

import datetime
import gc
import time

import torch
import torch.distributed as dist

from _dist_ops import all_gather_tensor, reduce_scatter_tensor
from _reference import LARGE_PART, ref_reduce
from _registry import Skip, add
from _resources import open_sockets, shm_mappings


def c_async_work(ctx):
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, 1000, "float32") for s in range(W)]
    t = xs[r].clone()
    work = dist.all_reduce(t, async_op=True)
    assert work is not None, "all_reduce(async_op=True) returned None"
    ret = work.wait()
    assert ret is True, f"Work.wait() returned {ret!r}, expected True"
    assert work.is_completed(), "Work.is_completed() is False after wait()"
    assert work.exception() is None, f"Work.exception() is {work.exception()!r}"
    ctx.check_reduction(t, xs, "float32", "SUM", "async all_reduce")
    fut_val = work.get_future().wait()
    assert isinstance(fut_val, list) and len(fut_val) == 1, \
        f"get_future().wait() returned {type(fut_val).__name__} {fut_val!r:.200}, " \
        "expected the output tensor list"
    ctx.same_bits(fut_val[0], t, "get_future().wait()[0]")
    assert fut_val[0].data_ptr() == t.data_ptr(), \
        "get_future().wait()[0] is not the output tensor (different storage)"

    # wait(timeout) and many outstanding works waited in reverse order
    ts = [ctx.inp(r, 100 + k, "float64", tag=k) for k in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for k in reversed(range(8)):
        assert works[k].wait(timeout=datetime.timedelta(seconds=60)) is True, \
            f"wait(timeout) of work {k} did not return True"
    for k in range(8):
        ctx.check_reduction(ts[k], [ctx.inp(s, 100 + k, "float64", tag=k) for s in range(W)],
                            "float64", "SUM", f"outstanding all_reduce {k}")

    # a future callback sees the result (as DDP comm hooks do)
    t2 = ctx.inp(r, 64, "int64", tag="cb")
    w2 = dist.all_reduce(t2, async_op=True)
    fut2 = w2.get_future().then(lambda f: f.value()[0] * 2)
    exp2 = ref_reduce([ctx.inp(s, 64, "int64", tag="cb") for s in range(W)], "int64", "SUM")
    ctx.compare(fut2.wait(), exp2 * 2, "future.then() result")

    # async broadcast / all_gather / reduce_scatter_tensor
    b = ctx.inp(0, 33, "int32") if r == 0 else ctx.garbage(33, "int32")
    wb = dist.broadcast(b, src=0, async_op=True)
    outs = [ctx.garbage(17, "float32") for _ in range(W)]
    wg = dist.all_gather(outs, ctx.inp(r, 17, "float32"), async_op=True)
    rs_in = ctx.inp(r, W * 9, "int64", tag="rs")
    rs_out = ctx.garbage(9, "int64")
    wr = reduce_scatter_tensor(rs_out, rs_in, dist.ReduceOp.SUM, async_op=True)
    wr.wait()
    wg.wait()
    wb.wait()
    ctx.compare(b, ctx.inp(0, 33, "int32"), "async broadcast")
    for s in range(W):
        ctx.compare(outs[s], ctx.inp(s, 17, "float32"), f"async all_gather[{s}]")
    ctx.compare(rs_out, ref_reduce([ctx.inp(s, W * 9, "int64", tag="rs")[r * 9:(r + 1) * 9]
                                    for s in range(W)], "int64", "SUM"),
                "async reduce_scatter_tensor")
    for name, w in (("broadcast", wb), ("all_gather", wg), ("reduce_scatter", wr)):
        # (gloo's reduce_scatter_tensor work never reports is_completed())
        if ctx.strict:
            assert w.is_completed(), f"{name}: is_completed() False after wait()"
        assert w.exception() is None, f"{name}: exception() is {w.exception()!r}"


def c_all_reduce_coalesced(ctx):
    W, r = ctx.world, ctx.rank
    shapes = [(5,), (31, 3), (0,), (1023,)]
    ts = [ctx.inp(r, s, "float32", tag=k) for k, s in enumerate(shapes)]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
    for k, s in enumerate(shapes):
        ctx.compare(ts[k], ref_reduce([ctx.inp(q, s, "float32", tag=k) for q in range(W)],
                                      "float32", "MAX"), f"all_reduce_coalesced[{k}]")


def c_all_gather_coalesced(ctx):
    W, r = ctx.world, ctx.rank
    shapes = [(4, 2), (1,), (77,)]
    ins = [ctx.inp(r, s, "int32", tag=k) for k, s in enumerate(shapes)]
    outs = [[ctx.garbage(s, "int32") for s in shapes] for _ in range(W)]
    dist.all_gather_coalesced(outs, ins)
    for q in range(W):
        for k, s in enumerate(shapes):
            ctx.compare(outs[q][k], ctx.inp(q, s, "int32", tag=k),
                        f"all_gather_coalesced output[{q}][{k}]")


def c_coalescing_manager(ctx):
    """What FSDP and funcol issue: coalesced all-gather-into-tensor,
    reduce-scatter-tensor and all_reduce through torch's coalescing manager."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    W, r = ctx.world, ctx.rank
    sizes = [3, 100, 1]
    outs = [ctx.garbage(W * n, "float32") for n in sizes]
    with _coalescing_manager(async_ops=True) as cm:
        for k, n in enumerate(sizes):
            all_gather_tensor(outs[k], ctx.inp(r, n, "float32", tag=k))
    cm.wait()
    for k, n in enumerate(sizes):
        ctx.compare(outs[k], torch.cat([ctx.inp(q, n, "float32", tag=k) for q in range(W)]),
                    f"coalesced all_gather_into_tensor[{k}]")
    rs_out = [ctx.garbage(n, "float64") for n in sizes]
    with _coalescing_manager():
        for k, n in enumerate(sizes):
            reduce_scatter_tensor(rs_out[k], ctx.inp(r, W * n, "float64", tag=f"rs{k}"),
                                   dist.ReduceOp.SUM)
    for k, n in enumerate(sizes):
        mine = [ctx.inp(q, W * n, "float64", tag=f"rs{k}")[r * n:(r + 1) * n] for q in range(W)]
        ctx.check_reduction(rs_out[k], mine, "float64", "SUM",
                            f"coalesced reduce_scatter_tensor[{k}]")
    ar = [ctx.inp(r, n, "int64", tag=f"ar{k}") for k, n in enumerate(sizes)]
    with _coalescing_manager():
        for t in ar:
            dist.all_reduce(t)
    for k, n in enumerate(sizes):
        ctx.compare(ar[k], ref_reduce([ctx.inp(q, n, "int64", tag=f"ar{k}") for q in range(W)],
                                      "int64", "SUM"), f"coalesced all_reduce[{k}]")


def c_p2p_tags(ctx):
    """isend/irecv with tags: messages are matched by (peer, tag), and by
    order within one tag; receives are posted in a different tag order."""
    W, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    a, b = ctx.inp(r, 40, "float32", tag="a"), ctx.inp(r, 41, "int64", tag="b")
    seq = [ctx.inp(r, 10 + k, "int16", tag=f"s{k}") for k in range(3)]
    sends = [dist.isend(a, dst=nxt, tag=1), dist.isend(b, dst=nxt, tag=2)]
    sends += [dist.isend(x, dst=nxt, tag=3) for x in seq]
    rb, ra = ctx.garbage(41, "int64"), ctx.garbage(40, "float32")
    rseq = [ctx.garbage(10 + k, "int16") for k in range(3)]
    recvs = [dist.irecv(rb, src=prv, tag=2), dist.irecv(ra, src=prv, tag=1)]
    recvs += [dist.irecv(x, src=prv, tag=3) for x in rseq]
    for w in recvs + sends:
        w.wait()
    ctx.compare(ra, ctx.inp(prv, 40, "float32", tag="a"), "irecv tag 1")
    ctx.compare(rb, ctx.inp(prv, 41, "int64", tag="b"), "irecv tag 2")
    for k in range(3):
        ctx.compare(rseq[k], ctx.inp(prv, 10 + k, "int16", tag=f"s{k}"),
                    f"irecv tag 3 message {k} (order within a tag)")


def c_p2p_send_buffer_reused(ctx):
    """A send's buffer is the caller's again once its wait returns. Even
    ranks send 1 MiB to the next rank and overwrite the tensor at once;
    the receiver posts its receive only 0.3 s later and must get what was
    sent (within a host such a message goes by reference, read from the
    sender's tensor: the wait lasts until the receiver has read it)."""
    W, r = ctx.world, ctx.rank
    n = 1 << 18
    if r % 2 == 0 and r + 1 < W:
        out = ctx.inp(r, n, "float32", tag="reused")
        dist.isend(out, dst=r + 1, tag=11).wait()
        out.fill_(-1.0)
    elif r % 2 == 1:
        time.sleep(0.3)
        got = ctx.garbage(n, "float32")
        dist.recv(got, src=r - 1, tag=11)
        ctx.compare(got, ctx.inp(r - 1, n, "float32", tag="reused"),
                    "a message whose sender overwrote its tensor after the wait")


def c_p2p_all_pairs(ctx):
    """Every rank sends to every other rank (irecv posted before isend)."""
    W, r = ctx.world, ctx.rank
    bufs = {p: ctx.garbage(50 + p, "float64") for p in range(W) if p != r}
    recvs = [dist.irecv(bufs[p], src=p, tag=7) for p in bufs]
    sends = [dist.isend(ctx.inp(r, 50 + r, "float64", tag=p), dst=p, tag=7)
             for p in range(W) if p != r]
    for w in recvs + sends:
        w.wait()
    for p, buf in bufs.items():
        ctx.compare(buf, ctx.inp(p, 50 + p, "float64", tag=r), f"message from {p}")


def c_batch_isend_irecv(ctx, n):
    W, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    to_next, to_prev = ctx.inp(r, n, "float32", tag="n"), ctx.inp(r, n, "float32", tag="p")
    from_prev, from_next = ctx.garbage(n, "float32"), ctx.garbage(n, "float32")
    ops = [dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.isend, to_prev, prv),
           dist.P2POp(dist.irecv, from_prev, prv), dist.P2POp(dist.irecv, from_next, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ctx.compare(from_prev, ctx.inp(prv, n, "float32", tag="n"), f"ring: from {prv}")
    ctx.compare(from_next, ctx.inp(nxt, n, "float32", tag="p"), f"ring: from {nxt}")


def c_barrier(ctx):
    """Every rank must have arrived before anyone leaves the barrier. The last
    rank arrives late; arrivals are recorded in the harness store."""
    W, r = ctx.world, ctx.rank
    for rnd in range(3):
        late = (W - 1 + rnd) % W
        if r == late:
            time.sleep(0.3)
        ctx.store.add(ctx.key(f"arrived{rnd}"), 1)
        dist.barrier()
        seen = ctx.store.add(ctx.key(f"arrived{rnd}"), 0)
        assert seen == W, f"round {rnd}: left the barrier after only {seen} of {W} " \
                          f"ranks had arrived (rank {late} was late)"


def c_objects(ctx):
    W, r = ctx.world, ctx.rank

    def obj(q):
        return {"rank": q, "data": list(range(q * 3)), "s": "x" * (q * 1000), "t": (q, None)}

    got = [None] * W
    dist.all_gather_object(got, obj(r))
    assert got == [obj(q) for q in range(W)], f"all_gather_object gave {got!r:.300}"
    src = W - 1
    lst = [obj(src), "hello", 3.5] if r == src else [None, None, None]
    dist.broadcast_object_list(lst, src=src)
    assert lst == [obj(src), "hello", 3.5], f"broadcast_object_list gave {lst!r:.300}"
    gl = [None] * W if r == 0 else None
    dist.gather_object(obj(r), gl, dst=0)
    if r == 0:
        assert gl == [obj(q) for q in range(W)], f"gather_object gave {gl!r:.300}"
    out = [None]
    dist.scatter_object_list(out, [obj(q + 10) for q in range(W)] if r == src else None,
                             src=src)
    assert out[0] == obj(r + 10), f"scatter_object_list gave {out[0]!r:.300}"
    if W >= 2:
        if r == 0:
            dist.send_object_list([obj(77), {"k": 1}], dst=1)
        elif r == 1:
            lst = [None, None]
            dist.recv_object_list(lst, src=0)
            assert lst == [obj(77), {"k": 1}], f"recv_object_list gave {lst!r:.300}"


SUBGROUPS = {  # per world size: the groups every rank creates (in this order)
    2: [[1], [1, 0], [0, 1]],
    3: [[0, 2], [2, 0], [1, 2]],
    4: [[1, 3], [0, 2], [2, 0], [0, 1, 3]],
}


def c_subgroups(ctx):
    """Ops on subgroups (members in any order; ranks keep their global ids),
    a rank outside the group, and groups used interleaved with each other."""
    W, r = ctx.world, ctx.rank
    specs = SUBGROUPS[W]
    groups = [dist.new_group(ranks) for ranks in specs]
    try:
        for gi, (ranks, g) in enumerate(zip(specs, groups)):
            members = sorted(ranks)
            tag = f"g{gi}"
            if r not in members:
                t = ctx.inp(r, 9, "float32", tag=tag)
                before = t.clone()
                ret = dist.all_reduce(t, group=g)
                assert ret is None, f"non-member all_reduce on {ranks} returned {ret!r}"
                ctx.compare(t, before, f"non-member tensor after all_reduce on {ranks}")
                assert dist.get_rank(g) == -1, f"get_rank on non-member group {ranks}"
                continue
            assert dist.get_world_size(g) == len(members)
            assert dist.get_rank(g) == members.index(r), \
                f"group rank of {r} in {ranks} is {dist.get_rank(g)}"
            t = ctx.inp(r, 1023, "float32", tag=tag)
            dist.all_reduce(t, group=g)
            ctx.check_reduction(t, [ctx.inp(q, 1023, "float32", tag=tag) for q in members],
                                "float32", "SUM", f"all_reduce on group {ranks}")
            src = members[-1]
            b = ctx.inp(src, 20, "int64", tag=tag) if r == src else ctx.garbage(20, "int64")
            dist.broadcast(b, src=src, group=g)
            ctx.compare(b, ctx.inp(src, 20, "int64", tag=tag), f"broadcast on {ranks}")
            out = ctx.garbage(len(members) * 7, "int32")
            all_gather_tensor(out, ctx.inp(r, 7, "int32", tag=tag), group=g)
            ctx.compare(out, torch.cat([ctx.inp(q, 7, "int32", tag=tag) for q in members]),
                        f"all_gather_into_tensor on {ranks}")
            red = ctx.inp(r, 5, "int64", tag=tag + "r")
            dist.reduce(red, dst=members[0], op=dist.ReduceOp.MAX, group=g)
            if r == members[0]:
                ctx.compare(red, ref_reduce([ctx.inp(q, 5, "int64", tag=tag + "r")
                                             for q in members], "int64", "MAX"),
                            f"reduce on {ranks}")
            if len(members) >= 2:  # p2p inside the group, global ranks
                a, z = members[0], members[-1]
                if r == a:
                    dist.send(ctx.inp(a, 6, "float64", tag=tag), dst=z, group=g, tag=4)
                elif r == z:
                    buf = ctx.garbage(6, "float64")
                    dist.recv(buf, src=a, group=g, tag=4)
                    ctx.compare(buf, ctx.inp(a, 6, "float64", tag=tag), f"p2p on {ranks}")
            dist.barrier(group=g)

        # interleaved: async ops on every group this rank is in, plus the world
        pending = []
        for gi, (ranks, g) in enumerate(zip(specs, groups)):
            if r in ranks:
                t = ctx.inp(r, 300, "int64", tag=f"i{gi}")
                pending.append((sorted(ranks), gi, t, dist.all_reduce(t, group=g,
                                                                      async_op=True)))
            world_t = ctx.inp(r, 300, "int64", tag=f"w{gi}")
            pending.append((list(range(W)), f"w{gi}", world_t,
                            dist.all_reduce(world_t, async_op=True)))
        for members, gi, t, w in reversed(pending):
            w.wait()
            tag = f"i{gi}" if isinstance(gi, int) else gi
            ctx.compare(t, ref_reduce([ctx.inp(q, 300, "int64", tag=tag) for q in members],
                                      "int64", "SUM"), f"interleaved all_reduce {gi}")
    finally:
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
    ctx.check_usable(what="after destroying the subgroups")


def c_subgroup_local_sync(ctx):
    """new_group(use_local_synchronization=True): only the members rendezvous."""
    W, r = ctx.world, ctx.rank
    members = [q for q in range(W) if q % 2 == 1] or [0]
    if r in members:
        g = dist.new_group(members, use_local_synchronization=True)
        t = ctx.inp(r, 11, "float64")
        dist.all_reduce(t, group=g, op=dist.ReduceOp.MIN)
        ctx.compare(t, ref_reduce([ctx.inp(q, 11, "float64") for q in members],
                                  "float64", "MIN"), f"all_reduce on local group {members}")
        dist.destroy_process_group(g)
    ctx.check_usable(what="after a member-only group")


def c_many_groups(ctx):
    """Two extra full-world groups used interleaved with the default group."""
    W, r = ctx.world, ctx.rank
    ga, gb = dist.new_group(list(range(W))), dist.new_group(list(range(W)))
    try:
        ta = [ctx.inp(r, 200, "float32", tag=f"a{k}") for k in range(3)]
        tb = [ctx.inp(r, 200, "float32", tag=f"b{k}") for k in range(3)]
        td = [ctx.inp(r, 200, "float32", tag=f"d{k}") for k in range(3)]
        works = []
        for k in range(3):
            works.append(dist.all_reduce(ta[k], group=ga, async_op=True))
            works.append(dist.all_reduce(td[k], async_op=True))
            works.append(dist.all_reduce(tb[k], group=gb, op=dist.ReduceOp.MAX,
                                         async_op=True))
        for w in works:
            w.wait()
        for k in range(3):
            for name, ts, op in (("a", ta, "SUM"), ("d", td, "SUM"), ("b", tb, "MAX")):
                ctx.check_reduction(ts[k], [ctx.inp(q, 200, "float32", tag=f"{name}{k}")
                                            for q in range(W)], "float32", op,
                                    f"group {name} op {k}")
    finally:
        dist.destroy_process_group(ga)
        dist.destroy_process_group(gb)


def c_sequence_and_name(ctx):
    pg = dist.distributed_c10d._get_default_group()
    assert dist.get_backend() == ctx.backend, f"get_backend() is {dist.get_backend()!r}"
    be = pg._get_backend(torch.device("cpu"))
    name = be.name() if callable(getattr(be, "name", None)) else None
    assert name == ctx.backend, f"backend name is {name!r}, expected {ctx.backend!r}"
    # Asked of the backend itself: torch 2.13's ProcessGroup wrapper refuses
    # sequence numbers for every custom backend before asking it.
    seq0 = be._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(3))
    dist.all_reduce(torch.ones(3))
    seq1 = be._get_sequence_number_for_group()
    assert seq1 > seq0, f"sequence number did not advance: {seq0} -> {seq1}"
    deltas = [None] * ctx.world
    dist.all_gather_object(deltas, seq1 - seq0)
    assert len(set(deltas)) == 1, \
        f"two all_reduces advanced the sequence number differently per rank: {deltas}"


def c_noncontig(ctx, op):
    """Non-contiguous tensors work (tccomm stages them through contiguous
    copies): correct results, and the memory around a strided view is left
    as it was."""
    W, r = ctx.world, ctx.rank
    base = ctx.inp(r, (64, 10), "float32")
    orig = base.clone()
    view = base[:, ::2]  # non-contiguous
    assert not view.is_contiguous()
    if op == "all_reduce":
        def run():
            dist.all_reduce(view)

        def check():
            ctx.check_reduction(view, [ctx.inp(q, (64, 10), "float32")[:, ::2]
                                       for q in range(W)], "float32", "SUM",
                                "all_reduce on a strided view")
            ctx.same_bits(base[:, 1::2], orig[:, 1::2], "memory between the strided elements")
    elif op == "broadcast":
        tview = base.t()

        def run():
            dist.broadcast(tview, src=W - 1)

        def check():
            ctx.same_bits(base, ctx.inp(W - 1, (64, 10), "float32"), "broadcast of a transpose")
    elif op == "all_gather":
        outs_base = [ctx.garbage((64, 10), "float32") for _ in range(W)]
        outs_orig = [o.clone() for o in outs_base]
        outs = [o[:, ::2] for o in outs_base]

        def run():
            dist.all_gather(outs, view)

        def check():
            for q in range(W):
                ctx.same_bits(outs[q], ctx.inp(q, (64, 10), "float32")[:, ::2],
                              f"all_gather strided output[{q}]")
                ctx.same_bits(outs_base[q][:, 1::2], outs_orig[q][:, 1::2],
                              "memory between the strided output elements")
    elif op == "all_gather_into_tensor":
        out = ctx.garbage(W * 64 * 5, "float32")

        def run():
            all_gather_tensor(out, view)

        def check():
            exp = torch.cat([ctx.inp(q, (64, 10), "float32")[:, ::2].reshape(-1)
                             for q in range(W)])
            ctx.same_bits(out, exp, "all_gather_into_tensor of a strided input")
    elif op == "all_to_all_single":
        inp = ctx.inp(r, (10, 4 * W), "float32").t()  # (4W, 10), non-contiguous
        out = ctx.garbage((4 * W, 10), "float32")

        def run():
            dist.all_to_all_single(out, inp)

        def check():
            exp = torch.cat([ctx.inp(q, (10, 4 * W), "float32").t()[4 * r:4 * r + 4]
                             for q in range(W)])
            ctx.same_bits(out, exp, "all_to_all_single of a transposed input")
    else:
        raise ValueError(op)
    run()
    check()


def c_meta(ctx):
    """Meta tensors never reach a backend: torch's own meta kernels answer
    them. The call must return and leave the group untouched."""
    t = torch.empty(8, 3, device="meta")
    dist.all_reduce(t)
    outs = [torch.empty(8, 3, device="meta") for _ in range(ctx.world)]
    dist.all_gather(outs, t)
    assert t.shape == (8, 3) and t.device.type == "meta"
    ctx.check_usable(what="after ops on meta tensors")


def c_transport_in_use(ctx):
    """Shared memory is used by default on one host, and within each host of
    a group that spans hosts; TCCOMM_TRANSPORT=tcp must really avoid it, as
    must a rank alone on its host (seen from this process's memory mappings)."""
    if not ctx.strict:
        raise Skip("checks tccomm's transport choice; not applicable to "
                   f"{ctx.backend}")
    t = torch.ones(4096)
    dist.all_reduce(t)
    maps = shm_mappings()
    if ctx.transport == "shm":
        assert maps, ("TCCOMM_TRANSPORT is unset on a single host, but this process "
                      "maps no shared memory (/dev/shm or memfd): the shm transport "
                      "is not in use")
    elif ctx.transport == "hybrid":
        neighbours = ctx.hosts.count(ctx.hosts[ctx.rank]) - 1
        if neighbours:
            assert maps, (f"this rank shares its host with {neighbours} other rank(s), but "
                          "maps no shared memory: the hybrid transport does not use shm there")
        else:
            assert not maps, f"this rank is alone on its host, but shared memory is mapped: {maps}"
    else:
        assert not maps, f"TCCOMM_TRANSPORT=tcp, but shared memory is mapped: {maps}"


def c_reinit(ctx):
    """destroy_process_group(), then init_process_group again in this process."""
    W, r = ctx.world, ctx.rank
    dist.destroy_process_group()
    assert not dist.is_initialized(), "is_initialized() after destroy_process_group()"
    dist.init_process_group(ctx.backend, init_method=f"tcp://127.0.0.1:{ctx.cfg['reinit_port']}",
                            rank=r, world_size=W, timeout=ctx.timeout)
    assert dist.get_backend() == ctx.backend
    for k in range(2):
        t = ctx.inp(r, 1000, "float32", tag=k)
        dist.all_reduce(t)
        ctx.check_reduction(t, [ctx.inp(q, 1000, "float32", tag=k) for q in range(W)],
                            "float32", "SUM", f"all_reduce {k} after re-init")
    outs = [ctx.garbage(8, "int64") for _ in range(W)]
    dist.all_gather(outs, ctx.inp(r, 8, "int64"))
    for q in range(W):
        ctx.compare(outs[q], ctx.inp(q, 8, "int64"), f"all_gather[{q}] after re-init")


def c_destroy_releases(ctx):
    """destroy_process_group() releases the shared memory and the sockets: a
    fresh group (with a subgroup) is created, used and destroyed, and the
    process ends up with no more sockets than before it, and no shared memory."""
    W, r = ctx.world, ctx.rank
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    maps = shm_mappings()
    assert not maps, f"shared memory still mapped after destroy_process_group(): {maps}"
    # torch itself keeps the rendezvous TCPStore alive once a subgroup exists
    # (gloo does the same): its sockets are not counted.
    port = ctx.cfg["reinit_port2"]
    before = open_sockets(exclude_port=port)
    dist.init_process_group(ctx.backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=r, world_size=W, timeout=ctx.timeout)
    g = dist.new_group(list(range(W)))
    t = torch.ones(100)
    dist.all_reduce(t)
    dist.all_reduce(t, group=g)
    outs = [torch.zeros(100) for _ in range(W)]
    dist.all_gather(outs, t, group=g)
    ctx.compare(t, torch.full((100,), float(W * W)), "all_reduce on the fresh group")
    del outs, t
    dist.destroy_process_group()
    assert not dist.is_initialized()
    gc.collect()
    maps = shm_mappings()
    assert not maps, f"shared memory still mapped after destroy_process_group(): {maps}"
    # Give closes done asynchronously (e.g. the TCPStore server's event loop) a moment.
    deadline = time.monotonic() + 3.0
    after = open_sockets(exclude_port=port)
    while len(after) > len(before) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = open_sockets(exclude_port=port)
    new = sorted(set(after) - set(before))
    assert len(after) <= len(before), (f"{len(after) - len(before)} more open sockets "
                                       f"after a group was created and destroyed: {new}")


def _register_features():
    S = "feat"
    add("async_work", S, c_async_work)
    add("all_reduce_coalesced", S, c_all_reduce_coalesced)
    add("all_gather_coalesced", S, c_all_gather_coalesced)
    add("coalescing_manager", S, c_coalescing_manager)
    add("p2p_tags", S, c_p2p_tags)
    add("p2p_all_pairs", S, c_p2p_all_pairs)
    add("p2p_send_buffer_reused", S, c_p2p_send_buffer_reused)
    add("batch_isend_irecv-n1000", S, c_batch_isend_irecv, n=1000)
    add(f"batch_isend_irecv-n{LARGE_PART}", S, c_batch_isend_irecv, n=LARGE_PART)
    add("barrier", S, c_barrier)
    add("objects", S, c_objects)
    add("subgroups", S, c_subgroups)
    # Runs late: torch's group counter diverges between members and non-members
    # after a member-only group, so later new_group() calls would not match up.
    add("subgroup_local_sync", S, c_subgroup_local_sync, order=80)
    add("meta_tensor_handled_by_torch", S, c_meta)
    add("many_groups_interleaved", S, c_many_groups)
    add("backend_name_and_sequence_number", S, c_sequence_and_name)
    for op in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_to_all_single"):
        gs = {"all_reduce": "gloo reduces the wrong memory of a strided view (half of "
                            "the elements come back unreduced)",
              "all_gather_into_tensor": "gloo refuses a non-contiguous input here "
                                        "(\"invalid tensor size\")",
              "all_to_all_single": "gloo refuses non-contiguous tensors here "
                                   "(\"Tensors must be contiguous\")"}.get(op)
        add(f"noncontiguous-{op}", S, c_noncontig, op=op, gloo_skip=gs)
    add("transport_in_use", S, c_transport_in_use)
    add("reinit_after_destroy", S, c_reinit, order=90)
    add("destroy_releases_resources", S, c_destroy_releases, order=99)


_register_features()
