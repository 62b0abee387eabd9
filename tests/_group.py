"""Spawning a group of rank processes and watching it, shared by every
multi-process suite: the c10d specs (tests/_harness.py), the TorchComm-API
groups (tests/test_torchcomm_api.py) and the CUDA scenarios (tests/test_cuda.py).

spawn() starts one process per rank in a session of its own, with its stdout
and stderr in OUT_DIR/rank<R>.log. A rank reports its progress as events
(tests/_rank.py) in OUT_DIR/rank<R>.jsonl; watch() follows them until every
rank has exited and returns what the group left behind (a Run), from which
merge, init_failure, unfinished and teardown_result decide the verdicts.

Hard limits (so a hang fails fast instead of blocking CI):
  * a rank that shows no progress for the case's limit (by default
    TCCOMM_TEST_CASE_TIMEOUT seconds, default 75; TCCOMM_TEST_INIT_TIMEOUT,
    default 150, before every rank has reported its first case) is hung:
    every rank gets SIGUSR1 (faulthandler dumps its Python stacks into its
    log), then the group is killed;
  * a rank that dies (a signal, or an exit code other than 0 and 3, the
    restart code) gets the others killed 5 s later unless they exit first;
  * once every rank is past its last case, the group has
    TCCOMM_TEST_TEARDOWN_TIMEOUT seconds (default 30) to exit; a rank still
    running then is hung in its teardown (same evidence).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASE_TIMEOUT = float(os.environ.get("TCCOMM_TEST_CASE_TIMEOUT", "75"))
INIT_TIMEOUT = float(os.environ.get("TCCOMM_TEST_INIT_TIMEOUT", "150"))


def teardown_timeout() -> float:
    return float(os.environ.get("TCCOMM_TEST_TEARDOWN_TIMEOUT", "30"))


@dataclasses.dataclass
class Result:
    status: str  # pass, fail, skip
    msg: str = ""
    verdicts: list = dataclasses.field(default_factory=list)  # (status, msg) per rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Group:
    """The processes of one spawned group."""
    procs: list[subprocess.Popen]
    logs: list[str]  # per rank: its stdout + stderr
    out_dir: str     # where the ranks write their events (rank<R>.jsonl)

    def kill(self) -> None:
        """SIGUSR1 to every rank still running (its Python stacks into its
        log), then SIGKILL to its whole session; waits for them."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
        if alive:
            time.sleep(1.0)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def spawn(out_dir: str, world: int, args, env) -> Group:
    """Starts `world` ranks: rank R runs `python *args(R)` in tests/ with the
    environment `env(R)`, in a session of its own (so that a kill reaches
    its children too), its output going to out_dir/rank<R>.log."""
    procs, logs = [], []
    for rank in range(world):
        log = os.path.join(out_dir, f"rank{rank}.log")
        logs.append(log)
        with open(log, "w") as lf:
            procs.append(subprocess.Popen(
                [sys.executable, *args(rank)], env=env(rank), cwd=HERE, stdout=lf,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    return Group(procs, logs, out_dir)


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            data = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(data[-lines:])


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ----------------------------------------------------------------------
# watching a spawned group, and what it left behind
# ----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What one spawned group left behind."""
    events: list[list[dict]]  # per rank, in the order written
    codes: list[int | None]   # exit codes (negative: killed by that signal)
    phases: list[str]         # per rank: the case or teardown step it was last in
    logs: list[str]           # per rank: stdout + stderr (+ stacks dumped on a hang)
    killed: str = ""          # why the harness killed the group ("" if it ended by itself)

    @property
    def world(self) -> int:
        return len(self.codes)

    def find(self, rank: int, kind: str, case: str | None = None) -> dict | None:
        for ev in self.events[rank]:
            if ev.get("event") == kind and ev.get("case") == case:
                return ev
        return None

    def tails(self, ranks, lines: int = 25) -> str:
        return "\n".join(f"--- rank {q} ({describe_exit(self.codes[q])}), log "
                         f"{self.logs[q]}:\n{tail(self.logs[q], lines)}" for q in ranks)


class _Watch:
    """Follows a spawned group until every rank has exited (see watch)."""

    def __init__(self, group: Group, case_limit, teardown_limit):
        n = len(group.procs)
        self.group = group
        self.case_limit, self.teardown_limit = case_limit, teardown_limit
        self.run = Run([[] for _ in range(n)], [None] * n, ["<init>"] * n, group.logs)
        self.offsets = [0] * n
        self.last_progress = [time.monotonic()] * n
        self.done = [False] * n  # past the last case (reported "done" or a teardown step)
        self.crashed_at = None
        self.teardown_since = None

    def read_new(self) -> None:
        for q in range(len(self.offsets)):
            try:
                with open(os.path.join(self.group.out_dir, f"rank{q}.jsonl"), "rb") as f:
                    f.seek(self.offsets[q])
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")  # only complete lines
            if end < 0:
                continue
            self.offsets[q] += end + 1
            for line in chunk[:end + 1].decode(errors="replace").splitlines():
                try:
                    self._seen(q, json.loads(line))
                except ValueError:
                    continue

    def _seen(self, q: int, ev: dict) -> None:
        self.run.events[q].append(ev)
        self.last_progress[q] = time.monotonic()
        kind = ev.get("event")
        if kind == "start":
            self.run.phases[q] = ev["case"]
        elif kind == "done":
            self.run.phases[q], self.done[q] = "after 'done'", True
        elif kind == "teardown":
            self.run.phases[q], self.done[q] = ev["step"], True

    def why_kill_now(self, codes, now) -> str:
        """Why the group must be killed now ("" while it may go on)."""
        phase = self.run.phases
        dead = [q for q, c in enumerate(codes) if c not in (None, 0, 3)]
        if dead:  # the others get a moment to notice and exit by themselves
            self.crashed_at = self.crashed_at or now
            if now - self.crashed_at > 5.0:
                q = dead[0]
                return (f"rank {q} died ({describe_exit(codes[q])}) during {phase[q]!r}; "
                        f"the others were killed")
        alive = [q for q, c in enumerate(codes) if c is None]
        if all(self.done[q] or codes[q] is not None for q in range(len(codes))):
            # Every rank is past its last case: only the teardown is left.
            self.teardown_since = self.teardown_since or now
            if now - self.teardown_since > self.teardown_limit:
                return (f"teardown hung: ranks {alive} still running {self.teardown_limit:.0f} s "
                        f"after every rank was past its last case (in "
                        f"{[phase[q] for q in alive]}); killed (Python stacks in the logs)")
            return ""
        limit = (INIT_TIMEOUT if "<init>" in phase
                 else max(self.case_limit(p) for p in phase))
        stuck = [q for q in alive if now - self.last_progress[q] > limit]
        if stuck:
            return (f"no progress for {limit:.0f} s on ranks {stuck} in "
                    f"{[phase[q] for q in stuck]}: hung, killed (stacks in the logs)")
        return ""


def watch(group: Group, case_limit=lambda case: CASE_TIMEOUT,
          teardown_limit: float | None = None) -> Run:
    """Waits for `group` until every rank has exited; kills it on a hang or a
    crash (see the module docstring) and returns what it left behind.
    case_limit(case): seconds without progress before a rank in `case` is hung."""
    w = _Watch(group, case_limit, teardown_timeout() if teardown_limit is None else teardown_limit)
    while True:
        w.read_new()
        codes = [p.poll() for p in group.procs]
        if all(c is not None for c in codes):
            break
        why = w.why_kill_now(codes, time.monotonic())
        if why:
            w.run.killed = why
            group.kill()
            break
        time.sleep(0.05)
    w.read_new()
    w.run.codes = [p.returncode for p in group.procs]
    return w.run


# ----------------------------------------------------------------------
# verdicts from a run's events
# ----------------------------------------------------------------------


def merge(evs: list[dict]) -> Result:
    """One verdict from every rank's result for a case. The ranks must agree:
    a case that passes on one rank and is skipped or fails on another fails,
    showing every rank's verdict."""
    verdicts = [(ev["status"], ev.get("msg", "")) for ev in evs]
    statuses = {s for s, _ in verdicts}
    if statuses == {"skip"}:
        return Result("skip", verdicts[0][1], verdicts)
    if statuses == {"pass"}:
        digests = [ev.get("digest") for ev in evs]
        if any(d is not None for d in digests) and len(set(digests)) != 1:
            return Result("fail", "results are not bit-identical on every rank "
                                  f"(sha1 per rank: {digests})", verdicts)
        return Result("pass", "", verdicts)
    head = "the ranks' verdicts differ:\n" if len(statuses) > 1 else ""
    return Result("fail", head + "\n".join(f"rank {q} [{s}]" + (f": {m}" if m else "")
                                           for q, (s, m) in enumerate(verdicts)), verdicts)


def init_failure(run: Run, what: str) -> str | None:
    """Why the group of `run` never formed (None when every rank joined it)."""
    res = [run.find(q, "result", "<init>") for q in range(run.world)]
    bad = [q for q in range(run.world) if res[q] is None or res[q]["status"] != "pass"]
    if not bad:
        return None
    msgs = "\n".join(f"rank {q}: {res[q]['msg']}" for q in bad if res[q] is not None)
    why = f" ({run.killed})" if run.killed else ""
    return (f"{what}: the group could not be created (ranks {bad}){why}.\n{msgs}\n"
            f"{run.tails(bad)}")


def reported(run: Run, name: str) -> list[dict] | None:
    """Every rank's result for case `name` (None while some rank has none)."""
    evs = [run.find(q, "result", name) for q in range(run.world)]
    return evs if all(ev is not None for ev in evs) else None


def unfinished(run: Run, name: str) -> Result:
    """The verdict on a case that some ranks never finished (hang or crash)."""
    evs = [run.find(q, "result", name) for q in range(run.world)]
    missing = [q for q in range(run.world) if evs[q] is None]
    done = {q: ev["status"] for q, ev in enumerate(evs) if ev is not None}
    how = run.killed or "; ".join(f"rank {q}: {describe_exit(run.codes[q])} in "
                                  f"{run.phases[q]!r}" for q in missing)
    text = (f"case did not finish on ranks {missing} ({how}); "
            f"finished elsewhere with {done}.\n{run.tails(range(run.world))}")
    partial = [f"rank {q}: [{ev['status']}] {ev['msg']}" for q, ev in enumerate(evs)
               if ev is not None and ev["status"] in ("fail", "error")]
    return Result("fail", "\n".join(partial + [text]))


def teardown_result(run: Run, what: str) -> Result:
    """The verdict on everything after the last case of a run in which every
    case finished: each rank must report "done", then exit by itself with
    code 0 (so its teardown steps and the interpreter's exit went through)."""
    bad = []
    for q in range(run.world):
        exit_ = describe_exit(run.codes[q])
        if run.find(q, "done") is None:
            bad.append((q, f"never reported 'done' after its last case ({exit_}, last in "
                           f"{run.phases[q]!r})"))
        elif run.codes[q] != 0:
            bad.append((q, f"{exit_} in teardown step {run.phases[q]!r}"))
    if not bad:
        return Result("pass")
    lines = [f"{what}: teardown failed:"] + [f"rank {q} {why}" for q, why in bad]
    if run.killed:
        lines.append(f"[harness] {run.killed}")
    return Result("fail", "\n".join(lines) + "\n" + run.tails([q for q, _ in bad], lines=60))


# NCCL on one GPU shared by several ranks: each must look like its own host
# that talks over sockets, or NCCL refuses the duplicate device.
SHARED_GPU_NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1",
                       "NCCL_MNNVL_ENABLE": "0"}


def shared_gpu_env(rank: int) -> dict:
    return dict(SHARED_GPU_NCCL_ENV, NCCL_HOSTID=f"tccomm-test-host-{rank}")


def run_scenario_or_fail(out_dir: str, world: int, args, env, scenario: str, limit: float) -> None:
    """Spawns `world` ranks running `args(rank)` (each reports `scenario`),
    watches them (a rank without progress for `limit` s is hung) and fails
    the test unless every rank passed it and exited with code 0."""
    import pytest

    run = watch(spawn(out_dir, world, args, env), case_limit=lambda case: limit)
    evs = reported(run, scenario)
    res = merge(evs) if evs else unfinished(run, scenario)
    bad_exit = [q for q, code in enumerate(run.codes) if code != 0]
    if res.status != "pass" or bad_exit:
        exits = f"\nranks {bad_exit} did not exit with code 0\n{run.tails(bad_exit)}" if bad_exit else ""
        pytest.fail(f"{scenario} at world {world}: {res.msg}{exits}", pytrace=False)

