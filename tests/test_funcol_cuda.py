"""Functional collectives (torch.ops._c10d_functional, funcol) on CUDA tensors.

tccomm registers its _c10d_functional kernels for the CUDA key (and
AutogradCUDA) when the extension is built with CUDA, next to the CPU ones
(csrc/functional.cpp): a group whose backend for CUDA is tccomm is served by
the TccBackend directly; every other group (nccl, gloo, ...) gets torch's
kernels, as without tccomm.

Runs everywhere:
  * the dispatch table: tccomm's kernels on CPU and AutogradCPU, and on CUDA
    and AutogradCUDA exactly when the build has CUDA; none at all with
    TCCOMM_FUNCOL_FASTPATH=0;
  * the routing, without a GPU: every functional op, sent on CPU tensors
    through the CPU key and (by redispatch) through the CUDA and AutogradCUDA
    keys, on a tccomm group, a gloo group and groups that are tccomm for one
    device type only, 2 ranks: right results, and the fast-path counter moves
    exactly for the (key, group) pairs whose backend for that key's device
    type is tccomm (for the CUDA keys only in a build with CUDA; never with
    TCCOMM_FUNCOL_FASTPATH=0).
Needs a GPU (skipped with the reason "no GPU" otherwise), 1 and 2 ranks, one
rank per GPU when there are enough GPUs, else all on cuda:0 with a host of
their own each (as in tests/test_cuda.py):
  * every functional op on CUDA tensors of a tccomm group, eager (the ops and
    funcol's API) and under torch.compile(fullgraph=True), against references
    computed here, each op counted by the fast path; the same ops on an nccl
    group give the same results and are not counted;
  * stream semantics: the op waits for the work queued on the current stream,
    and wait_tensor makes the current stream wait without blocking the host.

Ranks are spawned and watched by tests/_group.py; this file is also the
rank's program (python tests/test_funcol_cuda.py SCENARIO OUT_DIR).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TIMEOUT = {"routing": 150.0, "gpu": float(os.environ.get("TCCOMM_TEST_CUDA_TIMEOUT", "300"))}

# The ops tccomm serves (csrc/functional.cpp's kOps); wait_tensor stays torch's.
FAST_OPS = (
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
    "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "broadcast", "broadcast_",
)
KEYS = ("CPU", "AutogradCPU", "CUDA", "AutogradCUDA", "AutogradOther", "HIP", "XPU", "Meta")


# ---- the operations, shared by the routing and GPU scenarios ------------------

def rank_input(q, shape, dtype, tag):
    """Rank q's input: small integers (exact in any summation order), distinct
    per rank and per tag, on the host."""
    n = 1
    for s in (shape if isinstance(shape, tuple) else (shape,)):
        n *= s
    salt = sum(map(ord, tag)) % 5
    return ((torch.arange(n, dtype=torch.int64) * 3 + salt) % 11 + 20 * q + 1).reshape(shape).to(dtype)


def a2a_rows(i, j):
    """Rows rank i sends to rank j in the uneven all_to_all_single."""
    return (i + 2 * j) % 3 + 1


def run_ops(call, group_name, world, rank, device):
    """Every op tccomm serves, issued through call(op_name, *args, **kw) on
    `device`, each waited for with wait_tensor; returns (what, got, expected)
    triples (expected on the host) and the number of ops issued."""
    ops = torch.ops._c10d_functional
    W, r, g = world, rank, group_name
    checks = []

    def inp(q, shape, dtype, tag):
        return rank_input(q, shape, dtype, tag)

    def mine(shape, dtype, tag):
        return inp(r, shape, dtype, tag).to(device)

    def every(shape, dtype, tag):
        return [inp(q, shape, dtype, tag) for q in range(W)]

    def reduce(xs, how):
        out = xs[0].clone()
        for x in xs[1:]:
            out = out + x if how == "sum" else torch.maximum(out, x)
        return out

    def check(what, got, expected):
        checks.append((what, ops.wait_tensor(got), expected))

    x = mine(37, torch.float32, "ar")
    check("all_reduce sum", call("all_reduce", x, "sum", g), reduce(every(37, torch.float32, "ar"), "sum"))
    checks.append(("all_reduce leaves its input alone", x, inp(r, 37, torch.float32, "ar")))
    x = mine((3, 5), torch.int64, "ar_")
    y = call("all_reduce_", x, "max", g)
    assert y.data_ptr() == x.data_ptr(), "all_reduce_ did not return its input"
    check("all_reduce_ max", y, reduce(every((3, 5), torch.int64, "ar_"), "max"))

    shapes = ((5,), (3, 2))
    xs = [mine(s, torch.int64, f"coal{k}") for k, s in enumerate(shapes)]
    refs = [reduce(every(s, torch.int64, f"coal{k}"), "sum") for k, s in enumerate(shapes)]
    for k, y in enumerate(call("all_reduce_coalesced", xs, "sum", g)):
        check(f"all_reduce_coalesced tensor {k}", y, refs[k])
    for k, y in enumerate(call("all_reduce_coalesced_", xs, "sum", g)):
        check(f"all_reduce_coalesced_ tensor {k}", y, refs[k])

    x = mine((3, 4), torch.float32, "ag")
    gathered = torch.cat(every((3, 4), torch.float32, "ag"))
    check("all_gather_into_tensor", call("all_gather_into_tensor", x, W, g), gathered)
    out = torch.full((3 * W, 4), -1.0, device=device)
    check("all_gather_into_tensor_out", call("all_gather_into_tensor_out", x, W, g, out=out), gathered)
    x2 = mine(2, torch.int32, "ag2")
    ys = call("all_gather_into_tensor_coalesced", [x, x2], W, g)
    check("all_gather_into_tensor_coalesced tensor 0", ys[0], gathered)
    check("all_gather_into_tensor_coalesced tensor 1", ys[1], torch.cat(every(2, torch.int32, "ag2")))

    x = mine((2 * W, 3), torch.float32, "rs")
    part = reduce(every((2 * W, 3), torch.float32, "rs"), "sum")[2 * r:2 * r + 2]
    check("reduce_scatter_tensor", call("reduce_scatter_tensor", x, "sum", W, g), part)
    out = torch.full((2, 3), -1.0, device=device)
    check("reduce_scatter_tensor_out", call("reduce_scatter_tensor_out", x, "sum", W, g, out=out), part)
    x2 = mine(3 * W, torch.int64, "rs2")
    ys = call("reduce_scatter_tensor_coalesced", [x, x2], "max", W, g)
    check("reduce_scatter_tensor_coalesced tensor 0", ys[0],
          reduce(every((2 * W, 3), torch.float32, "rs"), "max")[2 * r:2 * r + 2])
    check("reduce_scatter_tensor_coalesced tensor 1", ys[1],
          reduce(every(3 * W, torch.int64, "rs2"), "max")[3 * r:3 * r + 3])

    sent = [inp(r, (a2a_rows(r, j), 2), torch.float32, f"a2a{j}") for j in range(W)]
    received = [inp(j, (a2a_rows(j, r), 2), torch.float32, f"a2a{r}") for j in range(W)]
    check("all_to_all_single (uneven splits)",
          call("all_to_all_single", torch.cat(sent).to(device), [a2a_rows(j, r) for j in range(W)],
               [a2a_rows(r, j) for j in range(W)], g),
          torch.cat(received))

    src = W - 1
    x = mine(11, torch.float32, "bc")
    check("broadcast", call("broadcast", x, src, g), inp(src, 11, torch.float32, "bc"))
    # A copy: broadcast_ below writes into x.
    checks.append(("broadcast leaves its input alone", x.clone(), inp(r, 11, torch.float32, "bc")))
    check("broadcast_", call("broadcast_", x, src, g), inp(src, 11, torch.float32, "bc"))
    return checks, len(FAST_OPS)


def assert_checks(checks, label):
    for what, got, expected in checks:
        got = got.cpu()
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), (
            f"{label}: {what}: got {got} ({got.dtype}, {tuple(got.shape)}), expected {expected} "
            f"({expected.dtype}, {tuple(expected.shape)})")


def calls():
    return torch.ops.tccomm.functional_fast_path_calls()


# ---- rank scenarios -----------------------------------------------------------

def scenario_routing(rank, world):
    """CPU tensors through the CPU, CUDA and AutogradCUDA keys on groups of
    every kind: results, and which (key, group) pairs the fast path serves."""
    import torch.distributed as dist

    import torchcomm_backend

    cuda_built = torchcomm_backend.build_info()["cuda"]
    fast = os.environ.get("TCCOMM_FUNCOL_FASTPATH", "1") != "0"
    dist.init_process_group("tccomm")
    groups = {"tccomm": dist.group.WORLD}
    for spec in ("gloo", "cpu:gloo,cuda:tccomm", "cpu:tccomm,cuda:gloo"):
        groups[spec] = dist.new_group(list(range(world)), backend=spec)
    ks = torch._C.DispatchKeySet
    cuda_key = ks(torch._C.DispatchKey.CUDA)
    ways = {  # how an op is called -> (dispatch key set or None for a plain call, its device type)
        "CPU": (None, "cpu"),
        "CUDA": (cuda_key, "cuda"),
        "AutogradCUDA": (ks(torch._C.DispatchKey.AutogradCUDA) | cuda_key, "cuda"),
    }
    ops = torch.ops._c10d_functional
    wrong = []
    for label, group in groups.items():
        for way, (keyset, device_type) in ways.items():
            def call(name, *args, **kw):
                op = getattr(ops, name).default
                return op(*args, **kw) if keyset is None else op.redispatch(keyset, *args, **kw)

            backend = group._get_backend(torch.device(device_type)).name()
            served = fast and backend == "tccomm" and (device_type == "cpu" or cuda_built)
            before = calls()
            checks, issued = run_ops(call, group.group_name, world, rank, "cpu")
            got = calls() - before
            assert_checks(checks, f"{label} group through the {way} key")
            expected = issued if served else 0
            if got != expected:
                wrong.append(f"{label} group ({device_type} backend {backend}) through the {way} key: "
                             f"{got} ops on the fast path, expected {expected}")
    assert not wrong, "\n".join(wrong)
    for label, group in groups.items():
        if label != "tccomm":
            dist.destroy_process_group(group)
    dist.destroy_process_group()


def scenario_gpu(rank, world):
    """Every op on CUDA tensors of a tccomm group (eager and compiled) and of
    an nccl group; stream semantics of the fast path's work."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dev = torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)
    torch.cuda.set_device(dev)
    ops = torch.ops._c10d_functional
    dist.init_process_group("tccomm")
    tcc = dist.group.WORLD
    nccl = dist.new_group(list(range(world)), backend="nccl")

    def plain(name, *args, **kw):
        return getattr(ops, name)(*args, **kw)

    # Eager, the ops themselves: tccomm serves all of them, nccl none.
    for label, group, served in (("tccomm", tcc, True), ("nccl", nccl, False)):
        before = calls()
        checks, issued = run_ops(plain, group.group_name, world, rank, dev)
        got = calls() - before
        assert_checks(checks, f"{label} group on {dev}")
        assert got == (issued if served else 0), (
            f"{label} group on {dev}: {got} ops on the fast path, expected {issued if served else 0}")

    # funcol's API, eager and compiled.
    W, r = world, rank
    out_splits = [a2a_rows(j, r) for j in range(W)]
    in_splits = [a2a_rows(r, j) for j in range(W)]

    def fn(x, y, z, a):
        s = funcol.all_reduce(x * 2, "sum", tcc)
        g = funcol.all_gather_tensor(y, 0, tcc)
        rs = funcol.reduce_scatter_tensor(z, "sum", 0, tcc)
        t = funcol.all_to_all_single(a, out_splits, in_splits, tcc)
        b = funcol.broadcast(y + 1, W - 1, tcc)
        return s + 1, g * 3, rs, t, b

    def host_args(q):
        return (rank_input(q, 16, torch.float32, "x"), rank_input(q, (3, 4), torch.float32, "y"),
                rank_input(q, (2 * W, 5), torch.float32, "z"),
                torch.cat([rank_input(q, (a2a_rows(q, j), 2), torch.float32, f"fa{j}") for j in range(W)]))

    every = [host_args(q) for q in range(W)]
    expected = [
        sum(a[0] * 2 for a in every) + 1,
        torch.cat([a[1] for a in every]) * 3,
        sum(a[2] for a in every)[2 * r:2 * r + 2],
        torch.cat([rank_input(j, (a2a_rows(j, r), 2), torch.float32, f"fa{r}") for j in range(W)]),
        every[W - 1][1] + 1,
    ]
    names = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"]
    args = tuple(t.to(dev) for t in every[r])

    def run(f, label):
        before = calls()
        got = [t.wait() if hasattr(t, "wait") else t for t in f(*args)]
        n = calls() - before
        assert_checks(list(zip([f"{label} {n_}" for n_ in names], got, expected)), f"tccomm group on {dev}")
        assert n == len(names), f"{label}: {n} ops on the fast path, expected {len(names)}"

    run(fn, "eager funcol")
    compiled = torch.compile(fn, fullgraph=True)
    run(compiled, "compiled funcol (first call)")
    run(compiled, "compiled funcol")

    # Stream semantics. The input is written on the current stream behind a
    # long sleep: the op must wait for it (else it reads the old values), and
    # wait_tensor must make the current stream wait for the op (else the
    # copy to the host reads the output before the op wrote it), without
    # blocking the host (the sleep is still running when it returns).
    base = rank_input(r, 4096, torch.float32, "stream").to(dev)
    want = sum(rank_input(q, 4096, torch.float32, "stream") for q in range(W)) * 3
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9))  # about a second
    x = base * 3
    before = calls()
    y = ops.all_reduce(x, "sum", tcc.group_name)
    y = ops.wait_tensor(y)
    still_running = not torch.cuda.current_stream().query()
    assert calls() - before == 1, "the all_reduce did not go through the fast path"
    got = y.cpu()
    assert torch.equal(got, want), f"all_reduce behind a busy stream: got {got}, expected {want}"
    assert still_running, "wait_tensor blocked the host until the stream's work was done"
    torch.cuda.synchronize()

    dist.destroy_process_group(nccl)
    dist.destroy_process_group()


def worker_main(scenario, out_dir):
    """One rank: runs `scenario` as one case and reports it (tests/_rank.py)."""
    import _rank

    _rank.run_one_scenario(out_dir, scenario, globals()[f"scenario_{scenario}"])


# ---- pytest ------------------------------------------------------------------

def run_group(scenario, world, extra_env=None):
    """Spawns `world` ranks of `scenario` (tests/_group.py) and fails the
    test unless every rank passed it and exited with code 0."""
    import _group

    outdir = tempfile.mkdtemp(prefix=f"tccomm-funcol-cuda-{scenario}-")
    port = _group.free_port()
    shared_gpu = scenario == "gpu" and world > 1 and torch.cuda.device_count() < world

    def env(rank):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        e.pop("TCCOMM_FUNCOL_FASTPATH", None)
        e.update(extra_env or {})
        if shared_gpu:
            e.update(_group.shared_gpu_env(rank))
        return e

    _group.run_scenario_or_fail(outdir, world, lambda rank: [os.path.abspath(__file__), scenario, outdir], env,
                                scenario, WORKER_TIMEOUT[scenario])
    shutil.rmtree(outdir, ignore_errors=True)


TABLE_SCRIPT = r"""
import json, torch
import torchcomm_backend
info = torchcomm_backend.build_info()
tables = {op: torch._C._dispatch_dump_table("_c10d_functional::" + op)
          for op in %r + ("wait_tensor",)}
print("TABLES", json.dumps({"cuda": info["cuda"], "tables": tables}))
"""

ENTRY = re.compile(r"^(\w+): (?:fallthrough )?registered at (\S+):\d+ \[([^\]]+)\]$")


def dispatch_tables(fastpath):
    """{"cuda": built with CUDA, "tables": {op: {key: (file, kind)}}} from a
    fresh process that loaded the extension with TCCOMM_FUNCOL_FASTPATH=fastpath."""
    import json

    env = dict(os.environ, TCCOMM_FUNCOL_FASTPATH=fastpath)
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT % (FAST_OPS,)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TABLES "))
    raw = json.loads(line[len("TABLES "):])
    tables = {}
    for op, text in raw["tables"].items():
        entries = {}
        for ln in text.splitlines():
            m = ENTRY.match(ln.strip())
            if m:
                entries[m.group(1)] = (m.group(2), m.group(3))
        missing = [k for k in KEYS if k not in entries]
        assert not missing, f"{op}: no dispatch table entry for {missing}:\n{text}"
        tables[op] = entries
    return raw["cuda"], tables


def is_tccomms(entry):
    """A kernel registered by tccomm's csrc/functional.cpp (torch's own is
    torch/csrc/distributed/c10d/Functional.cpp)."""
    path, _kind = entry
    return path.replace("\\", "/").endswith("csrc/functional.cpp")


@pytest.mark.parametrize("fastpath", ["1", "0"], ids=["fastpath-on", "fastpath-off"])
def test_cuda_kernels_registered_exactly_with_cuda_build(fastpath):
    cuda, tables = dispatch_tables(fastpath)
    on = fastpath != "0"
    # Which keys hold tccomm's kernel, per op.
    want_ops = {"CPU", "AutogradCPU"} | ({"CUDA", "AutogradCUDA"} if cuda else set())
    want_wait = {"AutogradCPU"} | ({"AutogradCUDA"} if cuda else set())
    wrong = []
    for op, entries in tables.items():
        want = (want_ops if op in FAST_OPS else want_wait) if on else set()
        ours = {k for k in KEYS if is_tccomms(entries[k])}
        if ours != want:
            wrong.append(f"{op}: tccomm's kernels on {sorted(ours)}, expected on {sorted(want)}")
        # Where tccomm registered nothing, torch's own kernel is there.
        if "CUDA" not in ours and "Functional.cpp" not in entries["CUDA"][0]:
            wrong.append(f"{op}: the CUDA key holds {entries['CUDA']}, not torch's kernel")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("fastpath", ["1", "0"], ids=["fastpath-on", "fastpath-off"])
def test_routing_by_key_and_group(fastpath):
    """2 ranks, no GPU needed (see scenario_routing)."""
    import torchcomm_backend

    if not torchcomm_backend.build_info()["cuda"]:
        pytest.skip("torch and tccomm are built without CUDA: there is no CUDA key to route "
                    "(test_cuda_kernels_registered_exactly_with_cuda_build checks that none is registered)")
    run_group("routing", 2, {"TCCOMM_FUNCOL_FASTPATH": fastpath})


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="no GPU")
@pytest.mark.parametrize("world", [1, 2])
def test_funcol_on_gpu(world):
    import torchcomm_backend

    if not torchcomm_backend.build_info()["cuda"]:
        pytest.fail("a GPU is visible but tccomm was built without CUDA")
    run_group("gpu", world)


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2])
