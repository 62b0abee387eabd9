"""Open MPI as one more peer of bench_collectives.py, measured in the same
processes as the torch.distributed backends.

    python bench/bench_collectives.py --backends tccomm,gloo,openmpi  # all three, one run
    python bench/bench_mpi.py --worlds 2 --max-bytes 4M             # Open MPI alone

Optional: needs Open MPI's mpirun and mpi4py (apt-get install openmpi-bin
libopenmpi-dev; pip install mpi4py, which builds against that Open MPI).
Without them it says so in one line (this script then exits 2;
bench_collectives.py goes on with its other backends).

With openmpi among the backends, bench_collectives.py starts each world
size's ranks with

    mpirun --allow-run-as-root --oversubscribe -np N --bind-to none
           --mca pml ob1 --mca btl self,vader
           --mca btl_vader_single_copy_mechanism cma|none  python bench_collectives.py --worker ...

(pml ob1: otherwise a UCX pml, when Open MPI has one, takes over and the btl
choice means nothing; vader with CMA single copy is what Open MPI uses on one
host, and the launcher first checks that CMA is permitted here, falling back
to vader's copy through shared memory when the ptrace policy forbids it).
Every rank then also initializes MPI, and each point is verified and timed
on MPI_COMM_WORLD's duplicate exactly as on the torch.distributed groups:
the same tensors, the same Python loop, batch by batch with the backends'
order rotating. A peer measured in a job of its own meets other minutes of
a machine whose speed drifts; batch by batch, both meet the same ones.

Buffers are the point's torch tensors handed to MPI as numpy views (no
copy): float32 as MPI_FLOAT, float64 as MPI_DOUBLE, bfloat16 and float16 as
their raw 16-bit words (MPI_UINT16_T): fine for moving data, but Open MPI has
no MPI_SUM on 16-bit floats, so allreduce and reduce_scatter in those types
are reported as not available rather than measured on some other type.

MPI calls: allreduce MPI_Allreduce(MPI_IN_PLACE, SUM) (in place, as
dist.all_reduce), allgather MPI_Allgather, reduce_scatter
MPI_Reduce_scatter_block (SUM), broadcast MPI_Bcast (root 0), alltoall
MPI_Alltoall.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_collectives as bc  # noqa: E402  (sizes, inputs, reference, report)

BACKEND = "openmpi"
INSTALL = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
REDUCTIONS = ("allreduce", "reduce_scatter")


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------


def missing() -> str | None:
    """Why Open MPI cannot be measured here (every missing part), or None."""
    why = []
    try:
        import mpi4py  # noqa: F401  (the package alone: MPI is not initialized)
    except ImportError as e:
        why.append(f"mpi4py is not installed in {sys.executable} ({e})")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        why.append("mpirun is not on PATH")
    else:
        version = mpirun_version(mpirun)
        if "Open MPI" not in version:
            why.append(f"{mpirun} is not Open MPI's mpirun ({version or 'no --version'})")
    return "; ".join(why) + f"; {INSTALL}" if why else None


def mpirun_version(mpirun: str) -> str:
    """First line of `mpirun --version`, e.g. 'mpirun (Open MPI) 4.1.4'."""
    try:
        out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def cma_problem() -> str:
    """'' when one process may read another's memory with process_vm_readv
    (Linux cross-memory attach, vader's single-copy path), else why not.

    Two forked siblings, as two ranks are: the first allows any process to
    attach to it (as Open MPI does for its ranks, which matters under Yama
    ptrace_scope 1) and holds a pattern; the second reads it."""
    import ctypes

    class IOVec(ctypes.Structure):
        _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    pattern = b"tccomm-cma-probe"
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    buf = ctypes.create_string_buffer(len(pattern))
    holder = os.fork()
    if holder == 0:  # child 1: holds the pattern until the reader is done
        os.close(ready_r)
        os.close(done_w)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
        buf.raw = pattern
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)
    reader = os.fork()
    if reader == 0:  # child 2: reads child 1's buffer (same address after fork)
        got = ctypes.create_string_buffer(len(pattern))
        local = IOVec(ctypes.cast(got, ctypes.c_void_p), len(pattern))
        remote = IOVec(ctypes.cast(buf, ctypes.c_void_p), len(pattern))
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong,
                                          ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.c_ulong]
        n = libc.process_vm_readv(holder, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        err = ctypes.get_errno()
        os._exit(0 if n == len(pattern) and got.raw == pattern else min(255, err or 254))
    _, status = os.waitpid(reader, 0)
    os.write(done_w, b"x")
    os.waitpid(holder, 0)
    for fd in (ready_r, done_r, done_w):
        os.close(fd)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return ""
    if code == 254:
        return "process_vm_readv read something else"
    return f"process_vm_readv failed: {os.strerror(code)} (ptrace policy or seccomp)"


_CMA: list[str] = []  # the probe's answer, once per launcher process


def mpirun_command(world: int) -> tuple[list[str], str]:
    """The mpirun command line (without the rank program) and a line saying
    what it runs on."""
    if not _CMA:
        _CMA.append(cma_problem())
    mechanism = "none" if _CMA[0] else "cma"
    note = ("single copy: CMA (process_vm_readv between ranks works)" if not _CMA[0] else
            f"no single copy: {_CMA[0]}; vader copies through shared memory twice")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world),
           "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
           "--mca", "btl_vader_single_copy_mechanism", mechanism]
    return cmd, f"{mpirun_version(shutil.which('mpirun') or 'mpirun')}, btl self,vader, {note}"


def open_world():
    """MPI, initialized in this rank (started by mpirun), and a duplicate of
    MPI_COMM_WORLD for the measured calls. One thread calls MPI, as one
    thread calls tccomm: no MPI_THREAD_MULTIPLE locking in Open MPI's path
    (mpi4py asks for it by default)."""
    import mpi4py
    mpi4py.rc.thread_level = "single"
    from mpi4py import MPI
    vendor = MPI.get_vendor()
    if vendor[0] != "Open MPI":
        raise SystemExit(f"mpi4py runs on {vendor[0]}, not Open MPI: rebuild it "
                         "(pip install --no-binary mpi4py --force-reinstall mpi4py)")
    return MPI, MPI.COMM_WORLD.Dup()


def not_available(op: str, dtype: str) -> str | None:
    """Why Open MPI cannot run `op` on `dtype`, or None."""
    if op in REDUCTIONS and dtype not in ("float32", "float64"):
        return f"not available in {dtype} (Open MPI has no MPI_SUM on 16-bit floats)"
    return None


def op_call(MPI, comm, op: str, inp, out, dtype: str):
    """One iteration of `op` on these tensors as Open MPI runs it (a
    callable taking no argument), as bench_collectives' make builds them for
    the torch.distributed groups; out is None for the in-place ops."""
    import torch

    mpi_type = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE}.get(dtype, MPI.UINT16_T)

    def buf(t):
        """The tensor's memory for MPI: a numpy view (bfloat16 has no numpy type)."""
        return [(t.view(torch.int16) if t.element_size() == 2 else t).numpy(), mpi_type]

    b_in = buf(inp)
    if op == "allreduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, b_in, MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(b_in, root=0)
    b_out = buf(out)
    if op == "allgather":
        return lambda: comm.Allgather(b_in, b_out)
    if op == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(b_in, b_out, MPI.SUM)
    if op == "alltoall":
        return lambda: comm.Alltoall(b_in, b_out)
    raise ValueError(op)


def main() -> int:
    """Open MPI alone: bench_collectives.py with --backends openmpi (a gloo
    group still carries the barriers between batches and the agreement on
    results)."""
    why = missing()
    if why:
        print(f"{BACKEND}: not available ({why})")
        return 2
    sys.argv = [bc.__file__, "--backends", BACKEND] + sys.argv[1:]
    bc.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
