"""Parent side of the multi-process tests.

A *spec* (tests/_registry.py: world size x transport x init method) is run once
per pytest session: its ranks are spawned as separate processes
(tests/_worker.py), run every selected case of that spec in order, and report
events (tests/_rank.py) from which pytest reports one test per case, plus one
"teardown" test per spec for everything after the last case.

How a case is decided:
  * pass: every rank reported pass (with the same result digest, if any);
  * skip: every rank skipped;
  * fail: anything else: a rank failed or raised, the ranks' verdicts differ
    (e.g. one passed and another skipped), or a rank hung or died during it.
How the teardown is decided: pass only if every rank reported "done" after
its last case, then (destroy_process_group, a normal interpreter exit) exited
with code 0 by itself within the teardown limit.

Hard limits (so a hang fails fast instead of blocking CI):
  * a rank that shows no progress for TCCOMM_TEST_CASE_TIMEOUT seconds
    (default 75) is considered hung: every rank gets SIGUSR1 (faulthandler
    dumps its Python stacks into its log), then the group is killed, the
    current case fails with that evidence, and the group is restarted at the
    next case;
  * a rank that dies (signal or exit code) fails the current case the same way;
  * once every rank is past its last case, the group has
    TCCOMM_TEST_TEARDOWN_TIMEOUT seconds (default 30) to exit; a rank still
    running then is hung in its teardown (same evidence; the teardown fails);
  * when a spec's last run ended without a teardown (a restart or a kill
    after its last case), a run with no cases checks the teardown;
  * each spec has a wall-clock budget (TCCOMM_TEST_SPEC_BUDGET, default 600 s)
    after which its remaining cases fail as "not run".

The pieces that watch a group and decide from its events (watch, merge,
init_failure, unfinished, teardown_result) also serve the TorchComm-API
groups (tests/test_torchcomm_api.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import _registry

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")

BACKEND = os.environ.get("TCCOMM_TEST_BACKEND", "tccomm")
CASE_TIMEOUT = float(os.environ.get("TCCOMM_TEST_CASE_TIMEOUT", "75"))
INIT_TIMEOUT = float(os.environ.get("TCCOMM_TEST_INIT_TIMEOUT", "150"))
SPEC_BUDGET = float(os.environ.get("TCCOMM_TEST_SPEC_BUDGET", "600"))
MAX_ATTEMPTS = int(os.environ.get("TCCOMM_TEST_MAX_RESTARTS", "25")) + 1

TEARDOWN = _registry.TEARDOWN  # the pseudo-case of each group: everything after its last case

# (spec name) -> case names selected by pytest in this session (see conftest.py)
SELECTED: dict[str, set[str]] = {}


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


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            data = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(data[-lines:])


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _hang_limit(case: str) -> float:
    """A case's own hang limit (0 when it has none)."""
    c = _registry.all_cases().get(case)
    return c.hang_limit if c is not None else 0.0


# ----------------------------------------------------------------------
# one spawned group: watching it, and what it left behind
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
        return "\n".join(f"--- rank {q} ({_describe_exit(self.codes[q])}), log "
                         f"{self.logs[q]}:\n{_tail(self.logs[q], lines)}" for q in ranks)


class _Watch:
    """Follows a spawned group until every rank has exited (see watch)."""

    def __init__(self, procs, logs, d, case_limit, teardown_limit):
        n = len(procs)
        self.procs, self.d = procs, d
        self.case_limit, self.teardown_limit = case_limit, teardown_limit
        self.run = Run([[] for _ in range(n)], [None] * n, ["<init>"] * n, logs)
        self.offsets = [0] * n
        self.last_progress = [time.monotonic()] * n
        self.done = [False] * n  # past the last case (reported "done" or a teardown step)
        self.crashed_at = None
        self.teardown_since = None

    def read_new(self) -> None:
        for q in range(len(self.procs)):
            try:
                with open(os.path.join(self.d, f"rank{q}.jsonl"), "rb") as f:
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

    def kill_all(self, reason: str) -> None:
        self.run.killed = reason
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:  # Python stacks into the logs
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

    def why_kill_now(self, codes, now) -> str:
        """Why the group must be killed now ("" while it may go on)."""
        phase = self.run.phases
        dead = [q for q, c in enumerate(codes) if c not in (None, 0, 3)]
        if dead:  # the others get a moment to notice and exit by themselves
            self.crashed_at = self.crashed_at or now
            if now - self.crashed_at > 5.0:
                q = dead[0]
                return (f"rank {q} died ({_describe_exit(codes[q])}) during {phase[q]!r}; "
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


def watch(procs, logs, d, case_limit=lambda case: CASE_TIMEOUT,
          teardown_limit: float | None = None) -> Run:
    """Waits for a spawned group whose rank R writes its events to
    d/rank<R>.jsonl and its output to logs[R]; kills it on a hang or a crash
    (see the module docstring) and returns what it left behind."""
    w = _Watch(procs, logs, d, case_limit,
               teardown_timeout() if teardown_limit is None else teardown_limit)
    while True:
        w.read_new()
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        why = w.why_kill_now(codes, time.monotonic())
        if why:
            w.kill_all(why)
            break
        time.sleep(0.05)
    w.read_new()
    w.run.codes = [p.returncode for p in procs]
    return w.run


# ----------------------------------------------------------------------
# verdicts from a run's events (shared by both runners)
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


def unfinished(run: Run, name: str) -> Result:
    """The verdict on a case that some ranks never finished (hang or crash)."""
    evs = [run.find(q, "result", name) for q in range(run.world)]
    missing = [q for q in range(run.world) if evs[q] is None]
    done = {q: ev["status"] for q, ev in enumerate(evs) if ev is not None}
    how = run.killed or "; ".join(f"rank {q}: {_describe_exit(run.codes[q])} in "
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
        exit_ = _describe_exit(run.codes[q])
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


# ----------------------------------------------------------------------
# the specs of tests/_registry.py
# ----------------------------------------------------------------------


class Runner:
    """Runs each spec at most once per session and caches the per-case results.

    selected: spec -> the case names to run (default: SELECTED, what pytest
    selected; a spec missing there runs all its cases)."""

    def __init__(self, selected: dict[str, set[str]] | None = None) -> None:
        self.selected = SELECTED if selected is None else selected
        self.results: dict[str, dict[str, Result]] = {}
        self.timings: dict[str, tuple[float, int, int]] = {}  # spec -> (s, cases, attempts)
        self.workdir = tempfile.mkdtemp(prefix="tccomm-tests-")
        self.keep = False  # set when a test fails: its logs stay for a look
        self._store = None

    def store(self):
        if self._store is None:
            import datetime

            import torch.distributed as dist
            self._store = dist.TCPStore("127.0.0.1", 0, None, True,
                                        timeout=datetime.timedelta(seconds=CASE_TIMEOUT * 2),
                                        wait_for_workers=False)
        return self._store

    def close(self) -> None:
        self._store = None
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def result(self, spec_name: str, case_name: str) -> Result:
        if spec_name not in self.results:
            spec = _registry.SPEC_BY_NAME[spec_name]
            wanted = self.selected.get(spec_name)
            names = [c.name for c in _registry.cases_for(spec)
                     if wanted is None or c.name in wanted]
            if case_name not in names and case_name != TEARDOWN:
                names.append(case_name)
            t0 = time.monotonic()
            self.results[spec_name], attempts = self._run_spec(spec, names)
            self.timings[spec_name] = (time.monotonic() - t0, len(names), attempts)
        return self.results[spec_name].get(
            case_name, Result("fail", "harness: no result recorded for this case"))

    # ------------------------------------------------------------------
    def _run_spec(self, spec: _registry.Spec, names: list[str]):
        results: dict[str, Result] = {}
        remaining = list(names)
        t_start = time.monotonic()
        attempt = 0
        # Until every case ran and one run got through a teardown (a run that
        # ended in a restart or a kill did not: then one with no cases does).
        while remaining or TEARDOWN not in results:
            if attempt >= MAX_ATTEMPTS or time.monotonic() - t_start > SPEC_BUDGET:
                why = (f"{attempt} group restarts" if attempt >= MAX_ATTEMPTS
                       else f"the spec's time budget of {SPEC_BUDGET:.0f} s")
                for n in remaining + [TEARDOWN]:
                    results[n] = Result("fail", f"not run: {why} used up by earlier "
                                                f"failures in {spec.name}")
                break
            attempt += 1
            remaining = self._attempt(spec, remaining, attempt, results)
        return results, attempt

    def _spawn(self, spec, names, attempt) -> Run:
        """Starts the ranks of `spec` on `names` and watches them to the end."""
        d = os.path.join(self.workdir, spec.name, f"attempt{attempt}")
        os.makedirs(d, exist_ok=True)
        master_port, init_port = free_port(), free_port()
        reinit_port, reinit_port2 = free_port(), free_port()
        init_method = {"env": "env://",
                       "tcp": f"tcp://127.0.0.1:{init_port}",
                       "file": "file://" + os.path.join(d, "filestore")}[spec.init]
        cfg = {
            "backend": BACKEND, "world": spec.world, "transport": spec.transport,
            "init": spec.init, "init_method": init_method, "pg_timeout": spec.pg_timeout,
            "case_timeout": CASE_TIMEOUT, "results_dir": d, "cases": names,
            "store_port": self.store().port,
            "store_prefix": f"{spec.name}/attempt{attempt}",
            "reinit_port": reinit_port, "reinit_port2": reinit_port2,
        }
        cfg_path = os.path.join(d, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        procs, logs = [], []
        for rank in range(spec.world):
            env = dict(os.environ)
            env.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(spec.world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(master_port), OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning")
            if spec.transport == "tcp":
                env["TCCOMM_TRANSPORT"] = "tcp"
            else:
                env.pop("TCCOMM_TRANSPORT", None)
            log = os.path.join(d, f"rank{rank}.log")
            logs.append(log)
            with open(log, "w") as lf:
                procs.append(subprocess.Popen(
                    [sys.executable, WORKER, cfg_path, str(rank)], env=env, cwd=HERE,
                    stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        limit = lambda case: max(CASE_TIMEOUT, _hang_limit(case))  # noqa: E731
        return watch(procs, logs, d, case_limit=limit)

    def _attempt(self, spec, names, attempt, results) -> list[str]:
        """Runs `names` in one spawned group; returns the cases still to run."""
        run = self._spawn(spec, names, attempt)
        failed_init = init_failure(run, spec.name)
        if failed_init:
            for n in names + [TEARDOWN]:
                results[n] = Result("fail", failed_init)
            return []
        for i, name in enumerate(names):
            evs = [run.find(q, "result", name) for q in range(spec.world)]
            if all(ev is not None for ev in evs):
                results[name] = merge(evs)
                if self._broke_group(run, name, results[name]):
                    return names[i + 1:]
                continue
            started = [run.find(q, "start", name) for q in range(spec.world)]
            if i > 0 and all(ev is None for ev in started):
                # It never started: the group broke in the sync after the previous case.
                prev = results[names[i - 1]]
                prev.status = "fail"
                prev.msg = ((prev.msg + "\n" if prev.msg else "") + "the group hung or died "
                            "right after this case (in the harness's post-case sync/health "
                            f"check): {run.killed}\n{run.tails(range(spec.world))}")
                return names[i:]
            results[name] = unfinished(run, name)
            return names[i + 1:]
        results[TEARDOWN] = teardown_result(run, spec.name)
        return []

    @staticmethod
    def _broke_group(run: Run, name: str, res: Result) -> bool:
        """Whether the ranks found the group unusable after `name` (they then
        exit for a restart); `res` then fails saying so."""
        healths = [run.find(q, "health", name) for q in range(run.world)]
        broken = [(q, h["msg"]) for q, h in enumerate(healths) if h is not None and not h["ok"]]
        if not broken:
            return False
        if res.status != "fail":
            res.status, res.msg = "fail", "the group was unusable after this case"
        res.msg += ("\n[harness] group restarted after this case: "
                    + "; ".join(f"rank {q}: {m}" for q, m in broken))
        return True
