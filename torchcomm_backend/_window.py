"""One-sided windows of the TorchComm-style API (comm.new_window()).

The reference offers windows on one vendor backend over registered GPU
memory. Here a window lives in host shared memory (the core's tcc_window_*),
so it needs a CPU communicator whose ranks share a host (the shared-memory
transport); elsewhere registration raises and says why.

Semantics chosen (and how they differ from registering arbitrary memory):
  * tensor_register(t) is collective. Memory of another process can only be
    reached if it lives in shared memory, so the window allocates a shared
    buffer of t's size, copies t into it, and rebinds t to that buffer: t
    itself then sees every put that peers make (as with the reference), but
    views of t's old storage taken before registration do not. Ranks may
    register different sizes; all should use one dtype.
  * put(tensor, dst_rank, offset) copies tensor into dst_rank's buffer at
    element `offset` (in the registered dtype); it is complete when it returns.
  * signal(dst) / wait_signal(peer) count: n signals satisfy n waits, and a
    wait that returns makes every put the peer made before its signal visible.
  * map_remote_tensor(rank) is a zero-copy view of rank's buffer (shape of
    this rank's tensor when the sizes match, else 1-D).
  * tensor_deregister() is local; views and t keep the memory mapped for as
    long as they live.
Ops run on the calling thread; with async_op=True the returned work is
already complete.
"""

import torch

from torchcomm_backend._policy import TorchWork


class TorchCommWindow:
    """Made by TorchComm.new_window(): `policy` is the communicator's
    (_policy.CommPolicy: its identity, timeout and error policy), `pg` the
    ProcessGroup whose tccomm backend the window is created on."""

    def __init__(self, policy, pg):
        self._policy = policy
        self._pg = pg
        self._handle = None
        self._dtype = None
        self._shape = None
        self._peer_bytes = None

    def get_size(self):
        return self._policy.size

    def tensor_register(self, tensor):
        """Collective: every rank of the communicator registers one CPU tensor."""
        op = "tensor_register"
        policy = self._policy
        policy.check_usable(op)
        problem = _register_problem(tensor)
        if self._handle is not None:
            problem = RuntimeError(f"tccomm: window {op}: a tensor is registered already; "
                                   "call tensor_deregister() first")
        timeout_ms = _ms(policy.timeout)
        if problem is not None:
            # Still take part, declining: the other ranks then fail at once
            # (naming this rank) instead of waiting for their timeout.
            try:
                torch.ops.tccomm.window_create(self._pg.boxed(), -1, timeout_ms)
            except Exception:  # noqa: BLE001  (the error to report is `problem`)
                pass
            raise problem
        try:
            handle = torch.ops.tccomm.window_create(self._pg.boxed(), tensor.numel() * tensor.element_size(),
                                                    timeout_ms)
        except torch.distributed.DistError as err:
            policy.failed(op, err)
        self._handle = handle
        self._dtype, self._shape = tensor.dtype, tuple(tensor.shape)
        local = torch.ops.tccomm.window_view(handle, policy.rank, tensor.dtype, list(tensor.shape))
        local.copy_(tensor)
        with torch.no_grad():
            tensor.set_(local.untyped_storage(), 0, local.shape, local.stride())
        return tensor

    def tensor_deregister(self):
        if self._handle is not None:
            torch.ops.tccomm.window_destroy(self._handle)
            self._handle = None

    def put(self, tensor, dst_rank, offset, async_op=False, hints=None, timeout=None):
        op = "put"
        self._check(op, hints)
        if tensor.device.type != "cpu":
            raise RuntimeError(f"tccomm: window put: windows live in host shared memory; the tensor is on "
                               f"{tensor.device}")
        if tensor.dtype != self._dtype:
            raise TypeError(f"tccomm: window put: the tensor is {tensor.dtype} but the window holds {self._dtype}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"tccomm: window put: offset must be a non-negative element index, got {offset!r}")
        torch.ops.tccomm.window_put(self._handle, tensor, dst_rank, offset * tensor.element_size())
        return TorchWork(self._policy, op, None)

    def signal(self, dst_rank, async_op=False, hints=None, timeout=None):
        self._check("signal", hints)
        torch.ops.tccomm.window_signal(self._handle, dst_rank)
        return TorchWork(self._policy, "signal", None)

    def wait_signal(self, peer_rank, async_op=False, hints=None, timeout=None):
        op = "wait_signal"
        self._check(op, hints)
        timeout = self._policy.begin(op, hints, timeout)
        try:
            torch.ops.tccomm.window_wait_signal(self._handle, peer_rank, _ms(timeout))
        except torch.distributed.DistError as err:
            self._policy.failed(op, err)
        return TorchWork(self._policy, op, None)

    def map_remote_tensor(self, rank):
        """A zero-copy view of `rank`'s registered buffer."""
        self._check("map_remote_tensor", None)
        size = self._policy.size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"tccomm: window map_remote_tensor: rank {rank!r} is out of range [0, {size})")
        mine = torch.Size(self._shape).numel()
        theirs = torch.ops.tccomm.window_buffer_bytes(self._handle, rank)
        elem = torch.empty((), dtype=self._dtype).element_size()
        shape = list(self._shape) if theirs == mine * elem else [theirs // elem]
        return torch.ops.tccomm.window_view(self._handle, rank, self._dtype, shape)

    def _check(self, op, hints):
        self._policy.begin(op, hints, None)
        if self._handle is None:
            raise RuntimeError(f"tccomm: window {op}: no tensor is registered (call tensor_register first)")


def _register_problem(tensor):
    """Why `tensor` cannot be registered (an exception to raise), or None."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"tccomm: window tensor_register: expected a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        return RuntimeError(f"tccomm: window tensor_register: windows live in host shared memory; the tensor "
                            f"is on {tensor.device} (CUDA windows are not supported yet)")
    if not tensor.is_contiguous():
        return ValueError("tccomm: window tensor_register: the tensor must be contiguous")
    return None


def _ms(timeout):
    return max(1, int(timeout.total_seconds() * 1000))
