"""
One GRPO generation batch, from sampled completions to gradients. B prompts x G completions are
sampled once; the num_iterations * steps_per_generation optimizer steps that follow all read them.
    rollout          prompts (B, P) left-padded -> completions (B*G, C) right-padded, row b*G + g
    prepare_buffer   advantages; K mini-batches of whole groups, in micro-batches under a token
                     budget (a lone group over it in parts); loss weights; old / ref log-probs
    update_step      per pass sum(per_token_loss * weight) -> backward -> clip -> optimizer.step
The loss itself (advantages, each loss_type's per-token loss and weights) is losses.py's.
Left out: TRL shuffles single completions into mini-batches, here whole groups move (kv_reuse runs
a group's prompt once); TRL's entropy threshold is per micro-batch, here per mini-batch.
"""
import contextlib
import math

import torch

import lora
from dist import distributed, fsdp_modules, global_stats, global_sum, stat_op
from kv_reuse import compiled_pieces, completion_hidden, micro_batches, split_runs, token_slots
from logprobs import token_logprobs
from losses import (clipped, entropy_mask, group_advantages, loss_weights, policy_loss,
                    sampling_correction, vespo_weights)
from rollout import COMPILE_MIN_TOKENS, LAST, eos_tensor, generate_in_waves

# per-completion entries of the buffer: (B*G, C) token tensors or (B*G,) row tensors
ROW_KEYS = ("completion_ids", "completion_mask", "truncated", "advantages", "loss_weights",
            "old_logp", "ref_logp", "entropy_mask", "entropy_weights", "sampler_logp")
# how a stat combines over the passes of a step (dist.stat_op names it)
COMBINE = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}


def free_gpu_bytes(dev):
    """what this process can still allocate on a GPU: the driver's free bytes + our cache's spare"""
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


@torch.no_grad()
def rollout(model, prompt_ids, prompt_mask, group_size, max_completion_len, temperature, top_p,
            eos_token_id, pad_token_id, compile=True, kv_gib=0.0):
    """Sample group_size completions per prompt -> the generation buffer (a dict). sampler_logp:
    the decode kernels' log-probs. Waves of at most kv_gib GiB of K/V (0: 80% of the free GPU)."""
    auto = 0.8 * free_gpu_bytes(prompt_ids.device) if prompt_ids.is_cuda and kv_gib <= 0 else None
    budget = kv_gib * 2**30 if kv_gib > 0 else auto
    completion_ids, completion_mask, sampler_logp = generate_in_waves(  # (B*G, C) each
        model, prompt_ids, prompt_mask, group_size, max_completion_len, budget, eos_token_id,
        pad_token_id, temperature=temperature, top_p=top_p, compile=compile)
    # a completion without an EOS filled max_completion_len: it was truncated
    eos = eos_tensor(eos_token_id, completion_ids.device)
    has_eos = (torch.isin(completion_ids, eos) & (completion_mask == 1)).any(1)  # (B*G,)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask.long(), group_size=group_size,
                completion_ids=completion_ids, completion_mask=completion_mask.long(),
                truncated=~has_eos, sampler_logp=sampler_logp, decode=LAST["path"],
                waves=LAST["waves"])


def select_groups(buf, idx):
    """the buffer of the groups idx (a list or a tensor, any order), each with its G rows"""
    G = buf["group_size"]
    idx = torch.as_tensor(idx, dtype=torch.long, device=buf["prompt_ids"].device)
    rows = (idx[:, None] * G + torch.arange(G, device=idx.device)).view(-1)  # (len(idx) * G,)
    prompts = dict(prompt_ids=buf["prompt_ids"][idx], prompt_mask=buf["prompt_mask"][idx])
    return dict(group_size=G, **prompts, **{k: buf[k][rows] for k in ROW_KEYS if k in buf})


def pad_columns(x, width, value, left=False):
    """x (rows, w) padded with value to (rows, width), on the left or the right; x (rows,) as is"""
    n = width - x.shape[-1]
    pad = (n, 0) if left else (0, n)
    return torch.nn.functional.pad(x, pad, value=value) if x.dim() == 2 else x


def concat_groups(bufs, pad_token_id):
    """one buffer of the groups of several (dynamic sampling's draws), padded to the widest"""
    P = max(b["prompt_ids"].shape[1] for b in bufs)
    C = max(b["completion_ids"].shape[1] for b in bufs)
    out = dict(group_size=bufs[0]["group_size"])
    for k, value in (("prompt_ids", pad_token_id), ("prompt_mask", 0)):
        out[k] = torch.cat([pad_columns(b[k], P, value, left=True) for b in bufs])
    for k in ROW_KEYS:  # the ids padded with pad_token_id, masks and log-probs with 0
        if all(k in b for b in bufs):
            value = pad_token_id if k == "completion_ids" else 0
            out[k] = torch.cat([pad_columns(b[k], C, value) for b in bufs])
    return out


def one_entropy_per_context(ent, buf):
    """ent (B*G, C) with each token's entropy taken from the first row whose token there has the
    same context (prompt and earlier tokens): a group's first tokens, every position of a prefix
    that completions share. Equal in exact arithmetic, passes of other shapes (parts of a group)
    give them ulps apart, and a threshold on such a tie would make the mask depend on the split."""
    ids, C = buf["completion_ids"], buf["completion_ids"].shape[1]  # (B*G, C), right-padded
    lengths, t = buf["completion_mask"].sum(1), torch.arange(C, device=ids.device)
    prompts = buf["prompt_ids"].masked_fill(buf["prompt_mask"] == 0, -1)  # (B, P), padding ignored
    _, prompt_of = torch.unique(prompts, dim=0, return_inverse=True)  # (B,): equal prompts, one id
    prompt_of = prompt_of.repeat_interleave(buf["group_size"])  # (B*G,)
    first = torch.arange(len(ids), device=ids.device)[:, None].repeat(1, C)  # (B*G, C)
    for p in prompt_of.unique().tolist():  # a group, or the groups of a repeated prompt
        rows = (prompt_of == p).nonzero().squeeze(1)  # (n,) ascending
        # reach[i, j]: the last position where row j's token shares row i's context: within the
        # rows' common prefix and within row j (row i reaches its own last token)
        same = ids[rows][:, None, :] == ids[rows][None, :, :]  # (n, n, C)
        reach = torch.minimum(same.int().cumprod(2).sum(2), lengths[rows] - 1)  # (n, n)
        # at position t, the first j with reach[i, j] >= t: the first where reach's running max is
        j = torch.searchsorted(reach.cummax(1).values, t.expand(len(rows), C).contiguous())
        first[rows] = rows[j.clamp_max(len(rows) - 1)]
    return torch.where(buf["completion_mask"].bool(), ent.gather(0, first), ent)


def slice_groups(buf, b0, b1):
    """the groups [b0, b1) of the buffer, without the padding columns that none of its rows use"""
    G = buf["group_size"]
    rows = {k: buf[k][b0 * G:b1 * G] for k in ROW_KEYS if k in buf}
    p_keep = max(int(buf["prompt_mask"][b0:b1].sum(1).max()), 1)  # left-padded: the last p_keep
    c_keep = max(int(rows["completion_mask"].sum(1).max()), 1)  # right-padded: the first c_keep
    rows = {k: v[:, :c_keep] if v.dim() == 2 else v for k, v in rows.items()}  # (rows, c_keep)
    return dict(group_size=G, prompt_ids=buf["prompt_ids"][b0:b1, -p_keep:],
                prompt_mask=buf["prompt_mask"][b0:b1, -p_keep:], **rows)


def micro_batch_parts(buf, b0, b1, cfg):
    """The micro-batch [b0, b1) as [(first buffer row, part)]: itself, or a lone group over budget
    in parts of consecutive completions within it (each runs the prompt again; the gradients sum
    to the whole). A part carries its host "lengths" (prompt, completions): no read in the loop."""
    G, mb = buf["group_size"], slice_groups(buf, b0, b1)
    p_len = mb["prompt_mask"].sum(1).tolist()
    c_len = mb["completion_mask"].sum(1).tolist()
    p, budget = max(p_len), cfg.micro_batch_tokens

    def cost(r0, r1):  # rows [r0, r1) of a lone group: packed, or padded to its longest
        if cfg.kv_reuse:
            return p - 1 + sum(c_len[r0:r1])
        return (r1 - r0) * (p + max(c_len[r0:r1]))
    if b1 - b0 > 1 or cost(0, G) <= budget:
        return [(b0 * G, dict(mb, lengths=(p_len, c_len)))]
    parts = []
    for r0, r1 in split_runs(G, cost, budget):  # each a group of its own, its padding columns cut
        rows = {k: mb[k][r0:r1] for k in ROW_KEYS if k in mb}
        part = slice_groups(dict(mb, group_size=r1 - r0, **rows), 0, 1)
        parts.append((b0 * G + r0, dict(part, lengths=(p_len, c_len[r0:r1]))))
    return parts


def completion_logprobs(model, mb, keep, temperature, logprob_impl, kv_reuse, entropy):
    """log pi of the N tokens where keep (B*G, C), row-major -> (logp (N,), entropy (N,) or None)"""
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"],
            mb["group_size"], keep, temperature, logprob_impl, kv_reuse, entropy, mb.get("lengths"))
    if "logprobs_forward" in vars(model):  # FSDP2: the same function as a forward of the root
        return model.logprobs_forward(*args)
    return logprobs_forward(model, *args)


def logprobs_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size,
                     keep, temperature, logprob_impl, kv_reuse, entropy, lengths=None):
    """completion_logprobs' body; under FSDP2 a forward method of the root (shard_model says why)"""
    h = completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                          group_size, reuse=kv_reuse, lengths=lengths)  # (completion tokens, H)
    h = h[keep[completion_mask.bool()]]  # (N, H): all the LM head sees
    weight = model.get_output_embeddings().weight  # (V, H)
    return token_logprobs(h.to(weight.dtype), weight, completion_ids[keep],
                          temperature=temperature, entropy=entropy, impl=logprob_impl)


@contextlib.contextmanager
def oom_names_knob(cfg, what):
    """an out-of-memory error inside a micro-batch says which knob to turn"""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise torch.cuda.OutOfMemoryError(
            f"out of GPU memory {what}: lower --micro_batch_tokens (now {cfg.micro_batch_tokens}; "
            f"one group needs up to P + G*C tokens, group_size={cfg.group_size}, "
            f"max_completion_len={cfg.max_completion_len}) or set --gradient_checkpointing=True"
        ) from e


@torch.no_grad()
def fill_logprobs(model, buf, key, mbs, cfg, entropy=False):
    """buf[key] = (B*G, C) log-probs under the current weights of `model`, zero at masked positions;
    with entropy=True also returns the (B*G, C) entropies of the same passes"""
    ids = buf["completion_ids"]
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    ents = torch.zeros_like(out) if entropy else None
    parts = [p for b0, b1 in mbs for p in micro_batch_parts(buf, b0, b1, cfg)]
    if fsdp_modules(model) and not any(p.requires_grad for p in model.parameters()):
        # a frozen FSDP2 model (the reference) all-gathers each unit in every forward, so every rank
        # runs as many as the busiest; the extra passes run the first part again and write the same
        # values (the policy's units stay gathered after its first forward: no padding needed)
        n = int(global_sum(torch.tensor(len(parts), device=ids.device), "max"))
        parts += [parts[0]] * (n - len(parts))
    for r0, mb in parts:
        keep = mb["completion_mask"].bool()  # (rows, C_mb)
        logp, ent = completion_logprobs(model, mb, keep, cfg.temperature, cfg.logprob_impl,
                                        cfg.kv_reuse, entropy)
        out[r0:r0 + len(keep), :keep.shape[1]][keep] = logp.float()  # (a view, written through)
        if entropy:
            ents[r0:r0 + len(keep), :keep.shape[1]][keep] = ent.float()
    buf[key] = out
    return ents


def micro_batch_loss(model, mb, cfg):
    """sum over this micro-batch's tokens of (policy_loss + beta * k3) * loss_weights, with
        k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's unbiased KL estimate, always >= 0)
    minus entropy_coef * sum(entropy * entropy_weights) (the bonus: a mean over the mini-batch).
    Without old_logp (one update per generation) old = logp.detach(): the ratio is exactly 1.
    Returns (loss, stats): detached 0-dim tensors weighted like the loss (so sums are means)."""
    keep = mb["loss_weights"] > 0  # (rows, C): masked truncated rows drop out before the LM head
    logp, ent = completion_logprobs(model, mb, keep, cfg.temperature, cfg.logprob_impl,
                                    cfg.kv_reuse, True)
    logp = logp.float()  # (N,)
    adv = mb["advantages"][:, None].expand_as(keep)[keep]  # (N,)
    w = mb["loss_weights"][keep]  # (N,)
    old = mb["old_logp"][keep] if "old_logp" in mb else logp.detach()
    ent_mask = mb["entropy_mask"][keep].float() if "entropy_mask" in mb else None  # (N,)
    sampler = mb["sampler_logp"][keep] if "sampler_logp" in mb else None  # (N,)
    stats, is_w = {}, None
    if sampler is not None:  # one policy, two sets of kernels (TRL's sampling_logp_difference)
        delta = (old - sampler).abs()
        stats.update(sampling_logp_diff=(delta * w).sum(), sampling_logp_diff_max=delta.max())
        if cfg.vllm_importance_sampling_correction:  # on the policy loss, before the KL, as TRL
            is_w = sampling_correction(old, sampler, keep, cfg)
            stats.update(is_ratio=(is_w * w).sum(), is_ratio_min=is_w.min(),
                         is_ratio_max=is_w.max())
    per_token, ratio = policy_loss(logp, old, adv, keep, cfg, ent_mask, is_w, sampler)
    if cfg.beta > 0:
        d = mb["ref_logp"][keep] - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * kl
        stats["kl"] = (kl.detach() * w).sum()
    loss = (per_token * w).sum()
    if cfg.entropy_coef > 0:  # TRL's entropy bonus: minus entropy_coef x the mean entropy
        loss = loss - cfg.entropy_coef * (ent.float() * mb["entropy_weights"][keep]).sum()
    low, high = clipped(ratio, adv, cfg)
    stats["clip_low"], stats["clip_high"] = (low * w).sum(), (high * w).sum()
    stats["clip_ratio"] = stats["clip_low"] + stats["clip_high"]
    stats["entropy"] = (ent.detach().float() * w).sum()
    if ent_mask is not None:
        stats["entropy_mask_frac"] = (ent_mask * w).sum()
    stats["ratio_mean"] = (ratio.detach() * w).sum()
    stats["ratio_dev_max"] = (ratio.detach() - 1).abs().max()  # exactly 0 when on-policy
    if cfg.loss_type == "vespo":  # its weight, as TRL's vespo/phi_seq_mean (here by loss weight)
        stats["vespo_phi"] = (vespo_weights(logp.detach() - old, adv, keep, cfg, is_w) * w).sum()
    return loss, stats


def forward_backward(model, mb, cfg, padding=False):
    """one pass: micro_batch_loss and its backward -> (loss, stats). A padding pass backpropagates
    its loss times 0: the hooks and collectives of a pass, no gradient."""
    n, G = len(mb["prompt_ids"]), mb["group_size"]
    what = f"in the loss of a micro-batch of {n} groups x {G} completions"
    # the small ops compiled where the decode compiles too: long completions on a GPU
    long_run = cfg.max_completion_len >= COMPILE_MIN_TOKENS
    compiled = cfg.compile and long_run and mb["loss_weights"].is_cuda
    pieces = compiled_pieces(model, cfg.kv_reuse) if compiled else contextlib.nullcontext()
    with oom_names_knob(cfg, what), pieces:
        loss, stats = micro_batch_loss(model, mb, cfg)
        (loss * 0 if padding else loss).backward()
    return loss.detach(), stats


def backward(model, buf, mbs, cfg):
    """The summed gradient of one mini-batch (mbs: its micro-batches) in .grad, one forward and
    backward per micro-batch or part -> (stats: device tensors combined by stat_op, and
    micro_batches: the passes run, FSDP2's padding ones too; the loss; the loss weights)"""
    G = buf["group_size"]
    w_sum = sum(buf["loss_weights"][b0 * G:b1 * G].sum() for b0, b1 in mbs)
    parts = [mb for b0, b1 in mbs for _, mb in micro_batch_parts(buf, b0, b1, cfg)]
    runs = [mb for mb in parts if (mb["loss_weights"] > 0).any()]  # (all tokens masked: none)
    units, n_padding = fsdp_modules(model), 0
    if units:  # FSDP2: each backward reduce-scatters, so every rank runs as many as the busiest
        n_padding = int(global_sum(torch.tensor(len(runs), device=w_sum.device), "max")) - len(runs)
    totals, loss_total = {}, torch.zeros_like(w_sum)  # on the device: no host sync per pass
    for mb in runs:
        loss, stats = forward_backward(model, mb, cfg)
        loss_total = loss_total + loss
        stats["real_tokens"], stats["token_slots"] = token_slots(
            mb["prompt_mask"], mb["completion_mask"], mb["group_size"], cfg.kv_reuse)
        for k, v in stats.items():
            totals[k] = COMBINE[stat_op(k)](totals[k], v) if k in totals else v
    if n_padding:  # the first group's first part, all its tokens weighted: the graph reaches
        _, mb = micro_batch_parts(buf, mbs[0][0], mbs[0][0] + 1, cfg)[0]  # every weight
        mb = dict(mb, loss_weights=mb["completion_mask"].float())
    for _ in range(n_padding):
        forward_backward(model, mb, cfg, padding=True)
    for m in units:  # back to the float32 shards, each holding its summed gradient
        m.reshard()
    totals["micro_batches"] = len(runs) + n_padding
    return totals, loss_total, w_sum


def gradients_to_step(model, master):
    """The parameters the optimizer steps with the step's gradient: the model's, or a bf16 model's
    float32 masters. Replicas sum it over the ranks (the weights hold the global normalizers)."""
    params = list(model.parameters())
    if master is not None:
        for m, p in zip(master, params):
            m.grad, p.grad = (p.grad.float() if p.grad is not None else None), None
        params = master
    if distributed() and not fsdp_modules(model):
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                torch.distributed.all_reduce(p.grad)
    return params


def update_step(model, optimizer, buf, mbs, cfg, master=None):
    """One optimizer step over one mini-batch (mbs: an entry of prepare_buffer's list) -> its logged
    numbers. master: the float32 parameters of a bf16 model, which the optimizer holds."""
    # 1. forward and backward of every pass: the mini-batch's gradient in .grad
    totals, loss_total, w_sum = backward(model, buf, mbs, cfg)
    passes = totals.pop("micro_batches")
    zero = torch.zeros_like(w_sum)  # (no pass ran: every token masked)
    real, slots = totals.pop("real_tokens", zero), totals.pop("token_slots", zero)
    # 2. the gradients the optimizer steps (float32 masters; replicas: summed over the ranks)
    params = gradients_to_step(model, master)
    # 3. the stats over every rank, each by its stat_op
    if distributed():
        totals = global_stats(totals, w_sum.device)
        loss_total, w_sum = global_sum(loss_total), global_sum(w_sum)
        real, slots = global_sum(real), global_sum(slots)
    # 4. clip (grad_clip 0: measure the norm only), step, round the masters back into the model
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)
    # 5. one host sync; weighted sums become means (nan: no pass had a loss token)
    numbers = [totals[k].float() for k in totals]
    numbers += [loss_total.float(), w_sum, grad_norm.float().to(w_sum.device)]
    numbers += [real.float(), slots.float()]
    *values, loss, w_sum, grad_norm, real, slots = torch.stack(numbers).tolist()
    out = dict.fromkeys(("clip_low", "clip_high", "clip_ratio", "entropy", "ratio_mean",
                         "ratio_dev_max"), math.nan)
    for k, v in zip(totals, values):
        out[k] = v / max(w_sum, 1e-12) if stat_op(k) == "sum" else v
    pad = 1 - real / slots if slots else 0.0  # padding's share of the passes' slots (not FSDP2's)
    return dict(out, loss=loss, grad_norm=grad_norm, micro_batches=passes, padding_frac=pad)


def prepare_buffer(model, ref_model, buf, rewards, cfg):
    """What the updates need that does not change between them (the parts below) -> (a list of
    micro-batches (b0, b1) per optimizer step, in order; the fraction of zero-std groups)"""
    G, K, B = buf["group_size"], cfg.steps_per_generation, buf["prompt_ids"].shape[0]
    if B % K:
        raise ValueError(f"{B} groups do not split into steps_per_generation={K} mini-batches")
    # 1. advantages, then the groups shuffled (torch.randperm: a resumed run replays it)
    buf["advantages"], frac_zero_std = group_advantages(rewards, G, cfg.scale_rewards)
    if K > 1:
        buf.update(select_groups(buf, torch.randperm(B)))
    # 2. per-token loss weights (masked truncated completions: no gradient at all)
    loss_mask = buf["completion_mask"]
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~buf["truncated"]).long()[:, None]
    buf["loss_weights"] = loss_weights(loss_mask, cfg.loss_type, cfg.max_completion_len, K)
    # 3. the micro-batches of each mini-batch (none straddles two)
    steps = []
    for k in range(K):
        b0, b1 = k * B // K, (k + 1) * B // K
        mbs = micro_batches(buf["prompt_mask"][b0:b1], buf["completion_mask"][b0 * G:b1 * G], G,
                            cfg.micro_batch_tokens, cfg.kv_reuse)
        steps.append([(b0 + a, b0 + b) for a, b in mbs])
    all_mbs = [mb for mbs in steps for mb in mbs]
    # 4. the sampling policy's log-probs and entropies, the entropy mask, the reference log-probs
    off_policy, want_entropy = cfg.num_iterations > 1 or K > 1, cfg.top_entropy_quantile < 1
    with oom_names_knob(cfg, "computing old/reference log-probs"):
        if off_policy or want_entropy:
            ent = fill_logprobs(model, buf, "old_logp", all_mbs, cfg, entropy=want_entropy)
            if not off_policy:
                del buf["old_logp"]  # only the entropies were wanted: the ratio stays exactly 1
        if want_entropy:  # per mini-batch, fixed over the passes: the gradient ignores the split
            ent = one_entropy_per_context(ent, buf)
            buf["entropy_mask"] = entropy_mask(ent, loss_mask, cfg.top_entropy_quantile, K)
        if cfg.beta > 0:  # (LoRA: the reference is the policy itself with its adapters off)
            with lora.disabled(ref_model) if ref_model is model else contextlib.nullcontext():
                fill_logprobs(ref_model, buf, "ref_logp", all_mbs, cfg)
    # 5. the entropy bonus's weights: a token mean over each mini-batch's tokens with policy loss
    if cfg.entropy_coef > 0:
        carry = loss_mask * buf["entropy_mask"] if want_entropy else loss_mask
        buf["entropy_weights"] = loss_weights(carry, "bnpo", cfg.max_completion_len, K)
    return steps, frac_zero_std
