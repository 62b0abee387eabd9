"""One rank of a TorchComm-API test group: python _tc_worker.py CONFIG.json RANK

Config: world, bootstrap ("file": FileStore, "tcp": the parent's TCPStore,
"env": no store, the torchrun variables), abort (None: from the
environment), mode ("cases": run _tc_cases in order, or only those listed
under "cases"; "abort": rank 0 times out with the aborting policy), out_dir.
Reports events to the parent (tests/_rank.py): creating the communicator is
the "<init>" case; after the last case "done", comm.finalize(), then main
returns and the interpreter exits normally, which the parent judges too.
"""

import datetime
import json
import os
import sys
import time
import traceback

import _rank

_rank.enable_stack_dumps()


def make_comm(cfg, rank):
    import torch
    import torch.distributed as dist

    import torchcomm_backend as tc

    world = cfg["world"]
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    store = None
    if cfg["bootstrap"] == "file":
        store = dist.FileStore(cfg["store_path"], world)
    elif cfg["bootstrap"] == "tcp":
        store = dist.TCPStore("127.0.0.1", cfg["store_port"], world, False,
                              timeout=datetime.timedelta(seconds=60))
    else:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(cfg["master_port"])
    # Short enough that a case failing on one rank cannot stall the others long.
    kwargs = {"timeout": datetime.timedelta(seconds=60)}
    if cfg.get("abort") is not None:
        kwargs["abort_process_on_timeout_or_error"] = cfg["abort"]
    return tc.new_comm("tccomm", torch.device("cpu"), store=store, name="tests", **kwargs)


def run_case(fn, comm, rank, world):
    """(status, msg) of one case on this rank."""
    import _tc_cases

    try:
        fn(comm, rank, world)
    except _tc_cases.Skip as e:
        return "skip", str(e)
    except Exception as e:  # noqa: BLE001
        return "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    return "pass", ""


def main():
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    events = _rank.Events(cfg["out_dir"], rank)
    import torch

    torch.set_num_threads(1)
    if cfg["mode"] == "abort":
        comm = make_comm(cfg, rank)
        import torchcomm_backend as tc

        if rank == 0:
            comm.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False, timeout=1)
            print("all_reduce returned: the process was not aborted", flush=True)
            return 1
        time.sleep(120)  # stays out of the all_reduce until the parent kills it
        return 0

    events.emit(event="start", case="<init>", t=time.time())
    try:
        comm = make_comm(cfg, rank)
    except Exception as e:  # noqa: BLE001
        events.emit(event="result", case="<init>", status="error",
                    msg=f"new_comm failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        return 4
    events.emit(event="result", case="<init>", status="pass", msg="")

    import _tc_cases

    wanted = cfg.get("cases")
    for name, fn in _tc_cases.CASES:
        if wanted is not None and name not in wanted:
            continue
        events.emit(event="start", case=name, t=time.time())
        t0 = time.monotonic()
        status, msg = _rank.verdict(rank, *run_case(fn, comm, rank, cfg["world"]))
        events.emit(event="result", case=name, status=status, msg=msg,
                    seconds=round(time.monotonic() - t0, 3))
    _rank.finish(events, rank, [("comm.finalize", comm.finalize)])
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        _rank.leave_now(code)
    # 0: the interpreter exits normally; the parent judges that exit too.
