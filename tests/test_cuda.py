"""tccomm on CUDA.

Runs everywhere:
  * the extension says whether its CUDA path was built: always when torch has
    CUDA (no GPU needed), never with a CPU-only torch; the NCCL it finds at
    run time is the very copy torch loaded;
  * the C core's CUDA path compiles warning-free against the real nccl.h and,
    linked with cudart, loads NCCL and refuses CUDA ops clearly without a GPU
    (make cuda-test);
  * without a GPU, asking for CUDA fails with a clear error, not a crash;
  * the host references of the GPU scenarios reject wrong results.
Needs a GPU (skipped with the reason otherwise), all ranks on cuda:0, one
process per rank (tests/_cuda_worker.py, spawned and watched by
tests/_group.py like every multi-process suite), each claiming its own host:
  * every op at world size 1, 2 and 3; eager init with device_id;
  * CUDA-graph capture of an all_reduce and 10 replays (world 1 and 2);
  * DDP on CUDA ends with the same parameters as on `nccl`;
  * a peer that never joins: the op fails after the group's timeout.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import _group

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_cuda_worker.py")
GPU_TIMEOUT = int(os.environ.get("TCCOMM_TEST_CUDA_TIMEOUT", "300"))

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (none is visible to torch)")


def build_info():
    import torchcomm_backend

    return torchcomm_backend.build_info()


# ---- no GPU needed -------------------------------------------------------------

def test_build_has_cuda_exactly_when_torch_has():
    info = build_info()
    if torch.version.cuda is None:
        assert info["cuda"] is False, info
        assert info["nccl_header_version"] == 0, info
        return
    assert info["cuda"] is True, f"torch has CUDA {torch.version.cuda} but tccomm was built without it: {info}"
    assert info["nccl_header_version"] >= 20700, info


@pytest.mark.skipif(torch.version.cuda is None, reason="torch has no CUDA, so no NCCL to find")
def test_runtime_nccl_is_torchs_copy():
    info = build_info()
    assert info["nccl_runtime_version"] is not None, f"tccomm could not load NCCL: {info['nccl_error']}"
    major, minor, patch = torch.cuda.nccl.version()[:3]
    assert info["nccl_runtime_version"] == major * 10000 + minor * 100 + patch, (info, torch.cuda.nccl.version())
    # One copy in the process: the core looked it up by soname (RTLD_NOLOAD first).
    with open(f"/proc/{os.getpid()}/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    assert len(paths) == 1, f"more than one NCCL mapped: {paths}"


def _nccl_include():
    env = os.environ.get("NCCL_INCLUDE_DIR")
    if env and os.path.isfile(os.path.join(env, "nccl.h")):
        return env
    try:
        import nvidia.nccl

        for p in nvidia.nccl.__path__:
            if os.path.isfile(os.path.join(p, "include", "nccl.h")):
                return os.path.join(p, "include")
    except ImportError:
        pass
    return None


def _cuda_include():
    for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if d and os.path.isfile(os.path.join(d, "include", "cuda_runtime_api.h")):
            return os.path.join(d, "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        d = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")):
            return d
    return None


def _cuda_headers():
    """(nccl.h's directory, cuda_runtime_api.h's) for building the core's
    CUDA path; skips the test when make or either header is missing."""
    if shutil.which("make") is None:
        pytest.skip("`make` is not installed")
    nccl, cuda = _nccl_include(), _cuda_include()
    if nccl is None:
        pytest.skip("no nccl.h (install nvidia-nccl-cu* or set NCCL_INCLUDE_DIR)")
    if cuda is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime_api.h; set CUDA_HOME)")
    return nccl, cuda


def test_c_core_cuda_path_compiles_warning_free_and_runs():
    nccl, cuda = _cuda_headers()
    core = os.path.join(ROOT, "csrc", "c_core")
    shutil.rmtree(os.path.join(core, "build", "cuda"), ignore_errors=True)  # compile every file now
    nccl_lib = os.path.join(os.path.dirname(nccl), "lib")
    proc = subprocess.run(["make", "-C", core, "cuda-test", f"NCCL_INCLUDE={nccl}", f"CUDA_INCLUDE={cuda}",
                           f"NCCL_LIB={nccl_lib}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, "make cuda-test failed:\n" + "\n".join(proc.stdout.splitlines()[-40:])
    assert "warning:" not in proc.stdout, proc.stdout
    assert "no warnings" in proc.stdout, proc.stdout
    assert "1 passed, 0 failed" in proc.stdout, proc.stdout


def test_c_core_cuda_path_against_fake_gpu():
    """The core's CUDA path, driven through test doubles of the CUDA runtime
    and NCCL (csrc/c_core/tests/fake_gpu/): every collective and p2p op on 2
    and 3 ranks checked against a host reference, and the fault cases (abort
    of a thread stuck in NCCL, a peer that never joins, a dead peer,
    NCCL_COMM_BLOCKING=0). Needs no GPU; CI runs it under ASan and TSan too."""
    nccl, cuda = _cuda_headers()
    core = os.path.join(ROOT, "csrc", "c_core")
    proc = subprocess.run(["make", "-C", core, "fake-gpu", f"NCCL_INCLUDE={nccl}", f"CUDA_INCLUDE={cuda}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    assert proc.returncode == 0, "make fake-gpu failed:\n" + tail
    assert ", 0 failed" in proc.stdout and "0 passed" not in proc.stdout.splitlines()[-1], tail


NO_GPU_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
import torchcomm_backend
dist.init_process_group("tccomm", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
try:
    dist.all_reduce(torch.ones(4, device="cuda"))
except Exception as e:
    print("CUDA-TENSOR-ERROR:", type(e).__name__, e)
# the group still works on CPU
t = torch.ones(4); dist.all_reduce(t); assert t.sum().item() == 4
dist.destroy_process_group()
if torch.version.cuda and hasattr(torch.distributed.distributed_c10d, "_get_default_group"):
    try:
        dist.init_process_group("tccomm", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        print("EAGER-INIT: no error")
    except Exception as e:
        print("EAGER-INIT-ERROR:", type(e).__name__, e)
print("ALIVE")
"""


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: CUDA tensors work (covered by the GPU tests)")
def test_cuda_without_gpu_is_a_clear_error():
    script = NO_GPU_SCRIPT % (_group.free_port(), _group.free_port())
    proc = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0 and "ALIVE" in out, f"the process did not survive:\n{out[-3000:]}"
    # torch itself refuses to make a CUDA tensor without a GPU, before tccomm sees it.
    assert "CUDA-TENSOR-ERROR" in out, out[-3000:]
    if torch.version.cuda and "EAGER-INIT" in out:
        line = next(ln for ln in out.splitlines() if ln.startswith("EAGER-INIT"))
        assert "ERROR" in line, line
        low = line.lower()
        assert ("cuda" in low and ("device" in low or "driver" in low)), line


def test_cuda_references_reject_wrong_results():
    """The host references and comparisons the GPU scenarios use accept a
    right result in another order of the ranks and reject wrong ones (a
    dropped rank, a wrong AVG divisor, a changed NaN payload): checked here,
    without a GPU, so the GPU checks are known to be able to fail."""
    run_scenario("selfcheck", 1)


# ---- GPU ---------------------------------------------------------------------------

def _rank_env(world, port, extra_env=None):
    """The environment of each rank of a GPU scenario: all on cuda:0.
    extra_env: variables to set, or to remove where the value is None."""
    def env(rank):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                 CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        if world > 1:
            e.update(_group.shared_gpu_env(rank))
        for k, v in (extra_env or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        return e

    return env


def run_scenario(scenario, world, extra_env=None):
    """Runs `scenario` with `world` ranks on cuda:0 (tests/_group.py: a rank
    that shows no progress for GPU_TIMEOUT s is hung, its stack dumped);
    fails the test unless every rank passed it and exited with code 0."""
    outdir = tempfile.mkdtemp(prefix=f"tccomm-cuda-{scenario}-")
    env = _rank_env(world, _group.free_port(), extra_env)
    _group.run_scenario_or_fail(outdir, world, lambda rank: [WORKER, scenario, outdir], env, scenario, GPU_TIMEOUT)
    shutil.rmtree(outdir, ignore_errors=True)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_op(world):
    run_scenario("ops", world)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2])
def test_eager_init_with_device_id(world):
    run_scenario("eager", world)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_capture_and_replay(world):
    run_scenario("graph", world)


# torch before 2.14 gives split_group's child a copy of `parent_backend.options`,
# which only nccl's backend object has (an AttributeError for any other backend).
SPLIT_GROUP_WORKS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


@needs_gpu
@pytest.mark.skipif(not SPLIT_GROUP_WORKS, reason=f"torch {torch.__version__}'s dist.split_group copies the parent "
                    "backend's `options`, which only nccl's backend has (torch 2.14 dropped that)")
@pytest.mark.parametrize("world", [2, 3])
def test_split_group_splits_the_nccl_communicator(world):
    run_scenario("split", world)


@needs_gpu
def test_profiler_and_flight_recorder_see_cuda_ops():
    run_scenario("tools", 2, {"TORCH_FR_BUFFER_SIZE": "16"})


@needs_gpu
def test_ddp_matches_nccl():
    run_scenario("ddp", 2)


@needs_gpu
def test_peer_never_joins_times_out():
    """With TCCOMM_ASYNC_ERROR_HANDLING=2 the timed-out op raises, naming the
    op, the group and the rank, and the group refuses further work."""
    run_scenario("timeout", 2, {"TCCOMM_ASYNC_ERROR_HANDLING": "2"})


@needs_gpu
def test_timed_out_op_tears_the_process_down_by_default():
    """By default (as with nccl's TORCH_NCCL_ASYNC_ERROR_HANDLING=3) a CUDA op
    that times out ends its process with SIGABRT after saying why: work
    queued behind it on the device would otherwise run on incomplete data."""
    outdir = tempfile.mkdtemp(prefix="tccomm-cuda-teardown-")
    env = _rank_env(2, _group.free_port(), {"TCCOMM_ASYNC_ERROR_HANDLING": None})
    run = _group.watch(_group.spawn(outdir, 2, lambda rank: [WORKER, "teardown", outdir], env),
                       case_limit=lambda case: GPU_TIMEOUT)
    log = _group.tail(run.logs[1], 200)
    assert run.codes[1] == -signal.SIGABRT, (
        f"rank 1 {_group.describe_exit(run.codes[1])}, expected killed by SIGABRT\n{run.tails([0, 1])}")
    assert "timed out after 5000 ms" in log and "tearing the process down" in log, run.tails([1], 60)
    shutil.rmtree(outdir, ignore_errors=True)
