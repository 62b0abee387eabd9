"""torch.distributed's tensor forms of all_gather and reduce_scatter under
whichever name this torch has (the newer *_single or the older one)."""

import torch.distributed as dist


def reduce_scatter_tensor(out, inp, op, group=None, async_op=False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group, async_op=async_op)


def all_gather_tensor(out, inp, group=None, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)
