"""Cases for functional collectives, torch.compile and PyTorch's parallelism
stack (DeviceMesh, split, FSDP2, DTensor) on the backend under test.

Registered into the registry (tests/_registry.py); reported
by tests/test_functional.py ("funcol"), tests/test_compile.py ("compile") and
tests/test_parallel.py ("parallel"). References are plain torch computations
on every rank's inputs, or the same training run on gloo in the same processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from _messages import op_re
from _reference import FLOATS, reduction_bound, ref_reduce
from _registry import add
from _training import assert_same_params

# The compiled and training cases run in groups of their own, so that their
# compile time does not eat into the budget of the collective specs.
COMPILE_SPECS = ("w2-shm-env-parallel", "w4-tcp-env-parallel")
PARALLEL_SPECS = ("w2-shm-env-parallel", "w4-tcp-env-parallel", "w4-hybrid-env-parallel")
# 2 x 2 meshes: on the hybrid spec the inner dimension is within a host, the
# outer one across hosts.
MESH_SPECS = ("w4-tcp-env-parallel", "w4-hybrid-env-parallel")
# torch.compile of a few collectives takes tens of seconds per rank on a
# 2-core machine running 4 ranks: such a case may show no progress for longer
# than the default hang limit.
COMPILE_HANG_LIMIT = 400.0


def fast_path_calls() -> int:
    """Ops served by tccomm's _c10d_functional kernels in this process."""
    return torch.ops.tccomm.functional_fast_path_calls()


class FastPathCount:
    """Checks how many functional ops a block sent down tccomm's fast path
    (only when tccomm is the backend under test)."""

    def __init__(self, ctx, expected: int | None, what: str):
        self.ctx, self.expected, self.what = ctx, expected, what

    def __enter__(self):
        self.before = fast_path_calls() if self.ctx.strict else 0
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None or not self.ctx.strict:
            return
        got = fast_path_calls() - self.before
        if self.expected is None:
            assert got > 0, f"{self.what}: no op went through tccomm's functional fast path"
        else:
            assert got == self.expected, (
                f"{self.what}: {got} ops went through tccomm's functional fast path, "
                f"expected {self.expected}")


def _a2a_rows(i: int, j: int) -> int:
    """Rows rank i sends to rank j in the uneven all_to_all_single."""
    return (i + 2 * j) % 3 + 1


def _a2a_input(r: int, W: int) -> torch.Tensor:
    return torch.cat([torch.full((_a2a_rows(r, j), 2), 100.0 * r + j) for j in range(W)])


def _a2a_expected(r: int, W: int) -> torch.Tensor:
    return torch.cat([torch.full((_a2a_rows(j, r), 2), 100.0 * j + r) for j in range(W)])


def _funcol_ops(ctx, group, label: str, exact: bool) -> int:
    """Every _c10d_functional op on `group` against references; returns how
    many ops it issued. `exact`: the group reduces floats in rank order (as
    tccomm specifies), so float reductions are compared bit for bit."""
    W, r = ctx.world, ctx.rank
    ops = torch.ops._c10d_functional
    name = group.group_name
    issued = 0

    def inp(q, shape, dtype, tag):
        return ctx.inp(q, shape, dtype, tag=f"{label}/{tag}")

    def everyone(shape, dtype, tag):
        return [inp(q, shape, dtype, tag) for q in range(W)]

    def check(actual, expected, what):
        """Moved data, or integer results: every bit."""
        ctx.same_bits(actual, expected, f"{label} group: {what}")

    def check_reduced(actual, xs, dtype, redop, what):
        exact_here = exact or dtype not in FLOATS or redop in ("MIN", "MAX")
        bound = None if exact_here else reduction_bound(xs, dtype, redop)
        ctx.compare(actual, ref_reduce(xs, dtype, redop), f"{label} group: {what}",
                    exact_here, bound=bound)

    for redop, dtype in (("sum", "int64"), ("max", "int32"), ("avg", "float64"),
                         ("sum", "float32")):
        x = inp(r, 37, dtype, redop)
        x0 = x.clone()
        y = ops.wait_tensor(ops.all_reduce(x, redop, name))
        check_reduced(y, everyone(37, dtype, redop), dtype, redop.upper(),
                      f"all_reduce {redop} on {dtype}")
        check(x, x0, f"all_reduce {redop} leaves its input alone")
        issued += 1

    x = inp(r, (6, 4), "float64", "strided").t()  # read where it is, not copied first
    x0 = x.clone()
    y = ops.wait_tensor(ops.all_reduce(x, "sum", name))
    assert y.shape == x.shape and y.is_contiguous(), (y.shape, y.stride())
    check_reduced(y, [q.t() for q in everyone((6, 4), "float64", "strided")], "float64", "SUM",
                  "all_reduce of a non-contiguous input")
    check(x, x0, "all_reduce leaves a non-contiguous input alone")
    issued += 1

    x = inp(r, (3, 5), "int32", "inplace")
    y = ops.wait_tensor(ops.all_reduce_(x, "sum", name))
    assert y.data_ptr() == x.data_ptr(), "all_reduce_ did not return its input"
    check(x, ref_reduce(everyone((3, 5), "int32", "inplace"), "int32", "SUM"), "all_reduce_")
    issued += 1

    shapes = ((5,), (3, 2))
    xs = [inp(r, s, "int64", f"coal{k}") for k, s in enumerate(shapes)]
    refs = [ref_reduce(everyone(s, "int64", f"coal{k}"), "int64", "SUM")
            for k, s in enumerate(shapes)]
    ys = ops.all_reduce_coalesced(xs, "sum", name)
    for k, y in enumerate(ys):
        check(ops.wait_tensor(y), refs[k], f"all_reduce_coalesced tensor {k}")
    issued += 1
    ops.all_reduce_coalesced_(xs, "sum", name)
    for k, x in enumerate(xs):
        check(ops.wait_tensor(x), refs[k], f"all_reduce_coalesced_ tensor {k}")
    issued += 1

    x = inp(r, (3, 4), "float32", "ag")
    expected = torch.cat(everyone((3, 4), "float32", "ag"))
    check(ops.wait_tensor(ops.all_gather_into_tensor(x, W, name)), expected, "all_gather_into_tensor")
    out = ctx.garbage((3 * W, 4), "float32")
    ops.all_gather_into_tensor_out(x, W, name, out=out)
    check(ops.wait_tensor(out), expected, "all_gather_into_tensor_out")
    ys = ops.all_gather_into_tensor_coalesced([x, inp(r, 2, "int16", "ag2")], W, name)
    check(ops.wait_tensor(ys[0]), expected, "all_gather_into_tensor_coalesced tensor 0")
    check(ops.wait_tensor(ys[1]), torch.cat(everyone(2, "int16", "ag2")),
          "all_gather_into_tensor_coalesced tensor 1")
    issued += 3

    x = inp(r, (2 * W, 3), "int64", "rs")
    full = ref_reduce(everyone((2 * W, 3), "int64", "rs"), "int64", "SUM")
    mine = full[2 * r:2 * r + 2]
    check(ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", W, name)), mine, "reduce_scatter_tensor")
    out = ctx.garbage((2, 3), "int64")
    ops.reduce_scatter_tensor_out(x, "sum", W, name, out=out)
    check(ops.wait_tensor(out), mine, "reduce_scatter_tensor_out")
    x2 = inp(r, W, "float64", "rs2")
    ys = ops.reduce_scatter_tensor_coalesced([x, x2], "max", W, name)
    check(ops.wait_tensor(ys[0]),
          ref_reduce(everyone((2 * W, 3), "int64", "rs"), "int64", "MAX")[2 * r:2 * r + 2],
          "reduce_scatter_tensor_coalesced tensor 0")
    check_reduced(ops.wait_tensor(ys[1]), [q[r:r + 1] for q in everyone(W, "float64", "rs2")],
                  "float64", "MAX", "reduce_scatter_tensor_coalesced tensor 1")
    x3 = inp(r, 3 * W, "float32", "rs3")
    check_reduced(ops.wait_tensor(ops.reduce_scatter_tensor(x3, "avg", W, name)),
                  [q[3 * r:3 * r + 3] for q in everyone(3 * W, "float32", "rs3")],
                  "float32", "AVG", "reduce_scatter_tensor avg on float32")
    issued += 4

    out_splits = [_a2a_rows(j, r) for j in range(W)]
    in_splits = [_a2a_rows(r, j) for j in range(W)]
    y = ops.all_to_all_single(_a2a_input(r, W), out_splits, in_splits, name)
    check(ops.wait_tensor(y), _a2a_expected(r, W), "all_to_all_single (uneven splits)")
    issued += 1

    src = W - 1
    x = inp(r, 11, "float16", "bc")
    x0 = x.clone()
    check(ops.wait_tensor(ops.broadcast(x, src, name)), inp(src, 11, "float16", "bc"), "broadcast")
    check(x, x0, "broadcast leaves its input alone")
    ops.broadcast_(x, src, name)
    check(ops.wait_tensor(x), inp(src, 11, "float16", "bc"), "broadcast_")
    issued += 2

    # torch's Python API on top of the ops, with the group given as an object.
    x = inp(r, 6, "int64", "funcol")
    y = funcol.all_reduce(x, "sum", group)
    check(y.wait() if hasattr(y, "wait") else y,
          ref_reduce(everyone(6, "int64", "funcol"), "int64", "SUM"), "funcol.all_reduce")
    issued += 1
    return issued


def c_funcol_ops(ctx):
    """Every _c10d_functional op on the group under test and on a gloo group
    in the same processes gives the reference result; on tccomm each op is
    served by tccomm's fast path, and no op on the gloo group is."""
    gloo = dist.new_group(list(range(ctx.world)), backend="gloo")
    try:
        # gloo reduces in an order of its own; tccomm in rank order.
        for label, group, exact in (("test", dist.group.WORLD, ctx.strict), ("gloo", gloo, False)):
            expected = None if label == "test" else 0
            with FastPathCount(ctx, expected, f"functional ops on the {label} group") as count:
                issued = _funcol_ops(ctx, group, label, exact)
                if label == "test":
                    count.expected = issued
    finally:
        dist.destroy_process_group(gloo)


def c_funcol_autograd(ctx):
    """Gradients through funcol.all_reduce and all_gather_tensor (torch's
    autograd functions for the functional ops, which tccomm hands calls that
    need a gradient) match the analytic ones, on tccomm and on gloo."""
    W, r = ctx.world, ctx.rank
    gloo = dist.new_group(list(range(W)), backend="gloo")
    try:
        for label, group in (("test", dist.group.WORLD), ("gloo", gloo)):
            x = torch.arange(4.0, requires_grad=True)
            y = funcol.all_reduce(x * (r + 1), "sum", group)
            y = y.wait() if hasattr(y, "wait") else y
            (y * (r + 1)).sum().backward()
            # d/dx of sum_q (q+1) * sum_p (p+1) x = (r+1) * sum_q (q+1), per rank
            s = sum(q + 1 for q in range(W))
            ctx.compare(x.grad, torch.full((4,), float((r + 1) * s)), f"{label}: grad of all_reduce")
            z = torch.full((3,), float(r), requires_grad=True)
            g = funcol.all_gather_tensor(z, 0, group)
            g = g.wait() if hasattr(g, "wait") else g
            weights = torch.arange(3.0 * W) * (r + 1)
            (g * weights).sum().backward()
            # block r of the gathered output is z; its weight summed over ranks
            expected = torch.arange(3.0 * r, 3.0 * r + 3) * s
            ctx.compare(z.grad, expected, f"{label}: grad of all_gather_tensor")
    finally:
        dist.destroy_process_group(gloo)


def c_funcol_bad_input(ctx):
    """Bad arguments to the functional ops raise clear errors naming the op
    and the cause; the group stays usable."""
    W = ctx.world
    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    ctx.expect_error(lambda: ops.all_reduce(torch.ones(3), "median", name),
                     op_re("all_reduce"), r"reduce op|median",
                     "all_reduce with an unknown reduce op")
    ctx.expect_error(lambda: ops.all_gather_into_tensor(torch.ones(3), W + 1, name),
                     op_re("all_gather_into_tensor"), r"group.?size|size",
                     "all_gather_into_tensor with a wrong group_size")
    ctx.expect_error(lambda: ops.reduce_scatter_tensor(torch.ones(W * 2 + 1), "sum", W, name),
                     op_re("reduce_scatter_tensor"), r"divisible|size|numel",
                     "reduce_scatter_tensor of an indivisible input")
    ctx.check_usable()


def c_compile_funcol(ctx):
    """A torch.compile(fullgraph=True) function calling every functional
    collective and dist.all_reduce gives the eager results, without a graph
    break, and its compiled code calls into tccomm."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    W, r = ctx.world, ctx.rank
    group = dist.group.WORLD
    out_splits = [_a2a_rows(j, r) for j in range(W)]
    in_splits = [_a2a_rows(r, j) for j in range(W)]

    def fn(x, y, z, a2a):
        s = funcol.all_reduce(x * 2, "sum", group)
        m = funcol.all_reduce(x, "max", group)
        g = funcol.all_gather_tensor(y, 0, group)
        rs = funcol.reduce_scatter_tensor(z, "sum", 0, group)
        t = funcol.all_to_all_single(a2a, out_splits, in_splits, group)
        b = funcol.broadcast(y + 1, W - 1, group)
        d = x.clone()
        dist.all_reduce(d, group=group)
        return s + 1, m, g * 3, rs, t, b, d

    args = (ctx.inp(r, 16, "float32", tag="x"), ctx.inp(r, (3, 4), "float32", tag="y"),
            ctx.inp(r, (2 * W, 5), "float32", tag="z"), _a2a_input(r, W))
    eager = [t.wait() if hasattr(t, "wait") else t for t in fn(*args)]
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True)
    with FastPathCount(ctx, None, "the compiled function"):
        got = compiled(*args)
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    names = ["all_reduce sum", "all_reduce max", "all_gather_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "broadcast", "dist.all_reduce"]
    for what, a, e in zip(names, got, eager):
        ctx.compare(a, e, f"compiled {what} vs eager", exact=True)
    # And both are right: every output against plain torch on all ranks' inputs.
    xs = [ctx.inp(q, 16, "float32", tag="x") for q in range(W)]
    ys = [ctx.inp(q, (3, 4), "float32", tag="y") for q in range(W)]
    zs = [ctx.inp(q, (2 * W, 5), "float32", tag="z")[2 * r:2 * r + 2] for q in range(W)]
    x2s = [x * 2 for x in xs]  # exact: a power of two
    reduced = {  # output index -> (inputs, reduce op, what is done to the result)
        0: (x2s, "SUM", lambda t: t + 1), 1: (xs, "MAX", None), 3: (zs, "SUM", None),
        6: (xs, "SUM", None)}
    exact = ctx.exact_for("float32", "SUM")
    for k, (ins, redop, then) in reduced.items():
        ref = ref_reduce(ins, "float32", redop)
        bound = None
        if not exact and redop == "SUM":
            bound = reduction_bound(ins, "float32", redop)
            if then is not None:  # one more rounding, of a value near |ref| + 1
                bound = bound + torch.finfo(torch.float32).eps * (ref.double().abs() + 1)
        ctx.compare(got[k], then(ref) if then else ref, f"compiled {names[k]} vs plain torch",
                    exact or redop == "MAX", bound=bound)
    ctx.compare(got[2], torch.cat(ys) * 3, "compiled all_gather_tensor vs plain torch")
    ctx.same_bits(got[4], _a2a_expected(r, W), "compiled all_to_all_single vs plain torch")
    ctx.compare(got[5], ys[W - 1] + 1, "compiled broadcast vs plain torch")
    ctx.digest(*(got[k] for k in (0, 1, 2, 5, 6)))  # the results every rank shares


class _TpMlp(torch.nn.Module):
    """A two-layer MLP, tensor-parallel by hand: the first layer's output
    features and the second layer's input features are split across ranks;
    an all_reduce sums the partial outputs (Megatron-style)."""

    def __init__(self, w1, b1, w2, b2, group):
        super().__init__()
        self.w1, self.b1, self.w2, self.b2, self.group = w1, b1, w2, b2, group

    def forward(self, x):
        h = torch.relu(x @ self.w1.t() + self.b1)
        partial = h @ self.w2.t()
        return funcol.all_reduce(partial, "sum", self.group) + self.b2


def c_compile_tp_mlp(ctx):
    """A small tensor-parallel MLP: compiled == eager, and both match the
    unsharded MLP computed locally."""
    W, r = ctx.world, ctx.rank
    g = torch.Generator().manual_seed(7)
    d_in, d_hidden, d_out = 8, 4 * W, 6
    w1, b1 = torch.randn(d_hidden, d_in, generator=g), torch.randn(d_hidden, generator=g)
    w2, b2 = torch.randn(d_out, d_hidden, generator=g), torch.randn(d_out, generator=g)
    x = torch.randn(5, d_in, generator=g)
    rows = slice(4 * r, 4 * r + 4)
    mlp = _TpMlp(w1[rows], b1[rows], w2[:, rows], b2, dist.group.WORLD)
    eager = mlp(x)
    eager = eager.wait() if hasattr(eager, "wait") else eager
    import torch._dynamo as dynamo
    dynamo.reset()
    with FastPathCount(ctx, None, "the compiled MLP"):
        got = torch.compile(mlp, fullgraph=True)(x)
    reference = torch.relu(x @ w1.t() + b1) @ w2.t() + b2
    ctx.compare(got, eager, "compiled TP MLP vs eager", exact=True)
    torch.testing.assert_close(eager, reference, rtol=1e-5, atol=1e-5)
    ctx.digest(got)


def c_device_mesh(ctx):
    """init_device_mesh('cpu', (2, W/2)) builds tccomm sub-groups; a
    collective on each mesh dimension sums over exactly that dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    W, r = ctx.world, ctx.rank
    shape = (2, W // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    grid = torch.arange(W).view(shape)
    for dim, dim_name in enumerate(("dp", "tp")):
        group = mesh.get_group(dim_name)
        assert dist.get_backend(group) == ctx.backend, \
            f"mesh dim {dim_name} uses {dist.get_backend(group)}"
        members = (grid[:, (grid == r).nonzero()[0, 1]] if dim == 0
                   else grid[(grid == r).nonzero()[0, 0]]).tolist()
        assert dist.get_process_group_ranks(group) == members, \
            f"mesh dim {dim_name}: ranks {dist.get_process_group_ranks(group)}, expected {members}"
        t = torch.full((4,), float(r + 1))
        dist.all_reduce(t, group=group)
        ctx.compare(t, torch.full((4,), float(sum(m + 1 for m in members))),
                    f"all_reduce over mesh dim {dim_name}")


def c_split_group(ctx):
    """Backend splitting: ProcessGroup.split_group (what dist.split_group
    calls) makes child groups whose members got their new ranks from the
    order of the list, and whose ops work; a rank outside gets None; bad rank
    lists raise."""
    W, r = ctx.world, ctx.rank
    world = dist.group.WORLD
    backend = world._get_backend(torch.device("cpu"))
    assert backend.supports_splitting, "the backend does not support splitting"
    # Reversed odd ranks, and rank 0 alone outside for W >= 3.
    splits = [list(range(W - 1, 0, -2)), list(range(W - 2, 0, -2))] if W >= 3 else [[1, 0]]
    mine = next((s for s in splits if r in s), None)
    ask = mine if mine is not None else splits[0]
    child = world.split_group(ask, timeout=ctx.timeout, group_name=f"split-{'-'.join(map(str, ask))}")
    if mine is None:
        assert child is None, f"rank {r} is in no split but got a group"
    else:
        assert child is not None, f"rank {r} is in {mine} but got no group"
        assert child.size() == len(mine), f"child size {child.size()} for {mine}"
        # The child's rank order is the order of the list torch hands the
        # backend (torch 2.14 keeps the caller's order, 2.13 sorts it): learn
        # it through the child and check it is consistent.
        order = torch.zeros(len(mine), dtype=torch.int64)
        child.allgather_into_tensor_coalesced([order], [torch.tensor([r])]).wait()
        order = order.tolist()
        assert sorted(order) == sorted(mine) and order[child.rank()] == r, \
            f"child rank {child.rank()} of {mine}, ranks in child order {order}"
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14):
            assert order == mine, f"child rank order {order}, expected the list's order {mine}"
        t = torch.full((3,), float(r + 1))
        child.allreduce([t]).wait()
        ctx.compare(t, torch.full((3,), float(sum(q + 1 for q in mine))), f"all_reduce on split {mine}")
        b = torch.full((2,), float(r))
        child.broadcast([b]).wait()  # root: child rank 0
        ctx.compare(b, torch.full((2,), float(order[0])), f"broadcast on split {mine}")
    if ctx.strict:
        ctx.expect_error(lambda: world.split_group([r, W + 3], timeout=ctx.timeout),
                         op_re("split"), r"rank|range|size|group",
                         "split with a rank outside the group")
    ctx.check_usable()


def _train(model, steps, rank, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out.full_tensor() if hasattr(out, "full_tensor") else out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _full_params(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def _meshes(shape, names):
    """The same mesh on the backend under test and on gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    test = init_device_mesh("cpu", shape, mesh_dim_names=names)
    gloo = init_device_mesh("cpu", shape, mesh_dim_names=names,
                            backend_override={n: "gloo" for n in names})
    return test, gloo


def c_fsdp2(ctx, shape):
    """fully_shard (FSDP2) on a 1-D mesh, or HSDP on a 2-D mesh: 4 steps end
    with the same parameters as on gloo (every parameter, gathered)."""
    from torch.distributed.fsdp import fully_shard
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    shape = tuple(ctx.world if s == "W" else s for s in shape)
    runs = {}
    for label, mesh in zip(("test", "gloo"), _meshes(shape, names)):
        model = _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, 4, ctx.rank)
        runs[label] = _full_params(model)
    assert_same_params(ctx, runs["test"], runs["gloo"], f"FSDP2 on a {shape} mesh", rtol=1e-6, atol=1e-7)


def c_dtensor_tp(ctx):
    """A DTensor tensor-parallel MLP (ColwiseParallel, RowwiseParallel) over
    all ranks: 4 steps end with the same parameters as on gloo."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    runs = {}
    for label, mesh in zip(("test", "gloo"), _meshes((ctx.world,), ("tp",))):
        model = _mlp()
        # The last layer stays replicated: its input is whole again after "2".
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        # Every rank feeds the same batch (tensor parallelism splits weights, not data).
        _train(model, 4, 0)
        runs[label] = _full_params(model)
    assert_same_params(ctx, runs["test"], runs["gloo"], "DTensor tensor parallel", rtol=1e-6, atol=1e-7)


def _register():
    add("funcol_ops", "funcol", c_funcol_ops)
    add("funcol_autograd", "funcol", c_funcol_autograd)
    add("funcol_bad_input", "funcol", c_funcol_bad_input, gloo_skip="tccomm's own messages")
    add("compile_funcol", "compile", c_compile_funcol, specs=COMPILE_SPECS,
        hang_limit=COMPILE_HANG_LIMIT)
    add("compile_tp_mlp", "compile", c_compile_tp_mlp, specs=COMPILE_SPECS,
        hang_limit=COMPILE_HANG_LIMIT)
    add("device_mesh_2d", "parallel", c_device_mesh, specs=MESH_SPECS)
    add("split_group", "parallel", c_split_group, specs=PARALLEL_SPECS)
    add("fsdp2_1d", "parallel", c_fsdp2, specs=PARALLEL_SPECS, shape=("W",))
    add("fsdp2_2x2", "parallel", c_fsdp2, specs=MESH_SPECS, shape=(2, 2))
    add("dtensor_tp", "parallel", c_dtensor_tp, specs=PARALLEL_SPECS)


_register()
