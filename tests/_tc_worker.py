"""One rank of a TorchComm-API test group: python _tc_worker.py CONFIG.json RANK

Config: world, bootstrap ("file": FileStore, "tcp": the parent's TCPStore,
"env": no store, the torchrun variables), abort (None: from the
environment), mode ("cases": run _tc_cases in order; "abort": rank 0 times
out with the aborting policy), out_dir. Appends one JSON line per case to
OUT_DIR/rank<R>.jsonl, flushed at once so the parent sees how far it got.
"""

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback

faulthandler.enable()
faulthandler.register(signal.SIGUSR1, all_threads=True)


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


def main():
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    out = open(os.path.join(cfg["out_dir"], f"rank{rank}.jsonl"), "a", buffering=1)
    import torch

    torch.set_num_threads(1)
    comm = make_comm(cfg, rank)
    if cfg["mode"] == "abort":
        import torchcomm_backend as tc

        if rank == 0:
            comm.all_reduce(torch.ones(2), tc.ReduceOp.SUM, async_op=False, timeout=1)
            print("all_reduce returned: the process was not aborted", flush=True)
            return 1
        time.sleep(120)  # stays out of the all_reduce until the parent kills it
        return 0

    import _tc_cases

    for name, fn in _tc_cases.CASES:
        status, msg, t0 = "pass", "", time.monotonic()
        try:
            fn(comm, rank, cfg["world"])
        except _tc_cases.Skip as e:
            status, msg = "skip", str(e)
        except Exception as e:  # noqa: BLE001
            status, msg = "fail", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
        out.write(json.dumps({"case": name, "status": status, "msg": msg,
                              "seconds": round(time.monotonic() - t0, 3)}) + "\n")
    comm.finalize()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
