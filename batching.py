"""
One GRPO generation batch, from sampled completions to gradients.

A generation batch is prompts_per_step prompts x group_size completions, sampled ONCE and then buffered: the
num_iterations optimizer steps that follow all read the same buffer (TRL #3283), so generation is not repeated per
gradient-accumulation micro-batch and "how many updates per sample" is its own knob.

    prompts (B, P) left-padded ─ generate_in_waves ─> completions (B*G, C) right-padded, rows prompt-major (b*G + g)
    rewards (B*G,) ─ group_advantages ─> advantages (B*G,)
    steps_per_generation = K: the groups are shuffled and cut into K disjoint mini-batches, one optimizer step each;
        num_iterations passes over the K mini-batches = num_iterations * K optimizer steps per generation (TRL)
    loss_weights (B*G, C): the loss_type normalizer of the whole MINI-batch, baked into one weight per token
    micro_batches: whole groups under a token budget; a lone group over it runs in parts (micro_batch_parts)
    old / ref log-probs under no_grad, micro-batch by micro-batch (old skipped when exactly on-policy)
    update_step: sum over micro-batches of sum(per_token_loss * weight) -> backward -> clip -> optimizer.step
"""
import contextlib
import math

import torch

import lora
from dist import all_ranks, distributed, fsdp_modules, global_stats, global_sum, stat_op
from kv_reuse import compiled_pieces, completion_hidden
from rollout import COMPILE_MIN_TOKENS, LAST, eos_tensor, generate_in_waves
from logprobs import token_logprobs

# per-completion entries of the buffer: (B*G, C) token tensors or (B*G,) row tensors
ROW_KEYS = ("completion_ids", "completion_mask", "truncated", "advantages", "loss_weights", "old_logp", "ref_logp",
            "entropy_mask", "sampler_logp")


def free_gpu_bytes(dev):
    """what this process can still allocate on a CUDA device: the driver's free memory + what our caching allocator
    holds unused (what other processes hold is not ours)"""
    return torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


@torch.no_grad()
def rollout(model, prompt_ids, prompt_mask, group_size, max_completion_len, temperature, top_p, eos_token_id,
            pad_token_id, compile=True, kv_gib=0.0):
    """sample group_size completions per prompt; the returned dict is the generation buffer. eos_token_id: an int or
    a list (every id that ends a completion). sampler_logp: each token's log-prob as the sampler computed it (its
    decode kernels, not the training forward's); decode: the path that sampled it (rollout.LAST["path"]). K/V of at
    most kv_gib GiB live at once (0: 80% of the GPU memory free now; none on the CPU): more in waves."""
    dev = prompt_ids.device
    budget = kv_gib * 2**30 if kv_gib > 0 else 0.8 * free_gpu_bytes(dev) if dev.type == "cuda" else None
    completion_ids, completion_mask, sampler_logp = generate_in_waves(
        model, prompt_ids, prompt_mask, group_size, max_completion_len, budget, eos_token_id, pad_token_id,
        temperature=temperature, top_p=top_p, compile=compile)  # (B*G, C) each
    completion_mask = completion_mask.long()
    has_eos = (torch.isin(completion_ids, eos_tensor(eos_token_id, completion_ids.device))
               & (completion_mask == 1)).any(1)  # (B*G,); with no EOS it filled max_completion_len: truncated
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask.long(), completion_ids=completion_ids,
                completion_mask=completion_mask, truncated=~has_eos, group_size=group_size, sampler_logp=sampler_logp,
                decode=LAST["path"], waves=LAST["waves"])


def select_groups(buf, idx):
    """the buffer of the groups idx (group indices, a list or a tensor; any order), each with its G rows"""
    G = buf["group_size"]
    idx = torch.as_tensor(idx, dtype=torch.long, device=buf["prompt_ids"].device)
    rows = (idx[:, None] * G + torch.arange(G, device=idx.device)).view(-1)  # (len(idx) * G,)
    out = dict(group_size=G, prompt_ids=buf["prompt_ids"][idx], prompt_mask=buf["prompt_mask"][idx])
    out.update({k: buf[k][rows] for k in ROW_KEYS if k in buf})
    return out


def concat_groups(bufs, pad_token_id):
    """one buffer of the groups of several (dynamic sampling's draws), padded to the widest prompt and completion"""
    P = max(b["prompt_ids"].shape[1] for b in bufs)
    C = max(b["completion_ids"].shape[1] for b in bufs)
    left = lambda x, v: torch.nn.functional.pad(x, (P - x.shape[1], 0), value=v)  # noqa: E731
    right = lambda x, v: torch.nn.functional.pad(x, (0, C - x.shape[1]), value=v) if x.dim() == 2 else x  # noqa: E731
    out = dict(group_size=bufs[0]["group_size"],
               prompt_ids=torch.cat([left(b["prompt_ids"], pad_token_id) for b in bufs]),
               prompt_mask=torch.cat([left(b["prompt_mask"], 0) for b in bufs]))
    for k in ROW_KEYS:  # (B*G, C) ones right-padded: the ids with pad_token_id, masks and log-probs with 0
        if all(k in b for b in bufs):
            out[k] = torch.cat([right(b[k], pad_token_id if k == "completion_ids" else 0) for b in bufs])
    return out


def group_advantages(rewards, group_size, scale_rewards="group"):
    """A_i = r_i - mean(group), divided by the group's std ("group"), the batch's std ("batch") or nothing ("none",
    Dr. GRPO). Returns (advantages (B*G,), frac of groups whose rewards are all equal: they carry no signal)."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(1, keepdim=True)
    std_group = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(adv[:, :1])
    if scale_rewards == "group":
        adv = adv / (std_group + 1e-4)
    elif scale_rewards == "batch":  # the std of all B*G rewards; under torchrun of every rank's (two passes, exact)
        n = global_sum(torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device))
        mean = global_sum(r.double().sum()) / n
        var = global_sum(((r.double() - mean) ** 2).sum()) / (n - 1).clamp_min(1)  # unbiased, as torch.std
        adv = adv / (var.sqrt().float() + 1e-4) if n > 1 else adv
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r}: use group, batch or none")
    frac_zero_std = (std_group.squeeze(1) < 1e-6).float().mean().item()
    return adv.view(-1), frac_zero_std


def loss_weights(completion_mask, loss_type, max_completion_len, steps_per_generation=1):
    """(B*G, C) weight per token so that loss = sum(per_token_loss * w) over one mini-batch reproduces TRL's loss_type
    aggregations, whatever the micro-batch split (the normalizer is the mini-batch's, not a micro-batch's). The rows
    are in mini-batch order: mini-batch k is rows [k*R, (k+1)*R), R = B*G / steps_per_generation. Per mini-batch:
        grpo:         1/S * sum_i ( sum_t l_it m_it / sum_t m_it )     (mean over each sequence, then over sequences)
        bnpo:         sum_it l_it m_it / sum_it m_it                   (token mean over the mini-batch)
        dapo, cispo:  sum_it l_it m_it / (M / K)                       (M: tokens of the whole GENERATION batch, K =
                                                                        steps_per_generation: TRL's num_items_in_batch)
        dr_grpo:      sum_it l_it m_it / (S * max_completion_len)      (constant normalizer, no length bias)
    Rows whose mask is all zero (masked truncated completions) get weight 0 and do not count in S for grpo.
    Under torchrun each count (S, the tokens, the rows) is global_sum'd: mini-batch k is rank 0's k-th, rank 1's k-th...
    """
    m = completion_mask.float()  # (B*G, C)
    K = steps_per_generation
    mk = m.view(K, -1, m.shape[1])  # (K, R, C)
    if loss_type == "grpo":
        lens = mk.sum(2, keepdim=True)  # (K, R, 1)
        n_seq = global_sum((lens > 0).sum(1, keepdim=True)).clamp_min(1)  # (K, 1, 1)
        w = mk / lens.clamp_min(1) / n_seq
    elif loss_type == "bnpo":
        w = mk / global_sum(mk.sum((1, 2), keepdim=True)).clamp_min(1)
    elif loss_type in ("dapo", "cispo"):
        w = mk / (global_sum(m.sum()).clamp_min(1) / K)
    elif loss_type == "dr_grpo":
        w = mk / (global_sum(torch.tensor(float(mk.shape[1]), device=m.device)) * max_completion_len)
    else:
        raise ValueError(f"loss_type={loss_type!r}: use grpo, bnpo, dr_grpo, dapo or cispo")
    return w.reshape(m.shape)


def quantile_any_size(x, q):
    """torch.quantile(x, q) of a 1-D x (linear interpolation between the two nearest ranks, the same float ops, so
    the same value) for any length: torch.quantile refuses over 2**24 elements, which a gathered mini-batch reaches
    (8 ranks x 32 prompts x 16 completions x 4k tokens = 16.8M). kthvalue is O(n), no sort."""
    pos = torch.tensor(q, dtype=x.dtype, device=x.device) * (x.numel() - 1)
    lo, hi = int(pos.floor()), int(pos.ceil())
    return torch.lerp(x.kthvalue(lo + 1).values, x.kthvalue(hi + 1).values, pos - lo)


def entropy_mask(ent, loss_mask, quantile, steps_per_generation=1):
    """(B*G, C) bool: the tokens whose entropy is in the top `quantile` fraction of their mini-batch's loss tokens
    (Beyond the 80/20 Rule; TRL's get_high_entropy_mask: entropy >= torch.quantile(entropies, 1 - quantile), so
    quantile=0 keeps the highest-entropy token(s) only). Rows in mini-batch order as in loss_weights; under torchrun
    mini-batch k is every rank's k-th, so its threshold is over all of their loss tokens (gathered: a few MB a step)."""
    K = steps_per_generation
    out = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for e, m, o in zip(ent.view(K, -1, ent.shape[1]), loss_mask.bool().view(K, -1, ent.shape[1]),
                       out.view(K, -1, ent.shape[1])):  # (R, C) each: one mini-batch
        values = e[m].float()  # (this rank's loss tokens of the mini-batch,)
        if distributed():
            values = torch.cat([v.to(e.device) for v in all_ranks(values.cpu())])
        if values.numel():
            threshold = quantile_any_size(values, 1 - quantile)
            o.copy_((e * m >= threshold) & m)
    return out


def micro_batches(prompt_mask, completion_mask, group_size, micro_batch_tokens, reuse=True):
    """split the B groups into contiguous runs [b0, b1) of whole groups whose padded token count stays within
    micro_batch_tokens (a lone group over budget still gets its own run): n_groups * (P_mb + G * C_mb) with KV
    reuse (the prompt runs once per group), n_groups * G * (P_mb + C_mb) without"""
    G = group_size
    cost = (lambda p, c: p + G * c) if reuse else (lambda p, c: G * (p + c))
    p_len = prompt_mask.sum(1).tolist()  # (B,) left-padded, so a run needs max(p_len) columns
    c_len = completion_mask.view(-1, G, completion_mask.shape[1]).sum(2).amax(1).tolist()  # (B,)
    out, b0, p_max, c_max = [], 0, 0, 0
    for b in range(len(p_len)):
        p_new, c_new = max(p_max, p_len[b]), max(c_max, c_len[b])
        if b > b0 and (b + 1 - b0) * cost(p_new, c_new) > micro_batch_tokens:
            out.append((b0, b))
            b0, p_new, c_new = b, p_len[b], c_len[b]
        p_max, c_max = p_new, c_new
    out.append((b0, len(p_len)))
    return out


def slice_groups(buf, b0, b1):
    """the groups [b0, b1) of the buffer, with the padding columns that no row of the slice uses cut off"""
    G = buf["group_size"]
    pm = buf["prompt_mask"][b0:b1]
    rows = {k: buf[k][b0 * G:b1 * G] for k in ROW_KEYS if k in buf}
    p_keep = max(int(pm.sum(1).max()), 1)  # prompts are left-padded: keep the last p_keep columns
    c_keep = max(int(rows["completion_mask"].sum(1).max()), 1)  # completions are right-padded: keep the first c_keep
    return dict(group_size=G, prompt_ids=buf["prompt_ids"][b0:b1, -p_keep:], prompt_mask=pm[:, -p_keep:],
                **{k: v[:, :c_keep] if v.dim() == 2 else v for k, v in rows.items()})  # (rows, c_keep) or (rows,)


def micro_batch_parts(buf, b0, b1, cfg):
    """the micro-batch of groups [b0, b1) as [(first buffer row, part)]: itself, or a lone group over
    micro_batch_tokens cut into parts of its own completions that fit (a part is a group of fewer rows with the same
    prompt: kv_reuse runs the prompt again in each part, with its gradient, so the summed gradients equal the
    unsplit group's; reasoning lengths, where one group of G x 16k tokens would not fit at once)"""
    G, mb = buf["group_size"], slice_groups(buf, b0, b1)
    P, C, budget = mb["prompt_ids"].shape[1], mb["completion_ids"].shape[1], cfg.micro_batch_tokens
    g = max(1, (budget - P) // C if cfg.kv_reuse else budget // (P + C))  # rows: P + g*C tokens, or g*(P + C)
    if b1 - b0 > 1 or g >= G:
        return [(b0 * G, mb)]
    parts = []
    for r in range(0, G, g):  # each part a group of its own, with the padding columns it does not use cut off
        rows = {k: mb[k][r:r + g] for k in ROW_KEYS if k in mb}
        parts.append((b0 * G + r, slice_groups(dict(mb, group_size=len(rows["completion_ids"]), **rows), 0, 1)))
    return parts


def completion_logprobs(model, mb, keep, temperature, logprob_impl, kv_reuse, entropy):
    """log pi(token) of the completion tokens where keep (B*G, C) is True, response-only (slime #2076): padding never
    costs a logits row. Returns (logp (N,), ent (N,) or None), N = keep.sum(), row-major."""
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"], mb["group_size"], keep,
            temperature, logprob_impl, kv_reuse, entropy)
    if "logprobs_forward" in vars(model):  # FSDP2 (grpo.shard_model): the same function, as a forward of the root
        return model.logprobs_forward(*args)
    return logprobs_forward(model, *args)


def logprobs_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size, keep, temperature,
                     logprob_impl, kv_reuse, entropy):
    """completion_logprobs' body; under FSDP2 a forward method of the root (grpo.shard_model says why)"""
    h = completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size,
                          reuse=kv_reuse)[keep]  # (B*G, C, H) -> (N, H): the only rows the LM head ever sees
    weight = model.get_output_embeddings().weight  # (V, H)
    return token_logprobs(h.to(weight.dtype), weight, completion_ids[keep], temperature=temperature, entropy=entropy,
                          impl=logprob_impl)


@contextlib.contextmanager
def oom_names_knob(cfg, what):
    """an OOM inside a micro-batch says which knob to turn"""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise torch.cuda.OutOfMemoryError(
            f"out of GPU memory {what}: lower --micro_batch_tokens (now {cfg.micro_batch_tokens}; one group needs "
            f"about P + G*C tokens, group_size={cfg.group_size}, max_completion_len={cfg.max_completion_len}) or set "
            f"--gradient_checkpointing=True") from e


@torch.no_grad()
def fill_logprobs(model, buf, key, mbs, cfg, entropy=False):
    """buf[key] = (B*G, C) log-probs of the current weights of `model`, zero at masked positions; with entropy=True
    also returns the (B*G, C) entropies of the same pass"""
    out = torch.zeros(buf["completion_ids"].shape, dtype=torch.float32, device=buf["completion_ids"].device)
    ents = torch.zeros_like(out) if entropy else None
    for r0, mb in (part for b0, b1 in mbs for part in micro_batch_parts(buf, b0, b1, cfg)):
        keep = mb["completion_mask"].bool()  # (rows, C_mb)
        logp, ent = completion_logprobs(model, mb, keep, cfg.temperature, cfg.logprob_impl, cfg.kv_reuse, entropy)
        out[r0:r0 + len(keep), :keep.shape[1]][keep] = logp.float()  # (a view of out, written through)
        if entropy:
            ents[r0:r0 + len(keep), :keep.shape[1]][keep] = ent.float()
    buf[key] = out
    return ents


def row_sum(x, keep):
    """x (N,) over the keep (R, C) tokens (row-major) -> (N,): each token gets the sum of x over its row"""
    dense = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_scatter(keep, x)  # (R, C)
    return dense.sum(1, keepdim=True).expand_as(keep)[keep]


def policy_loss(logp, old, adv, keep, cfg, ent_mask=None):
    """per-token policy loss (N,) and importance ratio (N,) of the N = keep.sum() tokens (row-major; keep (R, C)):
        token level:     r_t = exp(logp_t - old_t)
        sequence level:  r_t = s_i = exp( 1/|y_i| sum_t (logp_it - old_it) )   (GSPO: one ratio per completion i,
                         broadcast to its tokens, clipped with the same epsilon / epsilon_high as TRL does)
        clip losses:     l_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A)
        cispo:           l_t = -sg(min(r_t, epsilon_high)) A logp_t   (CISPO/ScaleRL as TRL 1.16: epsilon_high is the
                         cap eps_max ITSELF, not 1 + epsilon_high; the weight is detached so every token keeps a
                         gradient, A * min(r, eps_max) * grad logp, where PPO's clip would zero it)
    ent_mask (N,): 1 for the tokens that carry the policy loss (top_entropy_quantile), 0 elsewhere."""
    log_ratio = logp - old  # (N,)
    if cfg.importance_sampling_level == "sequence":
        log_ratio = row_sum(log_ratio, keep) / keep.sum(1, keepdim=True).expand_as(keep)[keep]  # length-normalized
    ratio = torch.exp(log_ratio)
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=cfg.epsilon_high).detach() * adv * logp
    else:
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
    if ent_mask is not None:
        per_token = per_token * ent_mask
    return per_token, ratio


def sampling_correction(old, sampler, keep, cfg):
    """TRL's importance-sampling correction for a sampler that is not the training forward (vLLM there, rollout.py's
    decode kernels here), with TRL's names and modes: per token w_t = exp(old_t - sampler_t), or per sequence
    w_i = exp(sum_t (old_it - sampler_it)) on all its tokens; *_truncate clamps w to [clip_min, clip_max],
    *_mask sets w outside it to 0. old, sampler (N,) over the keep (R, C) tokens; returns w (N,)."""
    diff = old - sampler
    w = torch.exp(row_sum(diff, keep) if cfg.vllm_importance_sampling_mode.startswith("sequence") else diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("truncate"):
        return w.clamp(lo, hi)
    return w.masked_fill((w < lo) | (w > hi), 0.0)


def micro_batch_loss(model, mb, cfg):
    """sum over this micro-batch's tokens of (policy_loss + beta * k3) * loss_weights, with
        k3 = exp(ref - logp) - (ref - logp) - 1   (unbiased, always >= 0 KL estimate, Schulman)
    Without old_logp (one update per generation) old = logp.detach(): ratio exactly 1, gradient A * grad(logp)."""
    keep = mb["loss_weights"] > 0  # (B*G, C): loss mask 1 (masked truncated rows drop out here, before the LM head)
    logp, ent = completion_logprobs(model, mb, keep, cfg.temperature, cfg.logprob_impl, cfg.kv_reuse, True)
    logp = logp.float()  # (N,)
    adv = mb["advantages"][:, None].expand_as(keep)[keep]  # (N,)
    w = mb["loss_weights"][keep]  # (N,)
    old = mb["old_logp"][keep] if "old_logp" in mb else logp.detach()
    ent_mask = mb["entropy_mask"][keep].float() if "entropy_mask" in mb else None  # (N,)
    per_token, ratio = policy_loss(logp, old, adv, keep, cfg, ent_mask)
    # stats are detached 0-dim tensors, weighted like the loss so they are whole-batch means too; update_step reads
    # them all in one host sync (the [keep] selections sync each micro-batch; one nonzero instead: no gain, fd000f6)
    stats = {}
    if "sampler_logp" in mb:  # sampler vs trainer: one policy, two sets of kernels (TRL's sampling_logp_difference)
        sampler = mb["sampler_logp"][keep]
        delta = (old - sampler).abs()
        stats["sampling_logp_diff"], stats["sampling_logp_diff_max"] = (delta * w).sum(), delta.max()
        if cfg.vllm_importance_sampling_correction:  # applied to the policy loss, before the KL term, as TRL does
            is_w = sampling_correction(old, sampler, keep, cfg)
            per_token = per_token * is_w
            stats["is_ratio"], stats["is_ratio_min"], stats["is_ratio_max"] = (is_w * w).sum(), is_w.min(), is_w.max()
    if cfg.beta > 0:
        d = mb["ref_logp"][keep] - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * kl
        stats["kl"] = (kl.detach() * w).sum()
    loss = (per_token * w).sum()
    if cfg.loss_type == "cispo":  # the weight was capped (TRL's cispo_clip_ratio); there is no lower clip
        low, high = torch.zeros_like(ratio), ((ratio > cfg.epsilon_high) & (adv > 0)).float()
    else:
        low = ((ratio < 1 - cfg.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + cfg.epsilon_high) & (adv > 0)).float()
    stats["clip_low"], stats["clip_high"] = (low * w).sum(), (high * w).sum()
    stats["clip_ratio"] = stats["clip_low"] + stats["clip_high"]
    stats["entropy"] = (ent.detach().float() * w).sum()
    if ent_mask is not None:
        stats["entropy_mask_frac"] = (ent_mask * w).sum()
    stats["ratio_mean"] = (ratio.detach() * w).sum()
    stats["ratio_dev_max"] = (ratio.detach() - 1).abs().max()  # exactly 0 when on-policy
    return loss, stats


def backward(model, buf, mbs, cfg):
    """the summed gradient of one mini-batch's micro-batches in .grad (under FSDP2: reduce-scattered over the ranks
    into the float32 shards, and the modules resharded). Returns (stats summed over the micro-batches (device
    tensors), the summed loss, the summed loss weights)."""
    G = buf["group_size"]
    w_sum = sum(buf["loss_weights"][b0 * G:b1 * G].sum() for b0, b1 in mbs)  # what the weighted means are relative to
    totals, loss_total = {}, torch.zeros_like(w_sum)  # on the device: no host sync per micro-batch
    units = fsdp_modules(model)
    runs = [mb for b0, b1 in mbs for _, mb in micro_batch_parts(buf, b0, b1, cfg)
            if (mb["loss_weights"] > 0).any()]  # (none: e.g. all truncated and masked)
    if units:  # FSDP2: each backward reduce-scatters (a collective), so every rank runs as many; a rank short of
        # micro-batches runs its first group's first part again with its loss times 0 (zero gradient, same hooks and
        # collectives; a part, not the group: a group over the budget would not fit whole)
        runs += [None] * (int(global_sum(torch.tensor(len(runs), device=w_sum.device), "max")) - len(runs))
    pieces = cfg.compile and w_sum.is_cuda and cfg.max_completion_len >= COMPILE_MIN_TOKENS  # as the decode compiles
    for run in runs:
        mb = run or micro_batch_parts(buf, mbs[0][0], mbs[0][0] + 1, cfg)[0][1]
        if run is None:  # some tokens, so the graph reaches every weight
            mb["loss_weights"] = mb["completion_mask"].float()
        with oom_names_knob(cfg, f"in the loss of a micro-batch of {len(mb['prompt_ids'])} groups x "
                                 f"{mb['group_size']} completions"), \
                compiled_pieces(model) if pieces else contextlib.nullcontext():
            loss, stats = micro_batch_loss(model, mb, cfg)
            (loss if run is not None else loss * 0).backward()
        if run is None:
            continue
        loss_total = loss_total + loss.detach()
        for k, v in stats.items():
            combine = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}[stat_op(k)]
            totals[k] = v if k not in totals else combine(totals[k], v)
    for m in units:  # back to the float32 shards (each holds its summed gradient), which the optimizer steps
        m.reshard()
    return totals, loss_total, w_sum


def update_step(model, optimizer, buf, mbs, cfg, master=None):
    """one optimizer step over one mini-batch (mbs: one entry of prepare_buffer's list). With `master` (float32 copies
    of a bf16 model's parameters, which the optimizer holds) the gradients go to the masters, so the clip norm is
    float32 too, and the stepped masters are rounded back into the model."""
    totals, loss_total, w_sum = backward(model, buf, mbs, cfg)
    units = fsdp_modules(model)
    params = list(model.parameters())
    trained = master if master is not None else params
    if master is not None:
        for m, p in zip(master, params):
            m.grad, p.grad = (p.grad.float() if p.grad is not None else None), None
    if distributed() and not units:  # replicas: sum the ranks' gradients (the loss weights hold global normalizers)
        for p in trained:
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # a rank may have had no loss tokens
                torch.distributed.all_reduce(p.grad)
    if distributed():
        totals, loss_total, w_sum = global_stats(totals, w_sum.device), global_sum(loss_total), global_sum(w_sum)
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
    keys = list(totals)
    *vals, loss_total, w_sum, grad_norm = torch.stack(  # the one host sync of the step
        [totals[k].float() for k in keys] + [loss_total.float(), w_sum, grad_norm.float().to(w_sum.device)]).tolist()
    # nan for the stats no micro-batch reported (none does when every completion was truncated and masked)
    out = dict.fromkeys(("clip_low", "clip_high", "clip_ratio", "entropy", "ratio_mean", "ratio_dev_max"), math.nan)
    out.update({k: v if stat_op(k) != "sum" else v / max(w_sum, 1e-12) for k, v in zip(keys, vals)})
    return dict(out, loss=loss_total, grad_norm=grad_norm)


def prepare_buffer(model, ref_model, buf, rewards, cfg):
    """everything the updates need that does not change between them: advantages, the mini-batches, per-token
    weights, the entropy mask, and the old/ref log-probs under no_grad. Returns (one list of micro-batches (b0, b1)
    per optimizer step, in order; the fraction of zero-std groups). With K = steps_per_generation > 1 the groups
    are shuffled (torch.randperm, so resume replays it): TRL shuffles single completions, here whole groups move
    (kv_reuse runs a group's prompt once; the advantages come first, so only the normalizers see the difference)."""
    G, K, B = buf["group_size"], cfg.steps_per_generation, buf["prompt_ids"].shape[0]
    if B % K:
        raise ValueError(f"{B} groups do not split into steps_per_generation={K} mini-batches")
    buf["advantages"], frac_zero_std = group_advantages(rewards, G, cfg.scale_rewards)
    if K > 1:
        buf.update(select_groups(buf, torch.randperm(B)))  # the groups in a new order, each its G rows together
    loss_mask = buf["completion_mask"]
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~buf["truncated"]).long()[:, None]  # truncated rows: no gradient at all
    buf["loss_weights"] = loss_weights(loss_mask, cfg.loss_type, cfg.max_completion_len, K)
    steps = []
    for k in range(K):  # micro-batches never straddle two mini-batches
        b0, b1 = k * B // K, (k + 1) * B // K
        mbs = micro_batches(buf["prompt_mask"][b0:b1], buf["completion_mask"][b0 * G:b1 * G], G,
                            cfg.micro_batch_tokens, cfg.kv_reuse)
        steps.append([(b0 + a, b0 + b) for a, b in mbs])
    all_mbs = [mb for mbs in steps for mb in mbs]
    want_entropy = cfg.top_entropy_quantile < 1
    with oom_names_knob(cfg, "computing old/reference log-probs"):
        if cfg.num_iterations > 1 or K > 1 or want_entropy:
            # an on-policy single update would see ratio = 1 anyway; later ones need the sampling policy's log-probs
            ent = fill_logprobs(model, buf, "old_logp", all_mbs, cfg, entropy=want_entropy)
            if want_entropy:
                # per mini-batch from the sampling policy's entropies (fixed over the passes): TRL's per micro-batch
                # and pass would make the gradient depend on the micro-batch split
                buf["entropy_mask"] = entropy_mask(ent, loss_mask, cfg.top_entropy_quantile, K)
            if cfg.num_iterations == 1 and K == 1:
                del buf["old_logp"]  # (only the entropies were wanted: keep the ratio exactly 1)
        if cfg.beta > 0:  # (LoRA: the reference is the policy itself with its adapters off)
            with lora.disabled(ref_model) if ref_model is model else contextlib.nullcontext():
                fill_logprobs(ref_model, buf, "ref_logp", all_mbs, cfg)
    return steps, frac_zero_std
