"""What torch's profiler records of tccomm ops.

Every c10d op on a tccomm group shows in a torch.profiler trace as
  * a "tccomm:<op>" span (as gloo's "gloo:<op>") covering the op from issue
    to completion, and
  * a record_param_comms event carrying the metadata the nccl backend
    attaches: collective name (nccl's names), process group name,
    description and ranks, this rank, group size, sequence number (per group,
    collectives and point-to-point apart), element counts in and out, split
    sizes, dtype,
checked here from the exported Chrome trace (what HTA and torch's own trace
tools read) against values computed from the calls themselves, at 2 ranks,
on the default group and on a second group.

Ranks are spawned and watched by tests/_group.py; this file is also the
rank's program (python tests/test_profiler.py SCENARIO OUT_DIR).
"""

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TIMEOUT = 120.0


# ---- the rank's program ------------------------------------------------------

def issue_every_op(dist, torch, rank, world, group=None):
    """Issues every c10d op once on `group`; returns what each should record,
    in issue order: (span name, nccl's collective name, in elements, out
    elements, dtype name, in splits, out splits, is p2p)."""
    n = 6
    f = torch.full((n,), float(rank + 1))
    expected = []

    def add(span, coll, nin, nout, dtype="Float", ins=(), outs=(), p2p=False):
        expected.append((span, coll, nin, nout, dtype, list(ins), list(outs), p2p))

    dist.all_reduce(f, group=group)
    add("tccomm:all_reduce", "allreduce", n, n)
    dist.broadcast(f, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    add("tccomm:broadcast", "broadcast", n, n)
    dist.reduce(f, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    add("tccomm:reduce", "reduce", n, n)
    out = [torch.zeros(n) for _ in range(world)]
    dist.all_gather(out, f, group=group)
    add("tccomm:all_gather", "all_gather", n, n * world)
    flat = torch.zeros(n * world, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, f.double(), group=group)
    add("tccomm:all_gather_into_tensor", "_allgather_base", n, n * world, "Double")
    dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(n * world), group=group)
    add("tccomm:reduce_scatter_tensor", "_reduce_scatter_base", n * world, n)
    dist.reduce_scatter(torch.zeros(n), [torch.ones(n) for _ in range(world)], group=group)
    add("tccomm:reduce_scatter", "reduce_scatter", n * world, n)
    # all_to_all_single with uneven splits: rank r sends r+1+j rows to rank j.
    ins = [rank + 1 + j for j in range(world)]
    outs = [q + 1 + rank for q in range(world)]
    dist.all_to_all_single(torch.zeros(sum(outs), dtype=torch.int32), torch.ones(sum(ins), dtype=torch.int32),
                           output_split_sizes=outs, input_split_sizes=ins, group=group)
    add("tccomm:all_to_all", "all_to_allv", sum(ins), sum(outs), "Int", ins, outs)
    dist.all_to_all([torch.zeros(2) for _ in range(world)], [torch.ones(2) for _ in range(world)], group=group)
    add("tccomm:all_to_all", "all_to_all", 2 * world, 2 * world)
    dist.barrier(group=group)
    add("tccomm:barrier", "barrier", 0, 0, None)
    peer_local = (dist.get_group_rank(group, rank) if group else rank) ^ 1
    peer = dist.get_global_rank(group, peer_local) if group else peer_local
    t = torch.arange(5, dtype=torch.int64)
    if rank % 2 == 0:
        dist.send(t, peer, group=group)
        add("tccomm:send", "send", 5, 5, "Long", p2p=True)
    else:
        dist.recv(t, peer, group=group)
        add("tccomm:recv", "recv", 5, 5, "Long", p2p=True)
    return expected


def as_list(value):
    """A list the trace holds as a JSON string ("[1, 2]")."""
    return json.loads(value) if isinstance(value, str) else list(value or [])


def peer_of(rank):
    """The group rank of a send/recv's other side (issue_every_op pairs 0-1)."""
    return rank ^ 1


def check_trace(trace_path, expected, rank, world, group_ranks, group_desc):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("tccomm:")]
    params = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "record_param_comms"),
                    key=lambda e: e["ts"])
    assert len(params) == len(expected), \
        f"{len(params)} record_param_comms events for {len(expected)} ops: {[p.get('args') for p in params]}"
    span_names = [e["name"] for e in spans]
    coll_seq = p2p_seq = 0
    for (span, coll, nin, nout, dtype, ins, outs, p2p), ev in zip(expected, params):
        a = ev.get("args", {})
        what = f"{coll} on rank {rank}"
        assert span in span_names, f"{what}: no '{span}' span among {sorted(set(span_names))}"
        assert a.get("Collective name") == coll, f"{what}: collective name {a.get('Collective name')!r}"
        assert a.get("In msg nelems") == nin, f"{what}: in nelems {a.get('In msg nelems')} != {nin}"
        assert a.get("Out msg nelems") == nout, f"{what}: out nelems {a.get('Out msg nelems')} != {nout}"
        if dtype is not None:
            assert a.get("dtype") == dtype, f"{what}: dtype {a.get('dtype')!r} != {dtype!r}"
        assert as_list(a.get("In split size")) == ins, f"{what}: in splits {a.get('In split size')} != {ins}"
        assert as_list(a.get("Out split size")) == outs, f"{what}: out splits {a.get('Out split size')} != {outs}"
        assert a.get("Group size") == len(group_ranks), f"{what}: group size {a.get('Group size')}"
        assert a.get("Process Group Description") == group_desc, \
            f"{what}: group description {a.get('Process Group Description')!r} != {group_desc!r}"
        assert a.get("Process Group Name"), f"{what}: no process group name in {a}"
        got_ranks = as_list(a.get("Process Group Ranks"))
        assert got_ranks == list(group_ranks), f"{what}: group ranks {got_ranks} != {group_ranks}"
        assert a.get("Rank") == (peer_of(rank) if p2p else group_ranks.index(rank)), f"{what}: rank field {a}"
        if p2p:
            p2p_seq += 1
            seq = p2p_seq
        else:
            coll_seq += 1
            seq = coll_seq
        assert a.get("Seq") == seq, f"{what}: sequence number {a.get('Seq')} != {seq}"
    # One span per op, in issue order, each ending no earlier than its
    # op was issued.
    spans.sort(key=lambda e: e["ts"])
    assert [e["name"] for e in spans] == [x[0] for x in expected], \
        f"rank {rank}: spans {[e['name'] for e in spans]}, expected {[x[0] for x in expected]}"
    for span, ev in zip(spans, params):
        assert span["ts"] + span["dur"] >= ev["ts"], f"rank {rank}: {span['name']} ended before its op was issued"


def scenario_metadata(rank, world, out_dir):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import torchcomm_backend  # noqa: F401  (registers the backend)

    dist.init_process_group("tccomm")
    # A second group of its own name and description, numbered from 1 again.
    # (Its members in order: torch's metadata lists ranks only when they
    # are evenly spaced upwards.)
    sub = dist.new_group(list(range(world)), group_desc="pair")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        expected = issue_every_op(dist, torch, rank, world)
    path = os.path.join(out_dir, f"world.{rank}.json")
    prof.export_chrome_trace(path)
    check_trace(path, expected, rank, world, list(range(world)), "default_pg")

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        expected = issue_every_op(dist, torch, rank, world, group=sub)
    path = os.path.join(out_dir, f"sub.{rank}.json")
    prof.export_chrome_trace(path)
    check_trace(path, expected, rank, world, list(range(world)), "pair")

    # Outside a profiler the ops still work.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world))), t
    dist.destroy_process_group()


def worker_main(scenario, out_dir):
    import _rank

    _rank.run_one_scenario(out_dir, scenario,
                           lambda rank, world: globals()[f"scenario_{scenario}"](rank, world, out_dir))


# ---- pytest ------------------------------------------------------------------

def test_every_op_records_spans_and_param_comms_metadata():
    import _group

    world = 2
    outdir = tempfile.mkdtemp(prefix="tccomm-profiler-")
    port = _group.free_port()

    def env(rank):
        return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")

    _group.run_scenario_or_fail(outdir, world, lambda rank: [os.path.abspath(__file__), "metadata", outdir], env,
                                "metadata", WORKER_TIMEOUT)
    shutil.rmtree(outdir, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    worker_main(sys.argv[1], sys.argv[2])
