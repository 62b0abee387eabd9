"""The TorchComm-style API (torchcomm_backend.new_comm): every method, sync and
async, in real 2-, 3- and 4-rank groups bootstrapped three ways (FileStore,
TCPStore, torchrun environment), split, per-op timeouts, hints, windows
(cases in tests/_tc_cases.py); the aborting error policy in a group of its
own; and the option parsing in this process."""

import atexit
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import _group
import _harness
import _tc_cases
import torchcomm_backend as tc
from conftest import case_id, check_case

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_tc_worker.py")
ABORT_LIMIT = 300  # s: test_abort_on_timeout kills its group after this
# s without progress before a rank counts as hung: a failing case may wait out
# two of the communicator's 60 s timeouts (tests/_tc_worker.py) and still report.
CASE_LIMIT = max(_group.CASE_TIMEOUT, 150)
TEARDOWN = _harness.TEARDOWN

# world -> (bootstrap, abort argument, environment)
GROUPS = {
    2: ("file", None, {"TORCHCOMM_ABORT_ON_ERROR": "0"}),  # the policy from the environment
    3: ("tcp", False, {}),
    4: ("env", False, {}),
}


def spawn(world, bootstrap, abort, mode, env_extra, out_dir, cases=None):
    """Starts the ranks of a TorchComm group (tests/_tc_worker.py); returns the
    group and the TCPStore it bootstraps from (kept alive by the caller)."""
    cfg = {"world": world, "bootstrap": bootstrap, "abort": abort, "mode": mode, "out_dir": out_dir,
           "store_path": os.path.join(out_dir, "filestore"), "master_port": _group.free_port(),
           "cases": cases}
    server = None
    if bootstrap == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        cfg["store_port"] = server.port
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)

    def env(rank):
        e = dict(os.environ)
        for var in ("TCCOMM_TRANSPORT", "TORCHCOMM_ABORT_ON_ERROR", "TORCHCOMM_TIMEOUT_SECONDS",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
            e.pop(var, None)
        e.update(env_extra, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return e

    return _group.spawn(out_dir, world, lambda rank: [WORKER, path, str(rank)], env), server


def group_key(world):
    return f"torchcomm-w{world}"


class Groups:
    """Runs each world's group once per session and caches its results: one
    per case and one for the group's teardown (decided as for the specs of
    tests/_harness.py, with tests/_group.py's watch and verdicts; a group
    that hangs or dies is not restarted: its unfinished cases fail)."""

    def __init__(self, cases=None):
        self.cases = cases  # names to run (default: all of _tc_cases)
        self.dir = tempfile.mkdtemp(prefix="tccomm-torchcomm-")
        self.results = {}
        self.keep = False  # set when a test fails: the logs stay for a look
        atexit.register(self._cleanup)

    def _cleanup(self):
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def result(self, group, name):
        """The verdict on case `name` (or TEARDOWN) of group_key(world)."""
        if group not in self.results:
            self.results[group] = self._run(WORLD_OF[group])
        return self.results[group].get(name, _group.Result("fail", "no result"))

    def _run(self, world):
        out_dir = os.path.join(self.dir, f"world{world}")
        os.makedirs(out_dir)
        bootstrap, abort, env = GROUPS[world]
        group, server = spawn(world, bootstrap, abort, "cases", env, out_dir, self.cases)
        run = _group.watch(group, case_limit=lambda case: CASE_LIMIT)
        del server
        names = [n for n, _ in _tc_cases.CASES if self.cases is None or n in self.cases]
        return self._decide(run, names, group_key(world))

    @staticmethod
    def _decide(run, names, what):
        failed_init = _group.init_failure(run, what)
        if failed_init:
            return {n: _group.Result("fail", failed_init) for n in names + [TEARDOWN]}
        results = {}
        for i, name in enumerate(names):
            evs = _group.reported(run, name)
            if evs:
                results[name] = _group.merge(evs)
                continue
            results[name] = _group.unfinished(run, name)
            for later in names[i + 1:] + [TEARDOWN]:
                results[later] = _group.Result("fail", f"not run: the group did not get "
                                                       f"through case {name!r}")
            return results
        results[TEARDOWN] = _group.teardown_result(run, what)
        return results


_groups = Groups()
WORLD_OF = {group_key(w): w for w in GROUPS}
CASE_NAMES = [n for n, _ in _tc_cases.CASES]


@pytest.mark.parametrize("spec_case", [(group, n) for group in WORLD_OF
                                       for n in CASE_NAMES + [TEARDOWN]], ids=case_id)
def test_torchcomm_case(spec_case):
    check_case(_groups, spec_case)


def test_abort_on_timeout(tmp_path):
    """With the default policy, a timed-out op ends the process with a message."""
    group, _ = spawn(2, "file", None, "abort", {}, str(tmp_path))
    procs = group.procs
    try:
        procs[0].wait(timeout=ABORT_LIMIT)
    except subprocess.TimeoutExpired:
        pass
    finally:
        group.kill()
    log = _group.tail(group.logs[0], 60)
    assert procs[0].returncode == -signal.SIGABRT, f"exit {procs[0].returncode}:\n{log}"
    assert "all_reduce on communicator 'tests' (rank 0 of 2)" in log, log
    assert "aborting the process" in log and "timed out" in log, log


# ---- in this process: no group needed -----------------------------------------------


def test_new_comm_refuses(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'nccl'"):
        tc.new_comm("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="device mps is not supported"):
        tc.new_comm("tccomm", torch.device("mps"))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="no torchrun environment"):
        tc.new_comm("tccomm", torch.device("cpu"))


def test_options_from_environment(monkeypatch):
    from torchcomm_backend import _options

    monkeypatch.delenv("TORCHCOMM_TIMEOUT_SECONDS", raising=False)
    monkeypatch.delenv("TORCHCOMM_ABORT_ON_ERROR", raising=False)
    assert _options.default_timeout() == datetime.timedelta(seconds=600)
    assert _options.default_abort() is True
    monkeypatch.setenv("TORCHCOMM_TIMEOUT_SECONDS", "2.5")
    monkeypatch.setenv("TORCHCOMM_ABORT_ON_ERROR", "false")
    assert _options.default_timeout() == datetime.timedelta(seconds=2.5)
    assert _options.default_abort() is False
    monkeypatch.setenv("TORCHCOMM_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="TORCHCOMM_TIMEOUT_SECONDS"):
        _options.default_timeout()
    monkeypatch.setenv("TORCHCOMM_ABORT_ON_ERROR", "maybe")
    with pytest.raises(ValueError, match="TORCHCOMM_ABORT_ON_ERROR"):
        _options.default_abort()


def test_reduce_ops():
    assert {op.name for op in (tc.ReduceOp.SUM, tc.ReduceOp.PRODUCT, tc.ReduceOp.MIN, tc.ReduceOp.MAX,
                               tc.ReduceOp.BAND, tc.ReduceOp.BOR, tc.ReduceOp.BXOR, tc.ReduceOp.AVG)} == \
        {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"}
    assert repr(tc.ReduceOp.PREMUL_SUM(2)) == "ReduceOp.PREMUL_SUM(2.0)"
    assert tc.ReduceOp.PREMUL_SUM(2) == tc.ReduceOp.PREMUL_SUM(2.0)
    with pytest.raises(TypeError, match="factor"):
        tc.ReduceOp.PREMUL_SUM("2")


def test_direct_entry_points_refuse_garbage(monkeypatch, tmp_path):
    """The extension's direct_* functions (the TorchComm API's synchronous
    path) with every kind of wrong argument: a clear error, never a crash;
    then the communicator still works, and after finalize a raw entry point
    is refused instead of running."""
    from torchcomm_backend import _extension

    native = _extension.load_extension()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    comm = tc.new_comm("tccomm", torch.device("cpu"), store=dist.FileStore(str(tmp_path / "store"), 1),
                       abort_process_on_timeout_or_error=False)
    h, t = comm._direct, torch.ones(2)
    assert isinstance(h, int) and h > 0
    for call, exc, needle in [
        (lambda: native.direct_all_reduce(0, t, 0), ValueError, "not a communicator handle"),
        (lambda: native.direct_all_reduce(-7, t, 0), ValueError, "not a communicator handle"),
        (lambda: native.direct_all_reduce(h + 10**6, t, 0), ValueError, "not a communicator handle"),
        (lambda: native.direct_all_reduce(2**80, t, 0), TypeError, "handle must be an int"),
        (lambda: native.direct_all_reduce("1", t, 0), TypeError, "handle must be an int"),
        (lambda: native.direct_all_reduce(h, "tensor", 0), TypeError, "must be a tensor, got str"),
        (lambda: native.direct_all_reduce(h, None, 0), TypeError, "must be a tensor, got NoneType"),
        (lambda: native.direct_all_reduce(h, t, 8), ValueError, "reduce op code 8"),
        (lambda: native.direct_all_reduce(h, t, -1), ValueError, "reduce op code -1"),
        (lambda: native.direct_all_reduce(h, t, "SUM"), TypeError, "reduce op must be an int"),
        (lambda: native.direct_all_reduce(h, t), TypeError, "takes 3 arguments, got 2"),
        (lambda: native.direct_barrier(), TypeError, "takes 1 arguments, got 0"),
        (lambda: native.direct_broadcast(h, t, 1.5), TypeError, "root must be an int"),
        (lambda: native.direct_broadcast(h, t, 3), RuntimeError, "root rank 3 is out of range"),
        (lambda: native.direct_all_gather_single(h, t, [t]), TypeError, "the input must be a tensor, got list"),
        (lambda: native.direct_send(h, t, 2**40), ValueError, "dst 1099511627776 is not a rank"),
        (lambda: native.direct_recv(h, t, -2**40), ValueError, "src -1099511627776 is not a rank"),
        (lambda: native.direct_send(h, t, 0), RuntimeError, "cannot send to itself"),
        (lambda: native.direct_recv(h, t, 1), RuntimeError, "source"),
        (lambda: native.direct_all_to_all_single(h, torch.ones(3), torch.ones(2)), RuntimeError, "sends 2 elements to itself but expects 3"),
    ]:
        with pytest.raises(exc, match=needle):
            call()
    assert native.direct_all_reduce(h, t, 0) is None  # one rank: the sum is the input
    assert torch.equal(t, torch.ones(2))
    comm.all_reduce(t, tc.ReduceOp.MAX, async_op=False)
    comm.finalize()
    with pytest.raises(dist.DistBackendError, match="allreduce: the process group has been shut down"):
        native.direct_all_reduce(h, t, 0)

    # TCCOMM_TORCHCOMM_FASTPATH=0: no handle, every op through the binding.
    monkeypatch.setenv("TCCOMM_TORCHCOMM_FASTPATH", "0")
    comm = tc.new_comm("tccomm", torch.device("cpu"), store=dist.FileStore(str(tmp_path / "store2"), 1))
    before = torch.ops.tccomm.direct_calls()
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    comm.barrier(async_op=False)
    assert comm._direct == 0 and torch.ops.tccomm.direct_calls() == before
    comm.finalize()


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: covered by the GPU test below")
def test_new_comm_cuda_without_gpu_is_clear():
    cause = "no CUDA path" if not tc.build_info()["cuda"] else "torch sees no CUDA device"
    with pytest.raises(RuntimeError, match=cause):
        tc.new_comm("tccomm", torch.device("cuda"), store=dist.HashStore())


CUDA_SCRIPT = r"""
import os, tempfile, torch, torch.distributed as dist
import torchcomm_backend as tc
os.environ.update(RANK="0", WORLD_SIZE="1")
comm = tc.new_comm("tccomm", torch.device("cuda"), store=dist.FileStore(tempfile.mktemp(), 1))
t = torch.arange(8.0, device="cuda")
comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
assert torch.equal(t, torch.arange(8.0, device="cuda")), t
out = torch.empty(8, device="cuda")
work = comm.all_to_all_v_single(out, t * 2, [8], [8], async_op=True)
work.wait()  # the current stream waits; reading `out` on it is ordered after the op
assert torch.equal(out, torch.arange(8.0, device="cuda") * 2), out
# CUDA-graph capture as in the reference's example, replayed 10 times.
x = torch.ones(4, device="cuda")
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        comm.all_reduce(x, tc.ReduceOp.SUM, async_op=False)
        x.mul_(2)
torch.cuda.current_stream().wait_stream(stream)
x.fill_(1)
for _ in range(10):
    graph.replay()
torch.cuda.synchronize()
assert torch.equal(x, torch.full((4,), 1024.0, device="cuda")), x
comm.finalize()
print("OK")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible to torch)")
def test_cuda_ops_stream_wait_and_graph_capture():
    out = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
