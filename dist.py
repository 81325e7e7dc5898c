"""
torchrun's ranks for grpo, checkpoint and batching: who is who, sums (and logged stats: stat_op) over them, FSDP2 units.
Under `torchrun --nproc_per_node=N grpo.py` every rank holds whole groups of the generation batch; batching counts the
loss normalizers over the ranks (global_sum), so the SUM over ranks of the ranks' gradients is the one-process gradient
of the whole batch. Plain `python grpo.py` sets no RANK: rank 0 of 1, and every helper here is the identity or a no-op.
"""
import contextlib
import math
import os
import sys

import torch


def setup_distributed(cfg, dev):
    """the process group from torchrun's environment; returns (rank, world size, this rank's device)"""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, dev
    import datetime
    import torch.distributed as dist
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)  # one GPU per process
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=cfg.dist_timeout_minutes))  # no endless hang
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints; errors (stderr) still show from every rank
    return rank, world, dev


def distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank():
    return torch.distributed.get_rank() if distributed() else 0


def world_size():
    return torch.distributed.get_world_size() if distributed() else 1


def fsdp_modules(model):
    """the FSDP2 units of a model sharded by grpo.shard_model (decoder layers, then the root); [] for a plain model"""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model):
    """FSDP2: the full weights on every rank for generation (one all-gather per unit, not one per decode step),
    resharded on exit; generation sets FSDP's forward hooks aside meanwhile (rollout.sampling), so the plain HF modules
    run on them. A no-op for a plain model. Every rank must enter it together (the all-gathers are collectives)."""
    units = fsdp_modules(model)
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()


def global_sum(x, op="sum"):
    """x summed (or max / min) over the ranks of a torchrun job; x itself in one process"""
    if distributed():
        x = x.clone()
        torch.distributed.all_reduce(x, op=getattr(torch.distributed.ReduceOp, op.upper()))
    return x


def rank0_value(x):
    """rank 0's x on every rank (the others wait here until rank 0 has it); x in one process"""
    if not distributed():
        return x
    box = [x]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks(x):
    """[x of rank 0, x of rank 1, ...] for a picklable x; [x] in one process"""
    if not distributed():
        return [x]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def stat_op(key):
    """how a logged stat combines over micro-batches, updates, ranks (a sum: of weighted values, normalized last)"""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "sum"


def global_stats(totals, dev):
    """batching.update_step's stats over all ranks, by stat_op (a rank with no key joins with the neutral value)"""
    keys = sorted({k for ks in all_ranks(sorted(totals)) for k in ks})
    out = {}
    for op, neutral in (("max", -math.inf), ("min", math.inf), ("sum", 0.0)):
        ks = [k for k in keys if stat_op(k) == op]
        if ks:
            v = global_sum(torch.stack([totals[k].float() if k in totals else torch.tensor(neutral, device=dev)
                                           for k in ks]), op)
            out.update(zip(ks, v))
    return out
