"""
torchrun's ranks: who is who, sums and logged stats over the ranks, FSDP2's sharding and units.

Under `torchrun --nproc_per_node=N grpo.py` every rank holds whole groups of the step's batch and
samples them from its own RNG stream (seed + rank). batching counts the loss normalizers over all
ranks (global_sum), so the SUM over ranks of the ranks' gradients is the one-process gradient of the
whole batch. Rank 0 alone prints, logs and saves; the held-out eval is sharded. Plain
`python grpo.py` sets no RANK: rank 0 of 1, and every helper here is the identity or a no-op.
"""
import contextlib
import math
import os
import sys

import torch


def setup_distributed(cfg, dev):
    """the process group from torchrun's environment -> (rank, world size, this rank's device)"""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, dev
    import datetime
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)  # one GPU per process
        torch.cuda.set_device(dev)
    # a timeout, so that a rank that died leaves the others an error, not an endless hang
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=cfg.dist_timeout_minutes))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints; every rank's errors still show
    return rank, world, dev


def distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank():
    return torch.distributed.get_rank() if distributed() else 0


def world_size():
    return torch.distributed.get_world_size() if distributed() else 1


def shard_model(model, dt, dev, root_methods=(), frozen=False):
    """FSDP2: each decoder layer a unit, then the root (embeddings, final norm, LM head; a tied
    weight stays one parameter). The float32 weights, gradients and AdamW moments are sharded over
    the ranks; forward and backward run in dt on gathered weights; gradients are reduce-scattered in
    float32 as a plain SUM (the loss weights already hold the global normalizers).
    A unit stays gathered until the mini-batch's backward ends (batching.backward reshards): one
    gather per mini-batch, not one per micro-batch and again in its backward. frozen (the reference
    model: no backward, its weights already in dt): each unit gathered for its forward alone, so a
    rank holds its shards and one unit at a time. root_methods
    {name: fn(model, *args)}: each becomes a forward method of the root, so it runs on gathered
    weights (the fused loss reads the LM head's weight itself).
    The weights are rank 0's: the other ranks' model may be on the meta device (never loaded), and
    each rank's shards are cut from rank 0's tensors, broadcast one at a time. So one host process
    holds the whole model, not N (a 32B model's float32 weights: 131 GB each)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)
    full = model.state_dict() if rank() == 0 else {}  # (before fully_shard makes them shards)
    mesh = init_device_mesh(dev.type, (world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=None if dt == torch.float32 else dt,
                              reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=frozen)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=frozen)
    if not frozen:  # (recursive) resharded after the mini-batch instead
        model.set_reshard_after_backward(False)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # a sum over the ranks, not FSDP's default mean,
        m.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=dev)  # this rank's shards and buffers, allocated, not yet set
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    for b in model.buffers():  # (buffers outside the state dict too: RoPE's inv_freq)
        torch.distributed.broadcast(b, 0)
    for name, fn in dict(root_methods).items():
        setattr(model, name, root_method(model, fn))
        register_fsdp_forward_method(model, name)
    return model


def root_method(model, fn):
    """fn(model, *args) as a method of model; its tensors cloned, since FSDP hooks the outputs of a
    forward method and a view of them would not do"""
    def method(*args):
        return tuple(t if t is None else t.clone() for t in fn(model, *args))
    return method


def fsdp_modules(model):
    """the FSDP2 units of a model sharded by shard_model; [] for a plain model"""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model):
    """FSDP2: the full weights on every rank for generation (one all-gather per unit, not one per
    decode step), resharded on exit. Generation sets FSDP's forward hooks aside meanwhile
    (rollout.sampling), so the plain HF modules run on them. A no-op for a plain model. Every rank
    must enter it together: the all-gathers are collectives."""
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
    """how a logged stat combines over passes, updates and ranks: max, min, or a weighted sum"""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "sum"


def global_stats(totals, dev):
    """update_step's stats over all ranks by stat_op (a rank without a key adds a neutral value)"""
    keys = sorted({k for ks in all_ranks(sorted(totals)) for k in ks})
    out = {}
    for op, neutral in (("max", -math.inf), ("min", math.inf), ("sum", 0.0)):
        ks = [k for k in keys if stat_op(k) == op]
        if ks:
            v = torch.stack([totals[k].float() if k in totals else
                             torch.tensor(neutral, device=dev) for k in ks])
            out.update(zip(ks, global_sum(v, op)))
    return out
