"""
Fused LM-head matmul + per-token log-prob + entropy in Triton, forward and backward (an autograd
Function). Full fp32 logits (N x V, more than the model at RL batch sizes, copied by autograd) live
here only in registers, a tile at a time. Torch references: logprobs.py's naive_logprobs,
bench_logprobs.py's reference. Exact and reproducible: fp32 accumulation, fixed block sizes and no
atomics give the same bits on a rerun. Left out: autotuning (the bits would depend on its pick) and
skipping small gradients (not exact). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 set
before import (fp32/fp16).
"""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as triton.jit does

# Block sizes by dtype (tuned on an H100): a (BLOCK_N, BLOCK_V) logits tile, BLOCK_K along H
HALF = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3)  # bf16 and fp16
CONFIGS = {torch.bfloat16: HALF, torch.float16: HALF,
           torch.float32: dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=32, num_warps=4, num_stages=3)}
GROUP_N = 16  # row blocks that walk the vocab together, sharing their weight tiles through L2
EXTRA_BYTES = 480 * 2**20  # backward: dH32 + the dz workspace
PART_BYTES = 64 * 2**20  # forward: the per-split partial stats, (4, splits, N) fp32
MIN_CHUNK = 4096  # backward: the fewest vocab columns a chunk (past it memory grows instead)


# ------------------------------------------------------------------------------------------------
# Triton kernels. For hidden h (N, H), weight W (V, H), targets t (N,) and temperature T:
#     z    = h @ W.T / T                    (N, V) logits, never stored
#     lse  = logsumexp(z)                   (N,)
#     logp = z[t] - lse                     (N,)
#     ent  = lse - sum(softmax(z) * z)      (N,)
# Forward (_fwd_kernel): the grid is (row blocks) x (vocab splits). A program computes the logits
# tile of each vocab block in its split and folds it into running row stats about the max m so far:
#     s = sum exp(z - m),   w = sum exp(z - m) * (z - m)
#     when m -> m':   s' = a * s,   w' = a * (w + (m - m') * s),   a = exp(m - m')
# (w relative to m keeps the entropy exact under a large common offset.) torch merges the per-split
# stats the same way into M, S, W:   lse = M + log S,   ent = log S - W / S.
# Backward (_backward), one vocab chunk [v_lo, v_hi) at a time, for upstream grads g (of logp) and
# g_ent (of ent), with p = softmax(z) and z - sum(p * z) = log p + ent (no division: p = 0 is safe):
#     dz = (g * (onehot(t) - p) - g_ent * p * (log p + ent)) / T
# _bwd_dz_kernel recomputes the logits tile and writes dz into a workspace ws (N, Vc) in the input
# dtype; then two cuBLAS GEMMs, each over all N rows (fp32 accumulation, one rounding):
#     dW[v_lo:v_hi]  = ws.T @ h
#     dH32          += ws @ W[v_lo:v_hi]     (N, H) fp32 accumulator across chunks
# Chunks split the vocab, not the rows, because N < V: the fp32 accumulator is (N, H), not (V, H),
# and the extra memory N*H*4 (dH32) + N*Vc*elt (ws) stays under EXTRA_BYTES while N*H*4 fits.
@triton.jit
def _swizzle(pid, num_pid_n, num_pid_v, GROUP_N: tl.constexpr):
    # Grouped order (the Triton matmul tutorial): GROUP_N row blocks sweep the vocab side by side.
    num_pid_in_group = GROUP_N * num_pid_v
    group_id = pid // num_pid_in_group
    first_pid_n = group_id * GROUP_N
    group_size = min(num_pid_n - first_pid_n, GROUP_N)
    pid_n = first_pid_n + (pid % num_pid_in_group) % group_size
    pid_v = (pid % num_pid_in_group) // group_size
    return pid_n, pid_v


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, offs_n, offs_v, H, stride_hn, stride_hk, stride_wv, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # The (BLOCK_N, BLOCK_V) fp32 tile of hidden @ weight.T; offs_n, offs_v: int64, in bounds.
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_n[:, None] * stride_hn + offs_k[None, :] * stride_hk  # (BLOCK_N, BLOCK_K)
    w_ptrs = w_ptr + offs_v[None, :] * stride_wv + offs_k[:, None] * stride_wk  # (BLOCK_K, BLOCK_V)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(h_ptrs, mask=offs_k[None, :] < H - k0, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < H - k0, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    return acc


# Triton compiles a variant per "specialization" of the integer arguments (== 1, divisible by 16).
# N changes every micro-batch, and a new class would recompile both kernels mid-step: so
# fused_logprobs pads N to a multiple of 16, and the split counts are not specialized at all.
@triton.jit(do_not_specialize=["blocks_per_split", "num_splits"])
def _fwd_kernel(
    h_ptr, w_ptr, tgt_ptr, part_ptr, N, V, H, inv_temp, blocks_per_split, num_splits,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_pq, stride_ps,
    ENTROPY: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid_n, pid_s = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), num_splits, GROUP_N)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n = tl.where(mask_n, offs_n, N - 1)  # clamp: rows past N compute garbage, never stored
    tgt = tl.load(tgt_ptr + offs_n)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max
    s_i = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m)
    w_i = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
    zt_i = tl.zeros((BLOCK_N,), dtype=tl.float32)  # z[target] if target is in this split, else 0
    v_begin = pid_s * blocks_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + blocks_per_split * BLOCK_V, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        valid = offs_v < V
        offs_v_ld = tl.where(valid, offs_v, V - 1).to(tl.int64)
        z = _logits_tile(h_ptr, w_ptr, offs_n, offs_v_ld, H, stride_hn, stride_hk, stride_wv,
                         stride_wk, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION) * inv_temp
        z = tl.where(valid[None, :], z, float("-inf"))  # padded vocab: exp(-inf) = 0 adds nothing
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)  # 0 on the first block (m_i = -inf)
        e = tl.exp(z - m_new[:, None])
        if ENTROPY:
            zs = tl.where(valid[None, :], z - m_new[:, None], 0.0)  # z - m', 0 if padded (not nan)
            shift = tl.where(s_i > 0, m_i - m_new, 0.0)  # m - m', 0 on the first block (not nan)
            w_i = alpha * (w_i + shift * s_i) + tl.sum(e * zs, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        zt_i += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
        m_i = m_new
    out = part_ptr + pid_s.to(tl.int64) * stride_ps + offs_n  # part is (4, num_splits, N)
    tl.store(out, m_i, mask=mask_n)
    tl.store(out + stride_pq, s_i, mask=mask_n)
    tl.store(out + 2 * stride_pq, w_i, mask=mask_n)
    tl.store(out + 3 * stride_pq, zt_i, mask=mask_n)


# No do_not_specialize here: N is a multiple of 16, and v_lo, v_hi and ws's stride are multiples of
# BLOCK_V (or V), so a run sees one class.
@triton.jit
def _bwd_dz_kernel(
    h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, g_ptr, gent_ptr, ws_ptr, N, V, H, v_lo, v_hi, inv_temp,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_wsn,
    HAS_G: tl.constexpr, HAS_GENT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid_n, pid_v = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_hi - v_lo, BLOCK_V),
                            GROUP_N)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n = tl.where(mask_n, offs_n, N - 1)
    offs_v = v_lo + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < v_hi
    offs_v_ld = tl.where(mask_v, offs_v, v_hi - 1).to(tl.int64)
    z = _logits_tile(h_ptr, w_ptr, offs_n, offs_v_ld, H, stride_hn, stride_hk, stride_wv, stride_wk,
                     BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, DOT_PRECISION) * inv_temp
    lse = tl.load(lse_ptr + offs_n)
    logp = z - lse[:, None]  # log p, all (BLOCK_N, BLOCK_V)
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_G:  # d logp_t / dz = onehot(t) - p
        g = tl.load(g_ptr + offs_n)
        tgt = tl.load(tgt_ptr + offs_n)
        dz = g[:, None] * (tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if HAS_GENT:  # d ent / dz = -p * (z - sum(p*z)) = -p * (log p + ent)
        ge = tl.load(gent_ptr + offs_n)
        ent = tl.load(ent_ptr + offs_n)
        dz -= ge[:, None] * p * (logp + ent[:, None])
    dz = dz * inv_temp  # z = raw / T
    ws_ptrs = ws_ptr + offs_n[:, None] * stride_wsn + (offs_v - v_lo)[None, :]
    tl.store(ws_ptrs, dz.to(ws_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_v[None, :])


# checks and launch glue ---------------------------------------------------------------------------
def check_inputs(hidden, weight, targets, temperature):
    """Raise a ValueError saying what is wrong and what to pass instead (every impl calls this)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, H) like lm_head.weight, "
                         f"got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) must have H = weight.shape[1] = {weight.shape[1]}, got "
                         f"shape {tuple(hidden.shape)}; pass lm_head.weight, not its transpose")
    if hidden.dtype != weight.dtype or hidden.dtype not in CONFIGS:
        raise ValueError(f"hidden and weight must share one dtype of float32/float16/bfloat16, got "
                         f"{hidden.dtype} and {weight.dtype}; cast one to the other")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if not isinstance(temperature, (int, float)) or not (0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    V = weight.shape[0]
    if V == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if targets.numel() > 0:
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host sync
        if lo < 0 or hi >= V:
            raise ValueError(f"targets must be in [0, V={V}), got values in [{lo}, {hi}]; mask "
                             f"padding ids (e.g. -100) to a valid id and drop them from the loss")


def _launch_args(hidden, weight):
    cfg = CONFIGS[hidden.dtype]
    H = hidden.shape[1]
    meta = dict(EVEN_K=H % cfg["BLOCK_K"] == 0,
                DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else None,  # fp32: not tf32
                BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
                GROUP_N=GROUP_N, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return cfg, meta


def _forward(hidden, weight, targets, temperature, entropy):
    """hidden (N, H), weight (V, H), targets (N,) int64 -> fp32 (N,) logp, ent (or None), lse."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg, meta = _launch_args(hidden, weight)
    n_vblocks = triton.cdiv(V, cfg["BLOCK_V"])
    max_splits = max(1, PART_BYTES // (16 * N))  # (4, splits, N) fp32 under PART_BYTES
    blocks_per_split = triton.cdiv(n_vblocks, min(n_vblocks, max_splits))
    num_splits = triton.cdiv(n_vblocks, blocks_per_split)
    part = torch.empty((4, num_splits, N), dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]) * num_splits,)
    _fwd_kernel[grid](hidden, weight, targets, part, N, V, H, 1.0 / temperature, blocks_per_split,
                      num_splits, hidden.stride(0), hidden.stride(1), weight.stride(0),
                      weight.stride(1), part.stride(0), part.stride(1), ENTROPY=entropy, **meta)
    m, s, w, zt = part.unbind(0)  # (splits, N) each
    M = m.max(0).values  # merge the splits: the same rescaling as inside the kernel
    a = torch.exp(m - M)
    S = (a * s).sum(0)
    lse = M + torch.log(S)
    logp = zt.sum(0) - lse  # exactly one split holds z[target], the rest add 0
    ent = None
    if entropy:
        W = (a * (w + (m - M) * s)).sum(0)
        ent = torch.log(S) - W / S  # lse - sum(p*z) = log S - sum(p*(z - M))
    return logp, ent, lse


def _acc_dh(dH32, dz, w_c):
    """dH32 (N, H) fp32 += dz (N, vc) @ w_c (vc, H). On CUDA in bf16/fp16, one cuBLAS call adds into
    the fp32 dH32 in place (addmm's out_dtype, torch >= 2.8): no temporary, the sum stays fp32."""
    if dz.is_cuda and dz.dtype != torch.float32:
        torch.addmm(dH32, dz, w_c, torch.float32, out=dH32)
    else:
        dH32.addmm_(dz.float(), w_c.float())


def _backward(hidden, weight, targets, lse, ent, g, g_ent, temperature, need_dh, need_dw):
    """-> dH (N, H) in hidden's dtype and dW (V, H), each None unless needed (math: above)."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg, meta = _launch_args(hidden, weight)
    BV = cfg["BLOCK_V"]
    budget = EXTRA_BYTES - (N * H * 4 if need_dh else 0)  # ws's share, beside dH32
    vc_max = max(triton.cdiv(MIN_CHUNK, BV) * BV, budget // (N * hidden.element_size()) // BV * BV)
    n_chunks = triton.cdiv(V, vc_max)
    Vc = triton.cdiv(triton.cdiv(V, n_chunks), BV) * BV  # equal chunks, each a multiple of BLOCK_V
    ws = torch.empty((N, Vc), dtype=hidden.dtype, device=hidden.device)  # the bounded dz workspace
    dH32 = torch.zeros((N, H), dtype=torch.float32, device=hidden.device) if need_dh else None
    dW = torch.empty_like(weight) if need_dw else None
    dummy = lse  # stands in for absent pointers, never read (HAS_G / HAS_GENT are False then)
    for v_lo in range(0, V, Vc):
        v_hi = min(v_lo + Vc, V)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(v_hi - v_lo, BV),)
        _bwd_dz_kernel[grid](hidden, weight, targets, lse, ent if ent is not None else dummy,
                             g if g is not None else dummy, g_ent if g_ent is not None else dummy,
                             ws, N, V, H, v_lo, v_hi, 1.0 / temperature, hidden.stride(0),
                             hidden.stride(1), weight.stride(0), weight.stride(1), ws.stride(0),
                             HAS_G=g is not None, HAS_GENT=g_ent is not None, **meta)
        dz = ws[:, : v_hi - v_lo]  # (N, vc)
        if need_dw:  # all N tokens in one GEMM: fp32 accumulation inside cuBLAS, one rounding
            torch.mm(dz.t(), hidden, out=dW[v_lo:v_hi])
        if need_dh:  # dH32 += dz @ weight[v_lo:v_hi], fp32 accumulation and fp32 add
            _acc_dh(dH32, dz, weight[v_lo:v_hi])
    return (dH32.to(hidden.dtype) if need_dh else None), dW


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, entropy):
        ctx.set_materialize_grads(False)  # absent upstream grads arrive as None: no work for them
        if hidden.shape[0] == 0:
            logp = hidden.new_zeros(0, dtype=torch.float32)
            ent = hidden.new_zeros(0, dtype=torch.float32) if entropy else None
            lse = logp
        else:
            logp, ent, lse = _forward(hidden, weight, targets, temperature, entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # An all-zero upstream grad does no work: one host sync, small next to the GEMMs.
        live = [x for x in (g, g_ent) if x is not None]
        nonzero = torch.stack([x.any() for x in live]).tolist() if live else []
        if g is not None:
            g = g.contiguous().float() if nonzero.pop(0) else None
        if g_ent is not None:
            g_ent = g_ent.contiguous().float() if nonzero.pop(0) else None
        if hidden.shape[0] == 0 or (g is None and g_ent is None):
            return (torch.zeros_like(hidden) if need_dh else None,
                    torch.zeros_like(weight) if need_dw else None, None, None, None)
        dH, dW = _backward(hidden, weight, targets, lse, ent, g, g_ent, ctx.temperature,
                           need_dh, need_dw)
        return dH, dW, None, None, None


def fused_logprobs(hidden, weight, targets, temperature=1.0, entropy=True):
    """hidden (..., H) and weight (V, H) of one dtype (float32/float16/bfloat16), targets (...)
    integer ids in [0, V). Returns float32 (logp, ent) shaped like targets; ent is None (and not
    computed) when entropy=False. Differentiable w.r.t. hidden and weight, with an upstream gradient
    for each of logp and ent. N is padded to a multiple of 16 (copies hidden; see _fwd_kernel)."""
    check_inputs(hidden, weight, targets, temperature)
    if hidden.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"fused_logprobs runs Triton kernels: it needs CUDA tensors "
                           f"(got {hidden.device}) or TRITON_INTERPRET=1 set before importing "
                           f"kernel.py; on a CPU use logprobs.token_logprobs(..., impl='chunked')")
    if hidden.dtype == torch.bfloat16 and INTERPRET:
        raise ValueError("bfloat16 under TRITON_INTERPRET gives wrong tl.dot results; "
                         "use float32/float16 on a CPU or run on a GPU")
    shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    t1 = targets.reshape(-1).to(torch.int64).contiguous()  # (N,)
    n, pad = t1.numel(), -t1.numel() % 16
    if pad:  # zero rows with target 0: their logp/ent are dropped, so their gradient is 0
        h2, t1 = torch.nn.functional.pad(h2, (0, 0, 0, pad)), torch.nn.functional.pad(t1, (0, pad))
    logp, ent = _FusedLogprobs.apply(h2, weight, t1, float(temperature), bool(entropy))
    return logp[:n].view(shape), (ent[:n].view(shape) if ent is not None else None)
