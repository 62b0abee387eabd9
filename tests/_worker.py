"""One rank of a spawned test group: python tests/_worker.py CONFIG.json RANK

Runs the cases named in the config in order and reports events to the parent
(tests/_rank.py: start and result per case, then "done" and the teardown
steps).

After every case the ranks meet in the harness's own TCPStore (not the
backend under test). If any rank hit an unexpected exception, all ranks run
a small all_reduce to check the group; if that fails, they exit with code 3
and the parent restarts the group after that case.

After the last case: "done", destroy_process_group(), then main returns and
the interpreter exits normally (atexit handlers, finalization, the
extension's destructors); the parent fails the spec's teardown if that
crashes, hangs or exits nonzero.

Exit codes: 0 all cases ran, 3 restart requested, 4 init_process_group failed.
"""

import datetime
import json
import os
import sys
import time
import traceback

import _rank

_rank.enable_stack_dumps()

EXIT_RESTART = 3
EXIT_INIT_FAILED = 4


def main() -> int:
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    world = cfg["world"]
    events = _rank.Events(cfg["results_dir"], rank)
    emit = events.emit

    emit(event="start", case="<init>", t=time.time())
    import torch
    import torch.distributed as dist

    import _ctx
    import _registry
    import _resources

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", cfg["store_port"], world, False,
                          timeout=datetime.timedelta(seconds=cfg["case_timeout"] * 2))
    prefix = cfg["store_prefix"]

    def meet(name: str, value: str) -> list[str]:
        """All ranks publish `value` under `name` and get everyone's values."""
        store.set(f"{prefix}/{name}/v{rank}", value)
        if store.add(f"{prefix}/{name}/n", 1) == world:
            store.set(f"{prefix}/{name}/done", "1")
        store.wait([f"{prefix}/{name}/done"])
        keys = [f"{prefix}/{name}/v{q}" for q in range(world)]
        return [v.decode() for v in store.multi_get(keys)]

    baseline = {"sockets": _resources.socket_count()}
    meet("<pre-init>", "ok")  # start init together: the group timeout may be short
    try:
        if cfg["backend"] == "tccomm":
            import torchcomm_backend  # noqa: F401  (registers tccomm)
        timeout = datetime.timedelta(seconds=cfg["pg_timeout"])
        if cfg["init"] == "env":
            dist.init_process_group(cfg["backend"], timeout=timeout)
        else:
            dist.init_process_group(cfg["backend"], init_method=cfg["init_method"],
                                    rank=rank, world_size=world, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        emit(event="result", case="<init>", status="error",
             msg=f"init_process_group({cfg['backend']!r}, init {cfg['init']}) failed: "
                 f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        return EXIT_INIT_FAILED
    emit(event="result", case="<init>", status="pass", msg="")

    ctx = _ctx.Ctx(cfg, rank, store, baseline)
    registry = _registry.all_cases()
    for name in cfg["cases"]:
        case = registry[name]
        ctx.case = name
        ctx.digest_value = None
        emit(event="start", case=name, t=time.time())
        status, msg = "pass", ""
        try:
            if cfg["backend"] == "gloo" and case.gloo_skip:
                raise _registry.Skip(case.gloo_skip)
            case.fn(ctx, **case.params)
        except _registry.Skip as e:
            status, msg = "skip", str(e)
        except AssertionError as e:
            status, msg = "fail", str(e) or traceback.format_exc(limit=-2)
        except Exception as e:  # noqa: BLE001
            status = "error"
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
        status, msg = _rank.verdict(rank, status, msg)
        emit(event="result", case=name, status=status, msg=msg, digest=ctx.digest_value)
        statuses = meet(f"{name}/status", status)
        if "error" in statuses and case.order < 99 and dist.is_initialized():
            ok, hmsg = True, ""
            try:
                ctx.check_usable(what=f"after case {name}")
            except Exception as e:  # noqa: BLE001
                ok, hmsg = False, str(e)
            emit(event="health", case=name, ok=ok, msg=hmsg)
            if "0" in meet(f"{name}/health", "1" if ok else "0"):
                return EXIT_RESTART

    def destroy():
        if dist.is_initialized():  # a case may have destroyed it already
            dist.destroy_process_group()

    _rank.finish(events, rank, [("destroy_process_group", destroy)])
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        _rank.leave_now(code)
    # 0: the interpreter exits normally; the parent judges that exit too.
