"""What every spawned test rank does besides running its cases (shared by
tests/_worker.py, tests/_tc_worker.py and tests/_cuda_worker.py): report
events to the parent (tests/_group.py), and end the way a user's program
ends, so that the parent can judge the teardown too.

Events are JSON lines appended to OUT_DIR/rank<R>.jsonl, flushed at once so
that the parent sees how far every rank got even if it hangs or crashes:

  {"event": "start",    "case": name, "t": time}
  {"event": "result",   "case": name, "status": pass|fail|error|skip, "msg": ...}
  {"event": "health",   "case": name, "ok": bool, "msg": ...}   (tests/_worker.py)
  {"event": "done"}                      after the last case
  {"event": "teardown", "step": what}    before each step of the teardown
"""

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading


def enable_stack_dumps() -> None:
    """Fatal signals print the Python stacks; SIGUSR1 (sent by the parent
    before it kills a hung group) prints every thread's stack into the log."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)


class Events:
    def __init__(self, out_dir: str, rank: int):
        self._f = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a", buffering=1)

    def emit(self, **kw) -> None:
        self._f.write(json.dumps(kw) + "\n")
        self._f.flush()


# Deliberate faults, set only by tests/test_harness_selfcheck.py to prove that
# the parent notices each of them. They hit rank 1 only, so that the parent
# has to name the right rank.
FAULT_ENV = "TCCOMM_TEST_FAULT"
FAULTS = ("skip-on-rank1", "no-done", "segv-after-done", "exit3-after-done",
          "segv-at-exit", "hang-at-exit")


def fault(rank: int) -> str:
    f = os.environ.get(FAULT_ENV, "")
    assert f in FAULTS + ("",), f"unknown {FAULT_ENV}={f!r}"
    return f if rank == 1 else ""


def verdict(rank: int, status: str, msg: str) -> tuple[str, str]:
    """The verdict to report for a case this rank ran (a fault may change it)."""
    if status == "pass" and fault(rank) == "skip-on-rank1":
        return "skip", "deliberate skip on rank 1 only (harness self-check)"
    return status, msg


def finish(events: Events, rank: int, steps) -> None:
    """After the last case: report "done", then run the teardown `steps`
    ((name, fn) pairs), each announced before it runs so that a hang or crash
    in it is named. The caller then returns from main: the last step is the
    interpreter's own exit (atexit handlers, finalization, the extension's
    destructors), which the parent judges by the exit code."""
    f = fault(rank)
    if f != "no-done":
        events.emit(event="done")
    _after_done(f)
    for name, fn in steps:
        events.emit(event="teardown", step=name)
        fn()
    events.emit(event="teardown", step="interpreter exit")


def _after_done(f: str) -> None:
    if f == "segv-after-done":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif f == "exit3-after-done":  # 3 is the restart code: it must not pass as one
        os._exit(3)
    elif f == "segv-at-exit":
        atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    elif f == "hang-at-exit":  # the interpreter's exit waits for non-daemon threads
        threading.Thread(target=threading.Event().wait, name="never-ends").start()


def leave_now(code: int) -> None:
    """Exits without the interpreter's teardown. Only for a group that broke
    (restart) or never formed (failed init): its threads must not hold up the
    exit, and the parent judges the teardown on a run that completes."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_one_scenario(out_dir: str, scenario: str, fn) -> None:
    """A rank whose whole program is one case: reports `scenario` as one
    case (start, then pass or the failure) running fn(rank, world), then
    ends at once with 0 only on success (the verdict is the report and the
    exit code; the interpreter's teardown is not what such a case checks)."""
    import time
    import traceback

    enable_stack_dumps()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    events = Events(out_dir, rank)
    events.emit(event="start", case=scenario, t=time.time())
    status, msg = "pass", ""
    try:
        fn(rank, world)
    except BaseException as e:  # noqa: BLE001
        status, msg = "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    events.emit(event="result", case=scenario, status=status, msg=msg)
    leave_now(0 if status == "pass" else 1)
