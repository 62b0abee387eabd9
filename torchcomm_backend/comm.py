"""The TorchComm-style API on the tccomm core.

    import torchcomm_backend as tc
    comm = tc.new_comm("tccomm", torch.device("cpu"))   # torchrun env, or store=...
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    comm.finalize()

A TorchComm holds a ProcessGroup carrying a tccomm backend, built by the same
rendezvous as init_process_group("tccomm") (_create.create_group). Every
method validates its arguments, calls the backend with the per-op timeout,
and applies the error policy: a failed or timed-out op aborts the process
(abort_process_on_timeout_or_error) or makes the communicator unusable.
Arguments the backend rejects before sending anything raise and change nothing.

A synchronous collective, send or recv of a CPU communicator with the
default hints and timeout takes the direct path (_sync): the extension's direct_* functions
(csrc/direct_ops.cpp) issue it and wait for it in one call, without torch's
binding of Backend and Work; everything else goes through that binding
(_issue), as every op does with TCCOMM_TORCHCOMM_FASTPATH=0 in the
environment when the communicator is created. Both run the same backend code.
"""

import os
import threading

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from torchcomm_backend import _options
from torchcomm_backend._extension import build_info, load_extension
from torchcomm_backend._policy import CommPolicy, TorchWork  # noqa: F401  (TorchWork re-exported)
from torchcomm_backend._window import TorchCommWindow
from torchcomm_backend._options import ReduceOp, to_c10d_op  # noqa: F401  (ReduceOp re-exported)

BACKEND_NAME = "tccomm"

_env_stores = {}  # (addr, port) -> TCPStore, one per process
_unnamed = [0]    # communicators created without a name, in this process
_native = None    # the extension, torchcomm_backend._C, once a communicator exists

# The direct path's reduce op codes: c10d's RedOpType values (PREMUL_SUM,
# which carries a factor, takes the binding).
_REDUCE_CODES = {name: int(getattr(dist.ReduceOp.RedOpType, name))
                 for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")}


def new_comm(backend, device, *, store=None, timeout=None, name=None, hints=None,
             abort_process_on_timeout_or_error=None):
    """Creates a communicator over every rank (collective).

    backend: "tccomm". device: torch.device("cpu"), or a CUDA device (its ops
    then run through NCCL with stream semantics: wait() makes the current
    stream wait; ops can be captured in CUDA graphs).
    store: a c10d Store (FileStore, TCPStore, ...); without one, the torchrun
    environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) gives a TCPStore.
    timeout: default per-op timeout (timedelta or seconds; default
    TORCHCOMM_TIMEOUT_SECONDS, 600). abort_process_on_timeout_or_error:
    default TORCHCOMM_ABORT_ON_ERROR (true). hints: {"torchcomm::tccomm::transport":
    "auto"|"shm"|"tcp"}; other backends' hints are ignored with a warning.
    """
    if backend != BACKEND_NAME:
        raise ValueError(f"tccomm: new_comm: unknown backend {backend!r}; "
                         f"torchcomm_backend provides {BACKEND_NAME!r}")
    device = _check_device(torch.device(device))
    taken = _options.check_hints(hints, _options.COMM_HINTS, "new_comm")
    timeout = _options.as_timedelta(timeout, "new_comm") or _options.default_timeout()
    abort = (_options.default_abort() if abort_process_on_timeout_or_error is None
             else bool(abort_process_on_timeout_or_error))
    if name is None:
        # Ranks create their communicators in the same order, so they agree.
        _unnamed[0] += 1
        name = f"comm{_unnamed[0]}"
    elif not isinstance(name, str) or not name:
        raise ValueError(f"tccomm: new_comm: name must be a non-empty string, got {name!r}")
    if store is None:
        store, rank, size = _store_from_env(timeout)
    else:
        rank, size = _rank_and_size(store)
    comm_store = dist.PrefixStore(f"torchcomm/{name}", store)
    return TorchComm._create(comm_store, rank, size, device, timeout, name, dict(hints or {}),
                             taken, abort)


def _check_device(device):
    """The communicator's device: the CPU, or a CUDA device when this build
    has the core's CUDA path and torch sees a GPU (the index defaults to the
    current device)."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tccomm: new_comm: device {device} is not supported; "
                         "use torch.device('cpu') or a CUDA device")
    if not build_info()["cuda"]:
        raise RuntimeError("tccomm: new_comm: this build of tccomm has no CUDA path (it was built "
                           "against a torch without CUDA); use torch.device('cpu')")
    if not torch.cuda.is_available():
        raise RuntimeError(f"tccomm: new_comm: cannot use {device}: torch sees no CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _rank_and_size(store):
    missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
    if missing:
        raise ValueError(f"tccomm: new_comm: with a store given, this process's rank and the world "
                         f"size come from RANK and WORLD_SIZE, but {missing} are not set")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _store_from_env(timeout):
    needed = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    missing = [v for v in needed if not os.environ.get(v)]
    if missing:
        raise ValueError(f"tccomm: new_comm: no store given and no torchrun environment: "
                         f"{', '.join(missing)} not set (run under torchrun or pass store=)")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _env_stores.get((addr, port))
    if store is None:
        # Under torchrun the agent already serves a store at MASTER_PORT (as
        # init_process_group's env:// does, join it instead of hosting one).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(addr, port, size, rank == 0 and not agent, timeout=timeout)
        _env_stores[(addr, port)] = store
    return store, rank, size


class TorchComm:
    """A communicator: see new_comm. Methods follow the TorchComm reference."""

    @classmethod
    def _create(cls, store, rank, size, device, timeout, name, hints, taken, abort):
        from torchcomm_backend._create import create_group

        transport = taken.get(_options.HINT_PREFIX + "transport", "auto")
        pg = create_group(store, rank, size, timeout, name, transport)
        self = cls()
        self._store = store
        self._pg = pg
        self._backend = pg._get_backend(torch.device("cpu"))
        self._rank, self._size = rank, size
        self._device = device
        self._timeout = timeout
        self._name = name
        self._hints = hints
        self._abort = abort
        self._policy = CommPolicy(name, rank, size, timeout, abort)
        self._splits = 0
        self._lock = threading.Lock()  # per-op timeouts of send/recv
        self._opts_cache = {}  # see _opts
        self._finished = TorchWork(self._policy, None, None)
        global _native
        _native = load_extension()
        # The handle of the direct path (_sync); CUDA ops keep the binding,
        # and so does everything with TCCOMM_TORCHCOMM_FASTPATH=0.
        direct = device.type == "cpu" and os.environ.get("TCCOMM_TORCHCOMM_FASTPATH", "1") != "0"
        self._direct = torch.ops.tccomm.direct_handle(pg.boxed()) if direct else 0
        return self

    # ---- management -------------------------------------------------------

    def get_rank(self):
        return self._rank

    def get_size(self):
        return self._size

    def get_name(self):
        return self._name

    def get_device(self):
        return self._device

    def get_backend(self):
        return BACKEND_NAME

    def finalize(self):
        """Waits for the issued ops and frees the communicator; ops raise afterwards."""
        if self._policy.finalize():
            self._backend.shutdown()

    def split(self, ranks, name=None, hints=None):
        """A communicator of `ranks` (rank i of it is ranks[i]).

        Every rank of this communicator calls it; those in the same group pass
        the same list. [] returns None; a list without this rank raises.
        """
        self._policy.check_usable("split")
        self._splits += 1  # counted on every rank, whatever it passes
        ranks = list(ranks)
        if not ranks:
            return None
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._size:
                raise ValueError(f"tccomm: split on '{self._name}': rank {r!r} is not a rank of "
                                 f"this communicator (size {self._size})")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"tccomm: split on '{self._name}': ranks {ranks} has duplicates")
        if self._rank not in ranks:
            raise ValueError(f"tccomm: split on '{self._name}': rank {self._rank} is not in {ranks}; "
                             f"ranks outside every new group pass []")
        merged = dict(self._hints)
        merged.update(hints or {})
        taken = _options.check_hints(merged, _options.COMM_HINTS, "split")
        members = "-".join(str(r) for r in ranks)
        child = name or f"{self._name}/split{self._splits}"
        store = dist.PrefixStore(f"split{self._splits}/{members}", self._store)
        return TorchComm._create(store, ranks.index(self._rank), len(ranks), self._device,
                                 self._timeout, child, merged, taken, self._abort)

    def new_window(self):
        """A one-sided window (see torchcomm_backend._window)."""
        self._policy.check_usable("new_window")
        return TorchCommWindow(self._policy, self._pg)

    # ---- point to point -----------------------------------------------------

    def send(self, tensor, dst, async_op=False, hints=None, timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and dst.__class__ is int):
            with self._lock:  # never inside another thread's timeout change (_p2p)
                return self._sync("send", _native.direct_send, tensor, dst)
        return self._p2p("send", self._backend.send, tensor, dst, async_op, hints, timeout)

    def recv(self, tensor, src, async_op=False, hints=None, timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and src.__class__ is int):
            with self._lock:  # never inside another thread's timeout change (_p2p)
                return self._sync("recv", _native.direct_recv, tensor, src)
        return self._p2p("recv", self._backend.recv, tensor, src, async_op, hints, timeout)

    def _p2p(self, op, call, tensor, peer, async_op, hints, timeout):
        timeout = self._policy.begin(op, hints, timeout)
        # c10d's send/recv take no options: the op takes the communicator's
        # timeout when issued, so set it around the call.
        with self._lock:
            if timeout != self._timeout:
                self._backend.set_timeout(timeout)
            try:
                return self._issue(op, async_op, call, [tensor], peer, 0)
            finally:
                if timeout != self._timeout:
                    self._backend.set_timeout(self._timeout)

    # ---- collectives ----------------------------------------------------------

    def broadcast(self, tensor, root, async_op=False, hints=None, timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and root.__class__ is int):
            return self._sync("broadcast", _native.direct_broadcast, tensor, root)
        opts = self._opts("broadcast", c10d.BroadcastOptions, hints, timeout, root=root)
        return self._issue("broadcast", async_op, self._backend.broadcast, [tensor], opts)

    def all_reduce(self, tensor, op, async_op=False, hints=None, timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and op.__class__ is ReduceOp and op.factor is None):
            return self._sync("all_reduce", _native.direct_all_reduce, tensor, _REDUCE_CODES[op.name])
        opts = self._opts("all_reduce", c10d.AllreduceOptions, hints, timeout, reduce_op=op)
        return self._issue("all_reduce", async_op, self._backend.allreduce, [tensor], opts)

    def reduce(self, tensor, root, op, async_op=False, hints=None, timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and root.__class__ is int and op.__class__ is ReduceOp and op.factor is None):
            return self._sync("reduce", _native.direct_reduce, tensor, root, _REDUCE_CODES[op.name])
        opts = self._opts("reduce", c10d.ReduceOptions, hints, timeout, reduce_op=op, root=root)
        return self._issue("reduce", async_op, self._backend.reduce, [tensor], opts)

    def all_gather(self, tensor_list, tensor, async_op=False, hints=None, timeout=None):
        opts = self._opts("all_gather", c10d.AllgatherOptions, hints, timeout)
        outs = list(tensor_list)
        return self._issue("all_gather", async_op, self._backend.allgather, [outs], [tensor], opts)

    def all_gather_single(self, output, input, async_op=False, hints=None, timeout=None):  # noqa: A002
        if not async_op and hints is None and timeout is None and self._direct and self._policy.usable:
            return self._sync("all_gather_single", _native.direct_all_gather_single, output, input)
        opts = self._opts("all_gather_single", c10d.AllgatherOptions, hints, timeout)
        return self._issue("all_gather_single", async_op,
                           self._backend._allgather_base, output, input, opts)

    def reduce_scatter(self, output, input_list, op, async_op=False, hints=None, timeout=None):
        opts = self._opts("reduce_scatter", c10d.ReduceScatterOptions, hints, timeout, reduce_op=op)
        ins = list(input_list)
        return self._issue("reduce_scatter", async_op,
                           self._backend.reduce_scatter, [output], [ins], opts)

    def reduce_scatter_single(self, output, input, op, async_op=False, hints=None,  # noqa: A002
                              timeout=None):
        if (not async_op and hints is None and timeout is None and self._direct and self._policy.usable
                and op.__class__ is ReduceOp and op.factor is None):
            return self._sync("reduce_scatter_single", _native.direct_reduce_scatter_single, output, input,
                              _REDUCE_CODES[op.name])
        opts = self._opts("reduce_scatter_single", c10d.ReduceScatterOptions, hints, timeout, reduce_op=op)
        return self._issue("reduce_scatter_single", async_op,
                           self._backend._reduce_scatter_base, output, input, opts)

    def all_to_all_single(self, output, input, async_op=False, hints=None, timeout=None):  # noqa: A002
        if not async_op and hints is None and timeout is None and self._direct and self._policy.usable:
            return self._sync("all_to_all_single", _native.direct_all_to_all_single, output, input)
        opts = self._opts("all_to_all_single", c10d.AllToAllOptions, hints, timeout)
        return self._issue("all_to_all_single", async_op,
                           self._backend.alltoall_base, output, input, [], [], opts)

    def all_to_all_v_single(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                            async_op=False, hints=None, timeout=None):
        opts = self._opts("all_to_all_v_single", c10d.AllToAllOptions, hints, timeout)
        out_splits = [int(s) for s in output_split_sizes]
        in_splits = [int(s) for s in input_split_sizes]
        return self._issue("all_to_all_v_single", async_op,
                           self._backend.alltoall_base, output, input, out_splits, in_splits, opts)

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op=False, hints=None, timeout=None):
        opts = self._opts("all_to_all", c10d.AllToAllOptions, hints, timeout)
        outs, ins = list(output_tensor_list), list(input_tensor_list)
        return self._issue("all_to_all", async_op, self._backend.alltoall, outs, ins, opts)

    def barrier(self, async_op=False, hints=None, timeout=None):
        if not async_op and hints is None and timeout is None and self._direct and self._policy.usable:
            return self._sync("barrier", _native.direct_barrier)
        opts = self._opts("barrier", c10d.BarrierOptions, hints, timeout)
        return self._issue("barrier", async_op, self._backend.barrier, opts)

    def scatter(self, output_tensor, input_tensor_list, root, async_op=False, hints=None, timeout=None):
        opts = self._opts("scatter", c10d.ScatterOptions, hints, timeout, root=root)
        ins = [list(input_tensor_list)] if self._rank == root else []
        return self._issue("scatter", async_op, self._backend.scatter, [output_tensor], ins, opts)

    def gather(self, output_tensor_list, input_tensor, root, async_op=False, hints=None, timeout=None):
        opts = self._opts("gather", c10d.GatherOptions, hints, timeout, root=root)
        outs = [list(output_tensor_list)] if self._rank == root else []
        return self._issue("gather", async_op, self._backend.gather, outs, [input_tensor], opts)

    # ---- plumbing ---------------------------------------------------------------

    def _opts(self, op, cls, hints, timeout, reduce_op=None, root=None):
        """The c10d options of one op. The common call (no hints, the default
        timeout, a named reduce op) reuses one options object per (op, reduce
        op, root), since building one costs about a microsecond: c10d reads
        the options when the op is issued, and a cached object is never
        changed afterwards, so concurrent callers can share it. The cache is
        keyed by the reduce op's name, not by the object: hashing a ReduceOp
        runs Python code (about 0.1 us of a 3 us small op)."""
        key = None
        if hints is None and timeout is None and (root is None or root.__class__ is int):
            if reduce_op is None:
                key = (op, None, root)
            elif reduce_op.__class__ is ReduceOp and reduce_op.factor is None:
                key = (op, reduce_op.name, root)
        if key is not None and self._policy.usable:
            opts = self._opts_cache.get(key)
            if opts is not None:
                return opts
        opts = cls()
        opts.timeout = self._policy.begin(op, hints, timeout)
        if root is not None:
            opts.rootRank = root
        if reduce_op is not None:
            opts.reduceOp = to_c10d_op(reduce_op, op)
        if key is not None and len(self._opts_cache) < 64:
            self._opts_cache[key] = opts
        return opts

    def _sync(self, op, fn, *args):
        """A synchronous op on the direct path: fn issues it and waits for it,
        and returns None when it completed or the exception it failed with
        once issued (its error policy applies); an error at issue is raised
        as _issue's is."""
        try:
            failure = fn(self._direct, *args)
        except dist.DistError as err:
            # The core refused to start it (failed communicator, ...).
            self._policy.failed(op, err)
        if failure is not None:
            self._policy.failed(op, failure)
        return self._finished  # a synchronous op's result: already complete

    def _issue(self, op, async_op, fn, *args):
        try:
            work = fn(*args)
        except dist.DistError as err:
            # The core refused to start it (failed communicator, ...).
            self._policy.failed(op, err)
        # Anything else is a bad argument: raised before anything was sent.
        if async_op:
            return TorchWork(self._policy, op, work)
        if work is not None:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001  (every failure goes through the policy)
                self._policy.failed(op, err)
        return self._finished  # a synchronous op's result: already complete
