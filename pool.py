"""
Which rows decode when. The synchronous step (max_staleness=0) samples its B prompts x G rows at
once, in waves that fit the K/V budget (rollout). At ragged lengths it waits for its longest
completion, a handful of rows decoding alone while each step still reads every weight. No tail
(max_staleness=N > 0) keeps a pool of groups across steps:

    1. admit    draws of B prompts, the ones a synchronous run makes, in order, while the groups
                admitted stay within (step + N) x B (AReaL's bound; no slow row is ever dropped:
                that would bias training toward short completions)
    2. decode   every unfinished row in one batch, until B groups are complete (all G rows ended)
                and, those trained, every group left can still train within N steps of its
                admission at B a step (N = 1: every group admitted a step ago is complete)
    3. hand     B complete groups to the update, the earliest admitted first, then as they ended

So a trained group's prompt came in at most N optimizer steps before its update, and each token
keeps the log-prob of the weights that sampled it, which the loss corrects for
(vllm_importance_sampling_correction, on by default when N > 0, per token: AReaL's decoupled
objective; a sequence's summed log-ratio drifts over thousands of tokens). A
carried row continues under the new weights, its prompt ++ tokens prefilled as a prompt of its
own (AReaL's interruptible rollout). Left out: K/V kept across the update (PipelineRL): K/V of
the old weights, and memory held through the update.
"""
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from dist import all_ranks
from rollout import LAST, eos_tensor, generate_groups, kv_bytes_per_token


# -- the synchronous step: every group at once, in waves --------------------------------------
def free_gpu_bytes(dev):
    """what this process can still allocate on a GPU: the driver's free bytes + our cache's spare"""
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


def kv_budget(dev, kv_gib):
    """the bytes of K/V the rollout may hold: kv_gib GiB, or 0 = 80% of the free GPU memory (None
    on the CPU: no cap)"""
    if kv_gib > 0:
        return kv_gib * 2**30
    return 0.8 * free_gpu_bytes(dev) if dev.type == "cuda" else None


@torch.no_grad()
def rollout(model, prompt_ids, prompt_mask, group_size, max_completion_len, temperature, top_p,
            eos_token_id, pad_token_id, compile=True, kv_gib=0.0):
    """Sample group_size completions per prompt -> the generation buffer (a dict). sampler_logp:
    the decode kernels' log-probs. Waves of at most kv_gib GiB of K/V (0: 80% of the free GPU)."""
    budget = kv_budget(prompt_ids.device, kv_gib)
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


def waves(B, G, P, T, kv_token, budget):
    """[(b0, b1, rows)]: B groups of G rows (P prompt columns, T new tokens) with K/V within budget
    bytes (None: no cap): whole groups b0:b1 while one fits, else a group in parts of `rows` rows"""
    group = kv_token * (P + G * max(T - 1, 1))  # the prompt once + G completion caches of T-1
    if budget is None or B * group <= budget:  # (kv_token 0: the config lacks the fields: no cap)
        return [(0, B, G)]
    if group <= budget:
        n = int(budget // group)
        return [(b, min(b + n, B), G) for b in range(0, B, n)]
    rows = int((budget / kv_token - P) // max(T - 1, 1))
    if rows < 1:
        raise torch.cuda.OutOfMemoryError(
            f"rollout: one completion of {T} tokens after a {P}-token prompt needs "
            f"{(P + T) * kv_token / 2**30:.1f} GiB of K/V ({kv_token} bytes a token) and "
            f"{budget / 2**30:.1f} GiB is free for it: lower --max_completion_len or "
            f"--max_prompt_len, or raise --rollout_kv_gib")
    return [(b, b + 1, rows) for b in range(B)]


def generate_in_waves(model, prompt_ids, prompt_mask, group_size, max_new_tokens, kv_budget,
                      eos_token_id, pad_token_id, **kw):
    """generate_groups(..., return_logprobs=True) with at most kv_budget bytes of K/V live at once
    (waves() says how): the same rows, right-padded to the longest; LAST["waves"]: the calls."""
    G, P = group_size, int(prompt_mask.sum(1).max())
    kv_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    outs = []
    for b0, b1, rows in waves(prompt_ids.shape[0], G, P, max_new_tokens, kv_token, kv_budget):
        for g0 in range(0, G, rows):
            outs.append(generate_groups(
                model, prompt_ids[b0:b1], prompt_mask[b0:b1], min(rows, G - g0), max_new_tokens,
                eos_token_id=eos_token_id, pad_token_id=pad_token_id, return_logprobs=True, **kw))
    LAST["waves"] = len(outs)
    pad = (pad_token_id if pad_token_id is not None
           else int(eos_tensor(eos_token_id, prompt_ids.device)[0]))
    C = max(ids.shape[1] for ids, _, _ in outs)
    ids = torch.cat([F.pad(x, (0, C - x.shape[1]), value=pad) for x, _, _ in outs])
    mask = torch.cat([F.pad(x, (0, C - x.shape[1]), value=0) for _, x, _ in outs])
    logps = torch.cat([F.pad(x, (0, C - x.shape[1]), value=0) for _, _, x in outs])
    return ids, mask, logps


# -- no tail: a pool of groups kept across steps ---------------------------------------------
def new_pool(draw_prompts, group_size, eos_token_id, pad_token_id, step=0, saved=None):
    """The pool before step + 1. draw_prompts(k) -> (pairs, prompt_ids, prompt_mask): draw k's n
    prompts (left-padded), what a synchronous run samples at step k. groups: admitted, not yet
    trained; admitted: the draws admitted so far; ended: a counter ordering groups as they complete.
    saved (pool_state's, from a checkpoint at step): its groups in flight are admitted again as
    they were, their rows regenerated; without it, draws 1..step count as trained."""
    pool = SimpleNamespace(draw_prompts=draw_prompts, group_size=group_size, eos=eos_token_id,
                           pad=pad_token_id, groups=[], admitted=step, ended=0)
    if saved:
        pool.admitted = saved["admitted"]
        for k, b, admitted_at in saved["groups"]:
            pairs, prompt_ids, prompt_mask = draw_prompts(k)
            add_group(pool, k, b, pairs[b], prompt_ids[b][prompt_mask[b].bool()], admitted_at)
    return pool


def pool_state(pool):
    """what a checkpoint keeps of the pool: its draws, and each group in flight (draw, index in it,
    step admitted); the rows are regenerated on resume"""
    if pool is None:
        return None
    return dict(admitted=pool.admitted, groups=[(g.draw, g.index, g.step) for g in pool.groups])


def add_group(pool, draw, index, pair, prompt, step):
    """a group of G rows that have not started: prompt (p,) its real tokens"""
    G, empty = pool.group_size, prompt.new_zeros(0)
    rows = [SimpleNamespace(ids=empty, logps=empty.float(), ended=False, eos=False)
            for _ in range(G)]
    pool.groups.append(SimpleNamespace(draw=draw, index=index, pair=pair, prompt=prompt,
                                       step=step, rows=rows, order=None))


def pool_step(pool, model, step, n, cfg):
    """One step's n groups out of the pool: 1. admit, 2. decode, 3. hand over. Returns (buf, their
    (question, example) pairs): buf has rollout()'s keys, and "pool": the step's statistics."""
    max_rows = max_pool_rows(model, cfg)
    if max_rows is not None and max_rows < n * cfg.group_size:
        raise ValueError(f"the rollout pool holds every row's K/V at once and {max_rows} rows fit, "
                         f"fewer than a step's {n} x {cfg.group_size}: use --max_staleness=0 (it "
                         f"samples in waves) or raise --rollout_kv_gib")
    admit(pool, step, n, cfg, max_rows)
    rows, added, steps, ended = 0, 0, 0, []
    if not ready(pool.groups, step, cfg.max_staleness, n):
        rows, added, steps, ended = decode_round(pool, model, step, n, cfg)
    buf, pairs, staleness = take(pool, step, n, cfg)
    # the step's pool statistics over every rank: sums, then ratios
    carried = sum(0 < len(r.ids) and not r.ended for g in pool.groups for r in g.rows)
    mine = (sum(staleness), max(staleness), n, carried, added, rows * steps,
            int(buf["completion_mask"].sum()), len(ended), sum(ended))
    ranks = all_ranks(mine)
    s = [sum(x) for x in zip(*ranks)]
    nan = float("nan")
    stats = dict(staleness_mean=s[0] / s[2], staleness_max=max(r[1] for r in ranks),
                 rows_carried=s[3], slot_occupancy=s[4] / s[5] if s[5] else nan,
                 completion_len_trained=s[6] / (s[2] * cfg.group_size),
                 completion_len_sampled=s[8] / s[7] if s[7] else nan)
    buf["pool"] = stats
    return buf, pairs


def admit(pool, step, n, cfg, max_rows):
    """1. admit draws while (step + N) draws bound them and the rows decoding fit max_rows (with
    fewer than n groups in the pool, a draw is admitted whatever it costs)"""
    while pool.admitted < step + cfg.max_staleness:
        decoding = sum(not r.ended for g in pool.groups for r in g.rows)
        full = max_rows is not None and decoding + n * pool.group_size > max_rows
        if len(pool.groups) >= n and full:
            break  # the K/V budget is full: admit at a later step
        pool.admitted += 1
        pairs, prompt_ids, prompt_mask = pool.draw_prompts(pool.admitted)
        for b, pair in enumerate(pairs):
            add_group(pool, pool.admitted, b, pair, prompt_ids[b][prompt_mask[b].bool()], step)


def ready(groups, step, N, n, ended=lambda r: r.ended):
    """can the step train? n complete groups (the earliest admitted), and with them gone every
    group left can still train within N steps of its admission at n groups a step: by step s + j
    at most j x n of them came in at step s + j - N or before (ended(row): has the row ended)"""
    done = sorted(g.step for g in groups if all(ended(r) for r in g.rows))[:n]
    left = Counter(g.step for g in groups) - Counter(done)
    return len(done) == n and all(sum(c for a, c in left.items() if a <= step + j - N) <= j * n
                                  for j in range(N + 1))


def decode_round(pool, model, step, n, cfg):
    """2. decode the pool's unfinished rows in one batch until ready(). A group none of whose rows
    has started shares one prefill of its prompt; a row part-way through is its prompt ++ its
    tokens so far, prefilled as a prompt of its own under the current weights.
    Returns (rows decoded, tokens added, decode steps, the lengths of the rows that ended)."""
    G, T = cfg.group_size, cfg.max_completion_len
    prefixes, counts, limits, where = [], [], [], []  # where[i]: call row i's (group, row)
    for g in pool.groups:
        if all(len(r.ids) == 0 for r in g.rows):
            prefixes.append(g.prompt)
            counts.append(G)
            limits += [T] * G
            where += [(g, r) for r in g.rows]
            continue
        for r in (r for r in g.rows if not r.ended):
            prefixes.append(torch.cat([g.prompt, r.ids]))
            counts.append(1)
            limits.append(T - len(r.ids))
            where.append((g, r))
    prompt_ids, prompt_mask = pad_rows(prefixes, pool.pad, "left")

    def stop(live):  # asked every few decode steps: would the pool be ready with these rows live?
        live = {id(where[i][1]) for i in live}  # (every unfinished row is in this call)
        return ready(pool.groups, step, cfg.max_staleness, n, lambda r: id(r) not in live)

    ids, keep, logps = generate_groups(  # (rows, C) each
        model, prompt_ids, prompt_mask, 1, max(limits), temperature=cfg.temperature,
        top_p=cfg.top_p, eos_token_id=pool.eos, pad_token_id=pool.pad,
        return_logprobs=True, compile=cfg.compile, counts=counts, limits=limits, stop=stop)
    steps = LAST["steps"] + 1  # (token 0 comes from the prefill)
    added = keep.sum(1)  # (rows,)
    last = ids.gather(1, (added - 1).clamp_min(0)[:, None])[:, 0]
    has_eos = (torch.isin(last, eos_tensor(pool.eos, ids.device)) & (added > 0)).tolist()
    added = added.tolist()  # (the round's one host read)
    ended, end_at = [], {}  # end_at: a group's tokens added until its last row here ended
    for i, (g, r) in enumerate(where):
        r.ids = torch.cat([r.ids, ids[i, :added[i]]])
        r.logps = torch.cat([r.logps, logps[i, :added[i]]])
        r.eos, r.ended = has_eos[i], has_eos[i] or len(r.ids) >= T
        if r.ended:
            ended.append(len(r.ids))
            end_at[id(g)] = max(end_at.get(id(g), 0), added[i])
    # the groups complete now get their order: by when their last row ended
    now = [g for g in pool.groups if g.order is None and all(r.ended for r in g.rows)]
    for g in sorted(now, key=lambda g: end_at[id(g)]):
        g.order, pool.ended = pool.ended, pool.ended + 1
    return len(where), sum(added), steps, ended


def take(pool, step, n, cfg):
    """3. the n complete groups to train, out of the pool: the earliest admitted first, then in
    the order they completed. Returns (buffer, their (question, example) pairs, staleness)."""
    G = cfg.group_size
    complete = [g for g in pool.groups if all(r.ended for r in g.rows)]
    chosen = sorted(complete, key=lambda g: (g.step, g.order))[:n]  # (as ready() counted them)
    pool.groups = [g for g in pool.groups if not any(g is c for c in chosen)]
    rows = [r for g in chosen for r in g.rows]  # (n*G,) row b*G + g
    prompt_ids, prompt_mask = pad_rows([g.prompt for g in chosen], pool.pad, "left")  # (n, P)
    completion_ids, completion_mask = pad_rows([r.ids for r in rows], pool.pad)  # (n*G, C)
    sampler_logp = pad_sequence([r.logps for r in rows], batch_first=True)
    truncated = torch.tensor([not r.eos for r in rows], device=prompt_ids.device)
    buf = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, group_size=G,
               completion_ids=completion_ids, completion_mask=completion_mask,
               truncated=truncated, sampler_logp=sampler_logp, decode=LAST.get("path"), waves=1)
    return buf, [g.pair for g in chosen], [step - g.step for g in chosen]


def pad_rows(seqs, value, side="right"):
    """1-D tensors padded into (len(seqs), longest) with value, and their (long) mask"""
    ids = pad_sequence(seqs, batch_first=True, padding_value=value, padding_side=side)
    ones = [torch.ones_like(s) for s in seqs]
    return ids, pad_sequence(ones, batch_first=True, padding_side=side)


def max_pool_rows(model, cfg):
    """the rows whose K/V fit in rollout_kv_gib, or auto: 80% of the free GPU memory, at their
    longest: a row's prefix columns are the call's longest prompt ++ tokens so far (< P + C), its
    completion columns the call's largest limit (C); None: no bound (the CPU, or the config lacks
    the fields)"""
    kv_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    budget = kv_budget(next(model.parameters()).device, cfg.rollout_kv_gib)
    if budget is None or kv_token == 0:
        return None
    return int(budget // (kv_token * (cfg.max_prompt_len + 2 * cfg.max_completion_len)))
