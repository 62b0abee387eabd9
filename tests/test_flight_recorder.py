"""tccomm's flight recorder, read by torch's own analyzer.

With TORCH_FR_BUFFER_SIZE set, every tccomm group keeps a ring of its last
ops and the process dumps them, in the format of torch's flight recorder, to
TORCH_FR_DUMP_TEMP_FILE<rank> on its first failed op (before the error
reaches the program), on TCCOMM_FR_DUMP_SIGNAL and on demand. Checked here:
  * skip: 3 ranks, rank 1 skips an all_reduce and goes on to the next
    collective. Every rank's error arrives after its dump is on disk, and
    `python -m torch.distributed.flight_recorder.fr_trace` on the three dumps
    names rank 1 as the culprit of collective 5 (a type mismatch). The dumps
    themselves: names, sequence numbers, sizes, dtypes, states, stacks.
  * stuck: 2 ranks, rank 1 never joins an all_reduce; rank 0 times out and
    dumps, rank 1 dumps on demand, and the analyzer reports rank 1 missing
    from that collective.
  * contents: the signal dump of a rank that ran point-to-point ops (with a
    receive from any source), two groups and more ops than the ring holds:
    each group keeps exactly its last N, named as torch's analyzer expects.
  * off: without TORCH_FR_BUFFER_SIZE nothing is recorded or written.

Ranks are spawned and watched by tests/_group.py; this file is also the
rank's program (python tests/test_flight_recorder.py SCENARIO OUT_DIR).
"""

import glob
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TIMEOUT = 120.0
RING = 8  # TORCH_FR_BUFFER_SIZE of the contents scenario


def dump_path(out_dir, rank):
    return os.path.join(out_dir, "fr", f"trace_{rank}")


def load(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def wait_for(path, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written within {seconds} s"
        time.sleep(0.05)


# ---- the ranks' programs -----------------------------------------------------

def good_steps(dist, torch, rank, world):
    """Four collectives every rank issues, each result checked exactly."""
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world * (world + 1) // 2))), t
    dist.broadcast(t, 0)
    out = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(out, torch.full((4,), float(rank)))
    assert all(torch.equal(o, torch.full((4,), float(r))) for r, o in enumerate(out)), out
    rs = torch.zeros(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.int64))
    assert torch.equal(rs, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.int64) * world), rs


def scenario_skip(rank, world, out_dir):
    import datetime

    import torch
    import torch.distributed as dist

    import torchcomm_backend  # noqa: F401

    dist.init_process_group("tccomm", timeout=datetime.timedelta(seconds=20))
    good_steps(dist, torch, rank, world)
    t = torch.ones(3)
    try:
        if rank != 1:  # rank 1 skips this one
            dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.zeros(3 * world), t)
    except dist.DistBackendError as e:
        assert "different collectives" in str(e), e
        # The dump is on disk before the program sees the error.
        assert os.path.exists(dump_path(out_dir, rank)), f"no dump when the error was raised: {e}"
    else:
        raise AssertionError("the skipped collective went unnoticed")


def scenario_stuck(rank, world, out_dir):
    import datetime

    import torch
    import torch.distributed as dist

    import torchcomm_backend

    dist.init_process_group("tccomm", timeout=datetime.timedelta(seconds=2))
    good_steps(dist, torch, rank, world)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(5))
        except dist.DistBackendError as e:
            assert "timed out" in str(e), e
            assert os.path.exists(dump_path(out_dir, rank)), f"no dump when the error was raised: {e}"
        else:
            raise AssertionError("an all_reduce without rank 1 completed")
    else:
        # Stays out of the all_reduce; dumps once rank 0 has (as an operator
        # would, on a hung job).
        wait_for(dump_path(out_dir, 0))
        written = torchcomm_backend.dump_flight_recorder()
        assert written == dump_path(out_dir, rank), written


def scenario_contents(rank, world, out_dir):
    import torch
    import torch.distributed as dist

    import torchcomm_backend  # noqa: F401

    dist.init_process_group("tccomm")
    pair = dist.new_group([0, 1], group_desc="pair")
    t = torch.arange(6, dtype=torch.int32)
    # More ops than the ring holds on the world group: it keeps the last RING.
    for _ in range(RING + 5):
        dist.all_reduce(t)
    dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world))
    if rank == 0:
        dist.send(torch.ones(3, dtype=torch.float64), 1)
        dist.send(torch.ones(2), 1, group=pair)
    else:
        dist.recv(torch.zeros(3, dtype=torch.float64), 0)
        dist.recv(torch.zeros(2), group=pair)  # from any source
    dist.barrier(group=pair)
    os.kill(os.getpid(), signal.SIGUSR2)  # (USR1 dumps the stacks: tests/_rank.py)
    wait_for(dump_path(out_dir, rank))


def scenario_off(rank, world, out_dir):
    import torch
    import torch.distributed as dist

    import torchcomm_backend

    dist.init_process_group("tccomm")
    dist.all_reduce(torch.ones(2))
    assert torchcomm_backend.dump_flight_recorder() is None
    assert not os.path.exists(os.path.join(out_dir, "fr")), os.listdir(out_dir)


def worker_main(scenario, out_dir):
    import _rank

    _rank.run_one_scenario(out_dir, scenario,
                           lambda rank, world: globals()[f"scenario_{scenario}"](rank, world, out_dir))


# ---- pytest ------------------------------------------------------------------

def run_job(scenario, world, extra_env):
    import _group

    out_dir = tempfile.mkdtemp(prefix=f"tccomm-fr-{scenario}-")
    if extra_env is not None:
        os.makedirs(os.path.join(out_dir, "fr"))
    port = _group.free_port()

    def env(rank):
        e = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE", "TCCOMM_FR"))}
        e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        if extra_env is not None:
            e.update(TORCH_FR_DUMP_TEMP_FILE=os.path.join(out_dir, "fr", "trace_"), **extra_env)
        return e

    _group.run_scenario_or_fail(out_dir, world, lambda rank: [os.path.abspath(__file__), scenario, out_dir], env,
                                scenario, WORKER_TIMEOUT)
    return out_dir


def analyze(out_dir):
    """torch's analyzer on the dumps; its report (it logs to stdout)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                        os.path.join(out_dir, "fr")], capture_output=True, text=True, timeout=120)
    report = r.stdout + r.stderr
    assert r.returncode == 0, f"fr_trace failed ({r.returncode}):\n{report}"
    return report


def section(report, heading):
    """The analyzer's paragraph that starts with `heading`."""
    start = report.find(heading)
    assert start >= 0, f"no '{heading}' in the analyzer's report:\n{report}"
    end = report.find("\n\n", start)
    return report[start:end if end > 0 else None]


def test_skipped_collective_is_named_by_torch_analyzer():
    out_dir = run_job("skip", 3, {"TORCH_FR_BUFFER_SIZE": "64"})
    report = analyze(out_dir)
    culprit = section(report, "Collective sequence number: 5 has errors")
    assert "Culprit rank 1" in culprit and "COLLECTIVE_TYPE_MISMATCH" in culprit, culprit
    assert "collective: gloo:all_reduce" in culprit and "found collective type: '_all_gather_base'" in culprit, culprit
    assert "scenario_skip" in culprit, f"no stack naming the program in:\n{culprit}"

    dumps = {r: load(dump_path(out_dir, r)) for r in range(3)}
    for rank, dump in dumps.items():
        assert dump["version"] == "2.10" and dump["comm_lib_version"].startswith("tccomm"), dump.keys()
        assert dump["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}, dump["pg_config"]
        entries = dump["entries"]
        names = [e["profiling_name"] for e in entries]
        last = ["gloo:all_reduce"] if rank != 1 else ["gloo:_all_gather_base"]
        assert names == ["gloo:all_reduce", "gloo:broadcast", "gloo:all_gather", "gloo:_reduce_scatter_base"] + last, \
            f"rank {rank}: {names}"
        assert [e["collective_seq_id"] for e in entries] == [1, 2, 3, 4, 5], entries
        assert [e["record_id"] for e in entries] == sorted(e["record_id"] for e in entries)
        done, failed = entries[:4], entries[4]
        for e in done:
            assert e["state"] == "completed" and e["retired"], e
            assert e["time_created_ns"] <= e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"], e
            assert e["process_group"] == ("0", "default_pg") and not e["is_p2p"] and e["timeout_ms"] == 20000, e
            assert any(f["name"] == "good_steps" for f in e["frames"]), e["frames"]
        assert done[2]["input_sizes"] == [[4]] and done[2]["output_sizes"] == [[3, 4]], done[2]
        assert done[3]["input_sizes"] == [[6]] and done[3]["output_sizes"] == [[2]], done[3]
        assert done[3]["input_dtypes"] == ["Long"] and done[0]["output_dtypes"] == ["Float"], done
        # The op that failed had started (it reached the ranks' exchange) and
        # is over, without completing.
        assert failed["state"] == "started" and failed["retired"], failed
        assert failed["time_discovered_completed_ns"] is None, failed
        assert failed["input_sizes"] == [[3]], failed
    shutil.rmtree(out_dir, ignore_errors=True)


def test_rank_that_never_joins_is_reported_missing():
    out_dir = run_job("stuck", 2, {"TORCH_FR_BUFFER_SIZE": "64"})
    report = analyze(out_dir)
    missing = section(report, "Not all ranks joining collective, sequence number: 5")
    assert "missing ranks: {1}" in missing and "collective: gloo:all_reduce" in missing, missing
    assert "input sizes: [[5]]" in missing, missing
    stuck = load(dump_path(out_dir, 0))["entries"][-1]
    assert stuck["collective_seq_id"] == 5 and stuck["state"] == "started" and stuck["retired"], stuck
    assert stuck["timeout_ms"] == 2000, stuck
    assert load(dump_path(out_dir, 1))["entries"][-1]["collective_seq_id"] == 4
    shutil.rmtree(out_dir, ignore_errors=True)


def test_signal_dump_holds_each_groups_last_ops():
    out_dir = run_job("contents", 2, {"TORCH_FR_BUFFER_SIZE": str(RING), "TCCOMM_FR_DUMP_SIGNAL": "SIGUSR2"})
    for rank in range(2):
        dump = load(dump_path(out_dir, rank))
        config = dump["pg_config"]
        pair = next(name for name, c in config.items() if c["desc"] == "pair")
        assert config[pair]["ranks"] == "[0, 1]" and config["0"]["ranks"] == "[0, 1]", config
        world_ops = [e for e in dump["entries"] if e["process_group"][0] == "0"]
        pair_ops = [e for e in dump["entries"] if e["process_group"][0] == pair]
        # The world group issued RING + 5 all_reduces, an all_to_all and a
        # send/recv: its ring holds the last RING.
        assert len(world_ops) == RING, [e["profiling_name"] for e in world_ops]
        kept_reduces = list(range(RING + 6 - (RING - 2), RING + 6))
        assert [e["collective_seq_id"] for e in world_ops] == kept_reduces + [RING + 6] * 2, world_ops
        assert world_ops[-2]["profiling_name"] == "gloo:all_to_all", world_ops[-2]
        assert world_ops[-2]["input_sizes"] == [[4]] and world_ops[-2]["output_sizes"] == [[4]]
        p2p = world_ops[-1]
        name = "gloo:send 0->1" if rank == 0 else "gloo:recv 1<-0"
        assert p2p["profiling_name"] == name and p2p["is_p2p"] and p2p["p2p_seq_id"] == 1, p2p
        assert p2p["collective_seq_id"] == RING + 6 and p2p["input_dtypes"] == ["Double"], p2p
        # The pair group's ring is its own: a send or a receive from any
        # source (named by the rank it matched), then its barrier.
        names = [e["profiling_name"] for e in pair_ops]
        assert names == [("gloo:send 0->1" if rank == 0 else "gloo:recv 1<-0"), "gloo:barrier"], names
        assert all(e["state"] == "completed" for e in dump["entries"]), dump["entries"]
        assert pair_ops[1]["input_sizes"] == [] and pair_ops[1]["collective_seq_id"] == 1, pair_ops[1]
        ids = [e["record_id"] for e in dump["entries"]]
        assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    shutil.rmtree(out_dir, ignore_errors=True)


def test_recorder_is_off_unless_asked_for():
    out_dir = run_job("off", 2, None)
    assert not glob.glob(os.path.join(out_dir, "fr*")), os.listdir(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    worker_main(sys.argv[1], sys.argv[2])
