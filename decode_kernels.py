"""The decode step's kernels, each beside its torch reference (rollout.py runs them):
1. Decode attention over a group's shared prompt K/V. Each prompt's K/V stay as the prefill left
   them, (B, kvh, P, D), shared by its G rows; each row's own tokens go into a completion cache
   (B*G, kvh, T, D). A split-K ("flash decoding") kernel per layer (_decode_split_kernel: GQA
   without a repeat, RoPE and the cache write inside) walks only the columns a row attends; a
   second kernel merges the splits by log-sum-exp:
       o = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M),   M = max_s lse_s
   Finished rows attend nothing. The op nanogrpo::decode_attention runs it or its torch reference.
2. Sampling without a host sync (torch.multinomial would sync): inverse-CDF Triton kernels
   (sample_triton, temperature only), or an exponential race in torch ops behind HF's warpers.
3. A step's bookkeeping after sampling (record): one kernel, not a dozen small torch ops.
The attention's decode state st: rows (n,) each slot's cache row, done (n,) finished slots, start
(B,) each prompt's first real column, slot (1,) this step's completion column, G, splits."""
import math
import os
from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per block in the split kernel
NUM_WARPS = 4  # the split kernel's launch
SPLIT_WAVES = 2  # key splits: enough (slot, K/V head, split) programs to fill the GPU this often


def pdl_launch(device):
    """launch arguments for Hopper's programmatic dependent launch (capability >= 9, compiled): a
    kernel launches while the one before it runs, then waits in _wait_for_previous_kernel"""
    on = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
          and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
    return dict(USE_GDC=True, launch_pdl=True) if on else dict(USE_GDC=False)


@triton.jit
def _wait_for_previous_kernel(USE_GDC: tl.constexpr):
    """under PDL: wait for the previous kernel's writes, then let the next kernel launch"""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

# decode attention: Triton split-K kernel, merge kernel, torch reference ---------------------------
@triton.jit
def _attend_columns(k_ptr, v_ptr, base, stride_l, j_lo, j_hi, q, m_i, l_i, acc, qk_scale,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """online softmax (log2 units) of the (QPK_PAD, D) queries over columns [j_lo, j_hi) of one K/V
    buffer (base + j * stride_l); returns the updated running max m_i, sum l_i and output acc"""
    offs_d = tl.arange(0, D)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        valid = offs_j < j_hi
        ptrs = base + offs_j[:, None] * stride_l + offs_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.)  # (BLOCK_N, D)
        v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (QPK_PAD, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every block has a valid key, so m_new is finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _rope(x, x_ptrs, offs_d, cos, sin, mask, D: tl.constexpr):
    """RoPE (rope_torch's formula) on rows x loaded from x_ptrs, in fp32, rounded once to x.dtype"""
    partner = tl.load(x_ptrs + tl.where(offs_d < D // 2, D // 2, -(D // 2)), mask=mask, other=0.)
    rotated = tl.where(offs_d < D // 2, -partner.to(tl.float32), partner.to(tl.float32))
    return (x.to(tl.float32) * cos + rotated * sin).to(x.dtype)


# P (the prompt length) changes between calls: specialized on it, the kernel would compile again
# mid-rollout for a new P % 16; unspecialized, it runs as fast
@triton.jit(do_not_specialize=["P"])
def _decode_split_kernel(q_ptr, knew_ptr, vnew_ptr, cos_ptr, sin_ptr, pk_ptr, pv_ptr, ck_ptr,
                         cv_ptr, rows_ptr, done_ptr, start_ptr, slot_ptr, o_ptr, lse_ptr, out_ptr,
                         G, P, qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                         stride_vh, stride_rn, stride_pb, stride_ph, stride_pl, stride_cn,
                         stride_ch, stride_cl, QPK: tl.constexpr, QPK_PAD: tl.constexpr,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         PRECISION: tl.constexpr, ROPE: tl.constexpr, USE_GDC: tl.constexpr):
    """program (slot, kv head, split): the QPK query heads of one K/V head against keys [lo, hi)
    of its row, [the prompt's real columns | completion columns 0..t], t = slot_ptr[0]. ROPE: q
    and this step's key come unrotated, with (cos, sin) rows stride_rn apart. The split owning
    column t first stores this step's K/V there (k rotated)."""
    pid_n, pid_h, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # before the PDL wait: the decode state, written by the last step's end, not the kernel before
    row = tl.load(rows_ptr + pid_n).to(tl.int64)
    b = row // G
    n_pre = P - tl.load(start_ptr + b)  # the prompt's real (unpadded) columns
    t = tl.load(slot_ptr)
    total = n_pre + t + 1
    per = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N  # keys per split, whole blocks
    lo = pid_s * per
    hi = tl.minimum(lo + per, total)
    hi = tl.where(tl.load(done_ptr + pid_n) != 0, lo, hi)  # a finished row attends nothing (0)
    _wait_for_previous_kernel(USE_GDC)
    offs_d = tl.arange(0, D)
    offs_q = tl.arange(0, QPK_PAD)
    heads = pid_h * QPK + offs_q
    q_ok = offs_q < QPK
    q_ptrs = q_ptr + pid_n * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_ok[:, None], other=0.)  # (QPK_PAD, D)
    if ROPE:
        cos = tl.load(cos_ptr + pid_n * stride_rn + offs_d).to(tl.float32)  # (D,)
        sin = tl.load(sin_ptr + pid_n * stride_rn + offs_d).to(tl.float32)
        q = _rope(q, q_ptrs, offs_d, cos, sin, q_ok[:, None], D)
    c_off = row * stride_cn + pid_h * stride_ch
    if (hi == total) & (lo < hi):  # write this step's K/V into the cache, read it like any column
        k_ptrs = knew_ptr + pid_n * stride_kn + pid_h * stride_kh + offs_d
        k_t = tl.load(k_ptrs)  # (D,)
        if ROPE:
            k_t = _rope(k_t, k_ptrs, offs_d, cos, sin, offs_d < D, D)
        tl.store(ck_ptr + c_off + t * stride_cl + offs_d, k_t)
        tl.store(cv_ptr + c_off + t * stride_cl + offs_d,
                 tl.load(vnew_ptr + pid_n * stride_vn + pid_h * stride_vh + offs_d))
        tl.debug_barrier()  # the block's stores are visible to its own loads after the barrier
    m_i = tl.full([QPK_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QPK_PAD], tl.float32)
    acc = tl.zeros([QPK_PAD, D], tl.float32)
    # key j in [lo, hi): prompt column P - n_pre + j if j < n_pre, else completion column j - n_pre
    p_base = b * stride_pb + pid_h * stride_ph + (P - n_pre) * stride_pl
    m_i, l_i, acc = _attend_columns(pk_ptr, pv_ptr, p_base, stride_pl, lo, tl.minimum(hi, n_pre),
                                    q, m_i, l_i, acc, qk_scale, D, BLOCK_N, PRECISION)
    m_i, l_i, acc = _attend_columns(ck_ptr, cv_ptr, c_off, stride_cl, tl.maximum(lo - n_pre, 0),
                                    hi - n_pre, q, m_i, l_i, acc, qk_scale, D, BLOCK_N, PRECISION)
    l_safe = tl.where(l_i > 0, l_i, 1.)
    nh = pid_n * (QPK * tl.num_programs(1)) + heads  # flat (slot, head)
    if SPLITS == 1:  # the only split: write the output itself, (n, 1, h, D)
        tl.store(out_ptr + nh[:, None] * D + offs_d[None, :],
                 (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=q_ok[:, None])
    else:
        tl.store(o_ptr + (nh * SPLITS + pid_s)[:, None] * D + offs_d[None, :],
                 acc / l_safe[:, None], mask=q_ok[:, None])
        tl.store(lse_ptr + nh * SPLITS + pid_s,
                 tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=q_ok)


@triton.jit
def _decode_merge_kernel(o_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """program (slot*h + head): merge the SPLITS partial outputs by their log-sum-exp (log2)"""
    _wait_for_previous_kernel(USE_GDC)
    pid = tl.program_id(0)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    lse = tl.load(lse_ptr + pid * SPLITS + offs_s)
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.)), 0.)
    o = tl.load(o_ptr + (pid * SPLITS + offs_s)[:, None] * D + offs_d[None, :])
    den = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.)
    tl.store(out_ptr + pid * D + offs_d, out.to(out_ptr.dtype.element_ty))


def stage_count(D):
    """the split kernel's pipeline depth: as many stages (2 or 3) as keep a program's K/V buffers
    (stages x BLOCK_N x D x K and V x 2 bytes) within 64 KB, so three programs fit an SM (228 KB)"""
    return max(2, min(3, 64 * 1024 // (BLOCK_N * D * 2 * 2)))


def decode_attention_triton(q, k_new, v_new, layer, st, scale, cos=None, sin=None):
    """q (n, h, 1, D), k_new/v_new (n, kvh, 1, D) -> (n, 1, h, D); writes k_new/v_new into the
    cache at st.slot. cos/sin (n, 1, D): q and k_new come without RoPE; the kernel applies it."""
    n, h, _, D = q.shape
    kvh = k_new.shape[1]
    pk, pv, ck, cv = layer
    # (k_new and v_new may have different strides: they are views of one q|k|v output)
    assert (q.stride(-1) == k_new.stride(-1) == v_new.stride(-1) == pk.stride(-1)
            == ck.stride(-1) == 1 and pk.stride() == pv.stride() and ck.stride() == cv.stride())
    rope = cos is not None
    if rope:
        assert (cos.shape == sin.shape == (n, 1, D) and cos.stride() == sin.stride()
                and cos.stride(-1) == 1)
    S = st.splits
    out = torch.empty(n, 1, h, D, dtype=q.dtype, device=q.device)
    o = torch.empty(n, h, S, D, dtype=torch.float32, device=q.device) if S > 1 else out
    lse = torch.empty(n, h, S, dtype=torch.float32, device=q.device) if S > 1 else out
    QPK = h // kvh
    _decode_split_kernel[(n, kvh, S)](
        q, k_new, v_new, cos if rope else q, sin if rope else q, pk, pv, ck, cv,
        st.rows, st.done, st.start, st.slot,
        o, lse, out, st.G, pk.shape[2], scale * 1.4426950408889634, q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0) if rope else 0,
        pk.stride(0), pk.stride(1), pk.stride(2), ck.stride(0), ck.stride(1), ck.stride(2),
        QPK=QPK, QPK_PAD=max(16, triton.next_power_of_2(QPK)), D=D, BLOCK_N=BLOCK_N, SPLITS=S,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models: no TF32
        ROPE=rope, num_warps=NUM_WARPS, num_stages=stage_count(D), **pdl_launch(q.device))
    if S > 1:
        _decode_merge_kernel[(n * h,)](o, lse, out, D=D, SPLITS=S, num_warps=1,
                                       **pdl_launch(q.device))
    return out


def rope_torch(x, cos, sin):
    """RoPE as transformers' llama/qwen2/qwen3 apply it, op for op (bit-equal): x (n, heads, 1, D),
    cos/sin (n, 1, D); x cos + rotate_half(x) sin, rotate_half([x1, x2]) = [-x2, x1]"""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def decode_attention_torch(q, k_new, v_new, layer, st, scale):
    """the reference, and the CPU path: decode_attention_triton in plain torch ops, reading the
    whole cache under a mask (q and k_new come rotated already)"""
    pk, pv, ck, cv = layer
    rows, t = st.rows, st.slot  # (n,), (1,)
    ck[rows, :, t] = k_new[:, :, 0]  # (n, kvh, D) into column t of each slot's row
    cv[rows, :, t] = v_new[:, :, 0]
    b = rows // st.G
    keys = torch.cat([pk[b], ck[rows]], dim=2)  # (n, kvh, P+T, D)
    values = torch.cat([pv[b], cv[rows]], dim=2)
    P, cols = pk.shape[2], torch.arange(keys.shape[2], device=q.device)
    ok = torch.where(cols < P, cols >= st.start[b][:, None], cols - P <= t)  # (n, P+T)
    out = torch.nn.functional.scaled_dot_product_attention(  # (n, h, 1, D)
        q, keys, values, attn_mask=ok[:, None, None, :], scale=scale, enable_gqa=True)
    return out.masked_fill(st.done[:, None, None, None], 0).transpose(1, 2)  # finished rows 0


@torch.library.custom_op("nanogrpo::decode_attention", mutates_args=("ck", "cv"))
def decode_attention_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        pk: torch.Tensor, pv: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                        rows: torch.Tensor, done: torch.Tensor, start: torch.Tensor,
                        slot: torch.Tensor, G: int, scale: float, impl: str,
                        cos: Optional[torch.Tensor] = None,
                        sin: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decode_forward's attention as a torch op, the decode state as arguments: torch.compile traces
    a forward with it inside (knowing it writes ck/cv), where a compiler-disabled function would
    break the graph. cos/sin (n, 1, D): the op applies RoPE to q and k_new. Returns (n, 1, h, D)
    in pk's dtype (autocast with fp32 weights hands back fp32 q/k beside a bf16 v)."""
    dt = pk.dtype
    st = SimpleNamespace(rows=rows, done=done, start=start, slot=slot, G=G,
                         splits=num_splits(rows.shape[0], pk.shape[1], q.device))
    if impl == "triton":
        return decode_attention_triton(q.to(dt), k_new.to(dt), v_new.to(dt), (pk, pv, ck, cv), st,
                                       scale, cos, sin)
    if cos is not None:  # (as the model would, in the dtypes it gets)
        q, k_new = rope_torch(q, cos, sin), rope_torch(k_new, cos, sin)
    return decode_attention_torch(q.to(dt), k_new.to(dt), v_new.to(dt), (pk, pv, ck, cv), st,
                                  scale).contiguous()


@decode_attention_op.register_fake
def _(q, k_new, v_new, pk, pv, ck, cv, rows, done, start, slot, G, scale, impl, cos=None,
      sin=None):
    n, h, _, D = q.shape
    return q.new_empty(n, 1, h, D, dtype=pk.dtype)


def num_splits(n, kvh, device):
    """key splits per (slot, K/V head): enough programs to fill the GPU SPLIT_WAVES times"""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(64, triton.next_power_of_2(math.ceil(SPLIT_WAVES * sms / (n * kvh)))))


# sampling: inverse-CDF Triton kernels, torch reference (any warpers) ------------------------------
def sample(logits, warpers):
    """(n, V) logits -> (n,) tokens and their log-probs after the warpers (greedy: plain softmax).
    Exponential race: argmax_k p_k / E_k, E_k ~ Exp(1) iid, picks k with probability p_k (the min
    of independent Exp(p_k)); E is clamped away from 0, where p = 0 tokens would tie."""
    logits = logits.float()
    for w in warpers or []:
        logits = w(None, logits)
    logp = torch.log_softmax(logits, dim=-1)
    tok = logits.argmax(-1) if warpers is None else (
        logp.exp() / torch.empty_like(logp).exponential_().clamp_min_(1e-30)).argmax(-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


@triton.jit
def _sample_blocks_kernel(logits_ptr, part_ptr, V, stride_n, inv_temp, BLOCK_V: tl.constexpr):
    """program (row, block): over the block's ids, with z = logits / T, part (n, blocks, 2) gets
    m_b = max z and s_b = sum exp(z - m_b). One read of the logits, one exp per id."""
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    z = tl.load(logits_ptr + row * stride_n + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32) * inv_temp
    m = tl.max(z, 0)
    s = tl.sum(tl.exp(z - tl.where(m > float("-inf"), m, 0.)), 0)
    out = part_ptr + (row * tl.num_programs(1) + blk) * 2
    tl.store(out, m)
    tl.store(out + 1, s)


@triton.jit
def _sample_pick_kernel(logits_ptr, part_ptr, tok_ptr, logp_ptr, seed_ptr, V, stride_n, inv_temp,
                        BLOCKS, BLOCKS_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """program row: inverse CDF, k = min{k : sum_{j<=k} p_j > u}, u ~ U(0, 1) from Philox(seed,
    row). M = max_b m_b; w_b = s_b exp(m_b - M) is block b's mass times W = sum_b w_b. k: in the
    first block whose cumulative mass passes u W, the first id whose running sum exp(z - M) passes
    what is left; log p_k = z_k - (M + log W)."""
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, BLOCKS_PAD)
    b_ok = offs_b < BLOCKS
    m_b = tl.load(part_ptr + (row * BLOCKS + offs_b) * 2, mask=b_ok, other=float("-inf"))
    s_b = tl.load(part_ptr + (row * BLOCKS + offs_b) * 2 + 1, mask=b_ok, other=0.)
    M = tl.max(m_b, 0)
    w = tl.where(m_b > float("-inf"), s_b * tl.exp(m_b - M), 0.)
    W = tl.sum(w, 0)
    target = tl.rand(tl.load(seed_ptr), row) * W
    cum = tl.cumsum(w, 0)
    last = tl.max(tl.where(w > 0, offs_b, 0), 0)  # the last block with mass (u W may round up to W)
    b = tl.minimum(tl.sum(tl.where(b_ok & (cum <= target), 1, 0), 0), last)
    r = target - tl.sum(tl.where(offs_b < b, w, 0.), 0)  # the mass left to pass inside block b
    offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
    z = tl.load(logits_ptr + row * stride_n + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32) * inv_temp
    p = tl.exp(z - M)
    hit = (tl.cumsum(p, 0) > r) & (p > 0)
    big = b * BLOCK_V + BLOCK_V
    k = tl.min(tl.where(hit, offs, big), 0)
    k = tl.where(k == big, tl.max(tl.where(p > 0, offs, 0), 0), k)  # no hit (rounding): last p > 0
    tl.store(tok_ptr + row, k)
    tl.store(logp_ptr + row, tl.sum(tl.where(offs == k, z, 0.), 0) - (M + tl.log(W)))


def sample_triton(logits, seed, temperature, BLOCK_V=2048):
    """(n, V) logits -> (n,) tokens drawn from softmax(logits / temperature), their (n,) log-probs;
    seed (1,) int64 on the device, advanced per call (in a CUDA graph too). Max and exp-sum per
    (row, block), then a program per row picks (one exp per id; Gumbel-max would need two logs)."""
    n, V = logits.shape
    blocks = triton.cdiv(V, BLOCK_V)
    part = torch.empty(n, blocks, 2, dtype=torch.float32, device=logits.device)
    tok = torch.empty(n, dtype=torch.long, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    _sample_blocks_kernel[(n, blocks)](logits, part, V, logits.stride(0), 1.0 / temperature,
                                       BLOCK_V=BLOCK_V, num_warps=8)
    _sample_pick_kernel[(n,)](logits, part, tok, logp, seed, V, logits.stride(0), 1.0 / temperature,
                              blocks, BLOCKS_PAD=max(16, triton.next_power_of_2(blocks)),
                              BLOCK_V=BLOCK_V, num_warps=8)
    seed.add_(1)
    return tok, logp


# bookkeeping: what a decode step records after sampling, in one Triton kernel ---------------------
def record_torch(new, lp, sl, slot, ids, logps, keep, is_eos, pad):
    """new (n,) tokens, log-probs lp (n,) land at column slot + 1 of each slot's row in ids, logps,
    keep (N, T) (finished slots: pad, 0, False); an EOS draw (is_eos (V,)) finishes its slot;
    sl.tok (n, 1) = new, and sl.pos (n, 1) and slot (1,) advance"""
    T = ids.shape[1]
    new = new.masked_fill(sl.done, pad)
    flat = sl.rows * T + slot + 1  # token index slot+1 of each slot's row
    ids.view(-1).index_copy_(0, flat, new)
    logps.view(-1).index_copy_(0, flat, lp.masked_fill(sl.done, 0))
    keep.view(-1).index_copy_(0, flat, ~sl.done)
    sl.done |= is_eos[new]
    sl.tok.copy_(new[:, None])
    sl.pos.add_(1)
    slot.add_(1)


@triton.jit
def _record_kernel(new_ptr, lp_ptr, rows_ptr, done_ptr, tok_ptr, pos_ptr, slot_ptr, ids_ptr,
                   logps_ptr, keep_ptr, is_eos_ptr, n, T, V, pad, BLOCK: tl.constexpr):
    """record_torch in one program: every slot's reads come before the one write of slot"""
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    done = tl.load(done_ptr + offs, mask=ok, other=1) != 0
    new = tl.where(done, pad, tl.load(new_ptr + offs, mask=ok, other=0))
    slot = tl.load(slot_ptr)
    flat = tl.load(rows_ptr + offs, mask=ok, other=0) * T + slot + 1
    tl.store(ids_ptr + flat, new, mask=ok)
    tl.store(logps_ptr + flat, tl.where(done, 0., tl.load(lp_ptr + offs, mask=ok, other=0.)),
             mask=ok)
    tl.store(keep_ptr + flat, done == 0, mask=ok)
    eos = tl.load(is_eos_ptr + new, mask=ok & (new >= 0) & (new < V), other=0) != 0
    tl.store(done_ptr + offs, (done | eos).to(tl.int1), mask=ok)
    tl.store(tok_ptr + offs, new, mask=ok)
    tl.store(pos_ptr + offs, tl.load(pos_ptr + offs, mask=ok, other=0) + 1, mask=ok)
    tl.debug_barrier()  # (every thread has read slot)
    tl.store(slot_ptr, slot + 1)


def record_triton(new, lp, sl, slot, ids, logps, keep, is_eos, pad):
    """record_torch as one launch (_record_kernel); the slot state tensors must be contiguous"""
    n = new.shape[0]
    assert (sl.tok.is_contiguous() and sl.pos.is_contiguous() and ids.is_contiguous()
            and keep.is_contiguous())
    _record_kernel[(1,)](new, lp, sl.rows, sl.done, sl.tok, sl.pos, slot, ids, logps, keep, is_eos,
                         n, ids.shape[1], is_eos.numel(), pad,
                         BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4)


def record(new, lp, sl, slot, ids, logps, keep, is_eos, pad):
    """a step's bookkeeping: record_triton on CUDA, record_torch elsewhere"""
    fn = record_triton if new.device.type == "cuda" else record_torch
    return fn(new, lp, sl, slot, ids, logps, keep, is_eos, pad)
