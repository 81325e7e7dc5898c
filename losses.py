"""
The GRPO objective, as TRL 1.16's GRPOTrainer computes it: advantages, the per-token policy loss
of each loss_type, the weights that aggregate it, the entropy mask and the sampler correction.
These are functions of log-probs, advantages and masks only: batching.py runs the model, splits
the batch and calls them. A new loss_type is a branch in policy_loss, one in loss_weights and,
if it clips, one in clipped (config.CHOICES names it; test_all compares every one TRL has with
TRL's own _compute_loss; one TRL lacks needs hand numbers in its hand-computed test).
    A_i    = (r_i - mean(group)) / std           group_advantages
    l_t    = policy_loss(logp_t, old_t, A_i)     per token, one of the menu below
    loss   = sum_t l_t w_t                       w = loss_weights: TRL's normalizer, split-free
batching.micro_batch_loss adds the k3 KL and the entropy bonus (entropy_coef x the mean entropy of
the tokens with policy loss: loss_weights' bnpo weights over them). Left out: TRL's adaptive
entropy coefficient (`use_adaptive_entropy`: state across steps) and the KL's ratio factor
(`use_bias_correction_kl`; README's table says why).
"""
import math

import torch

from dist import all_ranks, distributed, global_sum

CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped ratio (policy_loss)


def group_advantages(rewards, group_size, scale_rewards="group"):
    """A_i = r_i - mean(group), divided by the group's std ("group"), the batch's ("batch") or not
    ("none", Dr. GRPO). Returns (advantages (B*G,), the fraction of groups with equal rewards)."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(1, keepdim=True)
    std_group = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(adv[:, :1])
    if scale_rewards == "group":
        adv = adv / (std_group + 1e-4)
    elif scale_rewards == "batch":  # the unbiased std of all B*G rewards, every rank's, two passes
        n = global_sum(torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device))
        mean = global_sum(r.double().sum()) / n
        var = global_sum(((r.double() - mean) ** 2).sum()) / (n - 1).clamp_min(1)
        adv = adv / (var.sqrt().float() + 1e-4) if n > 1 else adv
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r}: use group, batch or none")
    return adv.view(-1), (std_group.squeeze(1) < 1e-6).float().mean().item()


def loss_weights(completion_mask, loss_type, max_completion_len, steps_per_generation=1):
    """(B*G, C) weight per token so that loss = sum(per_token_loss * w) over one mini-batch
    reproduces TRL's loss_type aggregations, whatever the micro-batch split (the normalizer is the
    mini-batch's). Rows are in mini-batch order: mini-batch k is rows [k*R, (k+1)*R), R = B*G / K,
    K = steps_per_generation. Per mini-batch, with S sequences:
        grpo, sapo:   1/S * sum_i ( sum_t l_it m_it / sum_t m_it )   (per sequence, then the mean)
        luspo:        1/S * sum_i sum_t l_it m_it      (a sequence's loss times its length)
        bnpo:         sum_it l_it m_it / sum_it m_it                 (token mean of the mini-batch)
        dapo, cispo, vespo:  sum_it l_it m_it / (M / K)   (M: the generation batch's tokens)
        dr_grpo:      sum_it l_it m_it / (S * max_completion_len)    (constant: no length bias)
    Rows whose mask is all zero (masked truncated completions) get weight 0 and do not count in S.
    Under torchrun every count is global_sum'd: mini-batch k is rank 0's k-th, rank 1's k-th, ..."""
    m, K = completion_mask.float(), steps_per_generation  # (B*G, C)
    mk = m.view(K, -1, m.shape[1])  # (K, R, C)
    lens = mk.sum(2, keepdim=True)  # (K, R, 1)
    if loss_type in ("grpo", "sapo", "luspo"):
        n_seq = global_sum((lens > 0).sum(1, keepdim=True)).clamp_min(1)  # (K, 1, 1)
        w = mk / n_seq if loss_type == "luspo" else mk / lens.clamp_min(1) / n_seq
    elif loss_type == "bnpo":
        w = mk / global_sum(mk.sum((1, 2), keepdim=True)).clamp_min(1)
    elif loss_type in ("dapo", "cispo", "vespo"):
        w = mk / (global_sum(m.sum()).clamp_min(1) / K)
    elif loss_type == "dr_grpo":
        n_seq = global_sum(torch.tensor(float(mk.shape[1]), device=m.device))
        w = mk / (n_seq * max_completion_len)
    else:
        raise ValueError(f"loss_type={loss_type!r} has no normalizer in losses.loss_weights")
    return w.reshape(m.shape)


def policy_loss(logp, old, adv, keep, cfg, ent_mask=None, is_w=None, sampler=None):
    """(per-token policy loss, importance ratio), each (N,) over the keep (R, C) tokens, row-major:
        token level:     r_t = exp(logp_t - old_t)
        sequence level:  r_t = s_i = exp( 1/|y_i| sum_t (logp_it - old_it) )   (GSPO: one ratio
                         per completion i on all its tokens, clipped with epsilon / epsilon_high)
        clip losses:     l_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A)
                         (delta > 0, INTELLECT-2's two-sided clip: r_t capped at delta in the first
                         term, so a negative advantage's loss is bounded too)
        cispo:           l_t = -sg(min(r_t, epsilon_high)) A logp_t   (TRL 1.16: epsilon_high is
                         the cap itself; the detached weight keeps every token's gradient,
                         A min(r_t, epsilon_high) grad logp_t, where PPO's clip would zero it)
        sapo:            l_t = -4/tau sigmoid(tau (r_t - 1)) A   (a soft clip: the gradient fades
                         as r_t leaves 1; tau = sapo_temperature_pos if A > 0, else _neg)
        vespo:           l_t = -sg(phi_i) A logp_t   (vespo_weights: a smooth weight of the row's
                         ratio in place of a clip)
    The knobs each reads: epsilon, epsilon_high and delta the clip losses (cispo: epsilon_high is
    its cap); importance_sampling_level every type but vespo (its weight takes the row's product).
    ent_mask (N,): 1 for the tokens that carry the policy loss (top_entropy_quantile), else 0.
    is_w (N,): the sampler correction (sampling_correction): it scales the loss (vespo: in phi).
    sampler (N,): the sampler's log-probs, for off_policy_mask_threshold > 0 (None: old's)."""
    log_ratio = logp - old  # (N,)
    if cfg.importance_sampling_level == "sequence":  # length-normalized
        log_ratio = row_mean(log_ratio, keep)
    ratio = torch.exp(log_ratio)
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.loss_type == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif cfg.loss_type == "vespo":
        per_token = -vespo_weights(logp.detach() - old, adv, keep, cfg, is_w) * adv * logp
    elif cfg.loss_type in CLIP_LOSSES:
        bounded = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        capped = torch.clamp(ratio, max=cfg.delta) if cfg.delta > 0 else ratio
        per_token = -torch.min(capped * adv, bounded * adv)
    else:
        raise ValueError(f"loss_type={cfg.loss_type!r} has no per-token loss in losses.policy_loss")
    if cfg.off_policy_mask_threshold > 0:
        behind = old if sampler is None else sampler
        per_token = per_token * off_policy_mask(logp.detach(), behind, adv, keep,
                                                cfg.off_policy_mask_threshold)
    if ent_mask is not None:
        per_token = per_token * ent_mask
    if is_w is not None and cfg.loss_type != "vespo":
        per_token = per_token * is_w
    return per_token, ratio


def vespo_weights(log_ratio, adv, keep, cfg, is_w=None):
    """VESPO's weight of each row, (N,) over the keep tokens, from its sequence ratio w (the
    product of its token ratios, times the sampler correction's if any), in log space:
        phi(w) = w^k e^(lambda (1 - w))   (1 at w = 1, highest at w = k / lambda, 0 far off)
    k, lambda: vespo_k_pos, vespo_lambda_pos where A >= 0, else the _neg pair"""
    floor = math.log(1e-8)
    log_w = row_sum(log_ratio.clamp(-20, 20), keep)
    if is_w is not None:
        log_w = log_w + row_sum(is_w.log().clamp(floor, 20), keep)
    log_w = log_w.clamp(floor, 20)
    k = torch.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = torch.where(adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)


def off_policy_mask(logp, sampler, adv, keep, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold), (N,) over the
    keep tokens: 0 on every token of a row with A < 0 whose mean KL from the sampler,
        1/|y_i| sum_t (sampler_it - logp_it)   (logp: the policy's now),
    is over the threshold (a mistake the policy has moved away from teaches little), else 1"""
    kl = row_mean((sampler - logp).nan_to_num(0.0), keep)
    return ((adv >= 0) | (kl <= threshold)).float()


def row_sum(x, keep):
    """x (N,) over the keep (R, C) tokens (row-major) -> (N,): each token gets its row's sum of x"""
    dense = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_scatter(keep, x)
    return dense.sum(1, keepdim=True).expand_as(keep)[keep]


def row_mean(x, keep):
    """x (N,) over the keep (R, C) tokens -> (N,): each token gets its row's mean of x"""
    return row_sum(x, keep) / keep.sum(1, keepdim=True).expand_as(keep)[keep]


def clipped(ratio, adv, cfg):
    """(N,) bools (low, high), the log's clip_low and clip_high: the tokens whose ratio passed the
    clip on the side their advantage's sign makes binding (there min() takes the clipped term, a
    constant: no gradient); cispo: the tokens whose weight was capped"""
    if cfg.loss_type == "cispo":  # the weight was capped (TRL's cispo_clip_ratio); no lower clip
        return torch.zeros_like(ratio, dtype=torch.bool), (ratio > cfg.epsilon_high) & (adv > 0)
    if cfg.loss_type in CLIP_LOSSES:
        return (ratio < 1 - cfg.epsilon) & (adv < 0), (ratio > 1 + cfg.epsilon_high) & (adv > 0)
    nothing = torch.zeros_like(ratio, dtype=torch.bool)  # sapo, vespo: soft weights, no clip
    return nothing, nothing


def sampling_correction(old, sampler, keep, cfg):
    """TRL's importance-sampling correction for a sampler that is not the training forward (vLLM
    there, our decode kernels here), w (N,) over the keep (R, C) tokens, with TRL's modes:
        token_*:     w_t = exp(old_t - sampler_t)
        sequence_*:  w_i = exp( sum_t (old_it - sampler_it) ) on all the row's tokens
    *_truncate clamps w to [clip_min, clip_max], *_mask sets w outside it to 0."""
    diff = old - sampler
    if cfg.vllm_importance_sampling_mode.startswith("sequence"):
        diff = row_sum(diff, keep)
    w = torch.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("truncate"):
        return w.clamp(lo, hi)
    return w.masked_fill((w < lo) | (w > hi), 0.0)


def quantile_any_size(x, q):
    """torch.quantile(x, q) of a 1-D x by the same float ops, for any length (it refuses 2**24+)"""
    pos = torch.tensor(q, dtype=x.dtype, device=x.device) * (x.numel() - 1)
    lo, hi = int(pos.floor()), int(pos.ceil())  # linear interpolation between these two ranks
    return torch.lerp(x.kthvalue(lo + 1).values, x.kthvalue(hi + 1).values, pos - lo)


def entropy_mask(ent, loss_mask, quantile, steps_per_generation=1):
    """(B*G, C) bool: the top `quantile` fraction by entropy of each mini-batch's loss tokens (every
    rank's), as TRL's get_high_entropy_mask: entropy >= torch.quantile(entropies, 1 - quantile)"""
    K, C = steps_per_generation, ent.shape[1]
    out = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for e, m, o in zip(ent.view(K, -1, C), loss_mask.bool().view(K, -1, C), out.view(K, -1, C)):
        values = e[m].float()  # (this rank's loss tokens of the mini-batch,)
        if distributed():
            values = torch.cat([v.to(e.device) for v in all_ranks(values.cpu())])
        if values.numel():
            threshold = quantile_any_size(values, 1 - quantile)
            o.copy_((e * m >= threshold) & m)
    return out
