"""The rules every op of a TorchComm and of its windows follows: the
communicator must be usable, the common arguments (hints, the per-op timeout)
are checked, and a failed or timed-out op either aborts the process or makes
the communicator unusable (abort_process_on_timeout_or_error).

Kept apart from comm.py so that the windows (_window.py) reach these rules
through this small interface, not through the communicator's internals.
"""

import os
import sys

import torch.distributed as dist

from torchcomm_backend import _options


class CommPolicy:
    """The state the rules need for one communicator: its identity (for the
    messages), its default timeout, the error policy, and why it is unusable."""

    def __init__(self, name, rank, size, timeout, abort):
        self.name, self.rank, self.size = name, rank, size
        self.timeout = timeout  # the communicator's default per-op timeout
        self.abort = abort
        self.failure = None  # why the communicator is unusable
        self.finalized = False
        # Neither finalized nor failed: the one attribute an op's fast path reads.
        self.usable = True

    def finalize(self):
        """Marks the communicator finalized; True the first time."""
        if self.finalized:
            return False
        self.finalized = True
        self.usable = False
        return True

    def check_usable(self, op):
        if self.usable:
            return
        if self.finalized:
            raise RuntimeError(f"tccomm: {op} on communicator '{self.name}' (rank {self.rank}): "
                               f"the communicator was finalized")
        if self.failure is not None:
            raise dist.DistBackendError(f"tccomm: {op} on communicator '{self.name}' (rank {self.rank}): "
                                        f"the communicator is unusable after {self.failure}")

    def begin(self, op, hints, timeout):
        """Checks the communicator and the common arguments; the op's timeout."""
        self.check_usable(op)
        _options.check_hints(hints, _options.OP_HINTS, op)
        return _options.as_timedelta(timeout, op) or self.timeout

    def failed(self, op, err):
        """The error policy for an op that failed or timed out. Never returns."""
        cause = f"{op} failed: {type(err).__name__}: {err}"
        if self.failure is None:
            self.failure = cause
            self.usable = False
        if self.abort:
            sys.stdout.flush()
            print(f"tccomm: {op} on communicator '{self.name}' (rank {self.rank} of {self.size}) "
                  f"failed or timed out; aborting the process (abort_process_on_timeout_or_error is set; "
                  f"pass False or set TORCHCOMM_ABORT_ON_ERROR=0 to get an exception instead).\n"
                  f"cause: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            os.abort()
        raise dist.DistBackendError(f"tccomm: {op} on communicator '{self.name}' (rank {self.rank}): "
                                    f"{type(err).__name__}: {err}") from err


class TorchWork:
    """What every op returns: is_completed() and wait()."""

    def __init__(self, policy, op, work):
        self._policy = policy
        self._op = op
        self._work = work  # None: finished when returned

    def is_completed(self):
        return self._work is None or self._work.is_completed()

    def wait(self):
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as err:  # noqa: BLE001  (every failure goes through the policy)
                self._policy.failed(self._op, err)
            self._work = None
