"""
The decode step's GEMMs in Triton (rollout.DECODE_GEMM = "triton"), beside their torch reference.

At decode, M = live rows (8-128): a GEMM reads its whole weight to make a few rows, so it is bandwidth-bound, and
cuBLAS pays a fixed 4-7 us per call whatever its bytes (BENCHMARKS: "Where a decode step's time goes"), plus a
launch for every norm, RoPE, SiLU-mul and residual add between the GEMMs. decode_linear runs one of a layer's four
GEMMs with the work around it in the same launch:

    q|k|v    = RoPE(RMSNorm(h) @ W_qkv^T + b)      (RMSNorm as r * (h @ (W g)^T): the norm's weight g folded
                                                    into W's columns once per rollout (fold_norm), r from the x loads;
                                                    RoPE and qwen3's q/k norms on each q/k head, v passed through)
    h        = h + o @ W_o^T + b                    (the residual add in the epilogue)
    a        = silu(x W_gate^T) * (x W_up^T),  x = RMSNorm(h)
    h        = h + a @ W_down^T

M is one tile, so each weight is read once; where there are too few output tiles to pull HBM, K is split and the
split that arrives last sums the partials in split order (the same bits whatever the timing). decode_linear_torch
is the same function in the model's own ops and roundings; nanogrpo::decode_linear is either as a torch op that
torch.compile keeps inside the decode's compiled parts. Opt-in: on an H200 with PDL on both paths, a decode step
with it is 3% faster than the default at 8 and 16 live rows at the 1.5B shape (1.65 / 1.71 ms against 1.69 / 1.75:
gate|up and down_proj at or past cuBLAS, the elementwise launches gone), no faster at 0.5B, slower from 32 rows
(q|k|v 2-4x cuBLAS's time; BENCHMARKS, "The decode-floor levers" and "The triton GEMMs under PDL"; issue 20).
"""
from typing import List, Optional

import torch
import triton
import triton.language as tl

from decode_kernels import _wait_for_previous_kernel, counters, pdl_launch


@triton.jit
def _decode_linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, part_ptr, count_ptr, pos_ptr, freq_ptr, qkn_ptr,
                          M, N, K, K_PER, eps, NQ, NQK, rope_scale, qk_eps,
                          stride_xm, stride_wn, stride_rm, stride_ym,
                          NORM: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                          ROPE: tl.constexpr, QK_NORM: tl.constexpr, HALF: tl.constexpr,
                          SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr, USE_GDC: tl.constexpr, PREFETCH: tl.constexpr):
    """program (n tile, m tile, k split): y[m, n] = epilogue(sum over the split's K range of x[m, k] W[n, k]).
    NORM (RMSNorm folded in): sum_k (x_k r g_k) W_nk = r sum_k x_k (g_k W_nk) with r = rsqrt(mean_k x_k^2 + eps):
    W arrives with g folded into its columns (fold_norm), the dot takes x as loaded, and the row scale r multiplies
    the accumulator. sum_k x_k^2 is the diagonal of x x^T, a second small dot on the same x tile: x stays in shared
    memory, as the pipelined loop loads it. (Any elementwise work on x in the loop takes it through registers before
    every dot and cost the K loop bandwidth on an H200: x * g ~40%, tl.sum(x * x) ~30%; summing x^2 in the epilogue
    instead costs its K / BLOCK_K round trips to L2 on the critical path: 3x slower q|k|v.)
    GLU: W is [gate; up] (2N, K), y = silu(a_gate) * a_up (the two rows of a pair in the same program).
    RESIDUAL: y = r + a. ROPE (q|k|v, HALF = head_dim / 2): a head's two halves are the pair, BLOCK_N columns of
    each (HALF / BLOCK_N programs a head: one head alone is too few programs to pull HBM); q and k heads (< NQK)
    are rotated at their rows' positions, x' = x cos + rotate_half(x) sin, i.e.
    lo' = lo cos - hi sin, hi' = hi cos + lo sin with angle pos * inv_freq (times rope_scale: transformers'
    attention_scaling); QK_NORM (qwen3; BLOCK_N = HALF: it needs the whole head) first takes each q or k head's
    RMSNorm (weights qkn: [q_norm; k_norm]).
    v heads pass through. SPLIT_K > 1 (few output tiles, long K: more programs to pull HBM): each split stores its
    float32 partial sums and bumps the tile's counter; the split that arrives last sums the partials in split order
    (the same bits whichever arrives last), runs the epilogue and resets the counter for the next launch.
    USE_GDC (PDL): the program may start while the kernel before it still runs; W does not depend on that kernel, so
    with PREFETCH the program first asks for its W slice into L2 (prefetch.global.L2, one per 128-byte line), then
    waits."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    head, sub = pid_n // (HALF // BLOCK_N), pid_n % (HALF // BLOCK_N)  # (ROPE only)
    offs_d = sub * BLOCK_N + tl.arange(0, BLOCK_N)  # (ROPE only) the columns' frequency index in the head half
    offs_n = (head * 2 * HALF + offs_d) if ROPE else pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    HI = HALF if ROPE else N  # the pair's second row: up (GLU) or the head's second half (ROPE)
    if USE_GDC and PREFETCH:  # (before the wait: W does not depend on the kernel before)
        _prefetch_weights(w_ptr + tl.minimum(offs_n, N - 1) * stride_wn, HI * stride_wn, GLU or ROPE,
                          pid_k * K_PER, tl.minimum(pid_k * K_PER + K_PER, K), K, BLOCK_K)
    _wait_for_previous_kernel(USE_GDC)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # (GLU, ROPE only) the pair's second row
    xx = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)  # (NORM only) x x^T over this split's K range: diagonal sum x^2
    for k0 in range(pid_k * K_PER, tl.minimum(pid_k * K_PER + K_PER, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.)  # (BLOCK_M, BLOCK_K)
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # W^T's tile (BLOCK_K, BLOCK_N)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if NORM:
            xx = tl.dot(x, tl.trans(x), xx, input_precision=PRECISION)
        if GLU or ROPE:
            w_up = tl.load(w_ptrs + HI * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
    offs_i = tl.arange(0, BLOCK_M)
    ss = tl.sum(tl.where(offs_i[:, None] == offs_i[None, :], xx, 0.), 1)  # (BLOCK_M,) the diagonal
    last = True
    if SPLIT_K > 1:  # partials (tiles, SPLIT_K, BLOCK_M, 2 BLOCK_N + 1): [acc | acc_up | ss]
        tile = pid_m * tl.num_programs(0) + pid_n
        W_P: tl.constexpr = 2 * BLOCK_N + 1
        base = part_ptr + tile * (SPLIT_K * BLOCK_M * W_P) + tl.arange(0, BLOCK_M)[:, None] * W_P
        offs_c = tl.arange(0, BLOCK_N)[None, :]
        tl.store(base + pid_k * BLOCK_M * W_P + offs_c, acc)
        if GLU or ROPE:
            tl.store(base + pid_k * BLOCK_M * W_P + BLOCK_N + offs_c, acc_up)
        if NORM:
            tl.store(base + pid_k * BLOCK_M * W_P + 2 * BLOCK_N + offs_c * 0, ss[:, None], mask=offs_c == 0)
        tl.debug_barrier()  # every thread's partials are written before the (one-thread) release below
        last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        tl.debug_barrier()  # and every thread reads the others' partials after its acquire
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            ss2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):  # in split order: deterministic
                acc += tl.load(base + s * BLOCK_M * W_P + offs_c, cache_modifier=".cg")
                if GLU or ROPE:
                    acc_up += tl.load(base + s * BLOCK_M * W_P + BLOCK_N + offs_c, cache_modifier=".cg")
                if NORM:
                    ss2 += tl.load(base + s * BLOCK_M * W_P + 2 * BLOCK_N + offs_c * 0, cache_modifier=".cg")
            ss = tl.max(ss2, 1)  # (the column was broadcast: every entry of a row is the same)
            tl.atomic_xchg(count_ptr + tile, 0)
    if last:
        if NORM:
            r = tl.rsqrt(ss / K + eps)[:, None]
            acc, acc_up = acc * r, acc_up * r
        if BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.).to(tl.float32)[None, :]
            if GLU or ROPE:
                acc_up += tl.load(b_ptr + HI + offs_n, mask=n_ok, other=0.).to(tl.float32)[None, :]
        if GLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        if ROPE:
            rotate = head < NQK  # a q or k head
            if QK_NORM:
                r_h = tl.rsqrt((tl.sum(acc * acc, 1) + tl.sum(acc_up * acc_up, 1)) / (2 * BLOCK_N) + qk_eps)[:, None]
                qkn = qkn_ptr + tl.where(head < NQ, 0, 2 * BLOCK_N)
                lo_n = acc * r_h * tl.load(qkn + offs_d).to(tl.float32)[None, :]
                hi_n = acc_up * r_h * tl.load(qkn + BLOCK_N + offs_d).to(tl.float32)[None, :]
                acc, acc_up = tl.where(rotate, lo_n, acc), tl.where(rotate, hi_n, acc_up)
            angle = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.float32)[:, None] * \
                tl.load(freq_ptr + offs_d)[None, :]  # (BLOCK_M, D/2)
            cos, sin = tl.cos(angle) * rope_scale, tl.sin(angle) * rope_scale
            lo_r, hi_r = acc * cos - acc_up * sin, acc_up * cos + acc * sin
            acc, acc_up = tl.where(rotate, lo_r, acc), tl.where(rotate, hi_r, acc_up)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + (offs_n + HI)[None, :], acc_up.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        if RESIDUAL:
            acc += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                           other=0.).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _prefetch_weights(row_ptrs, pair_offset, PAIR: tl.constexpr, k_start, k_end, K, BLOCK_K: tl.constexpr):
    """ask L2 for the W lines a program's K loop will read, without waiting for them: its rows (row_ptrs, (BLOCK_N,);
    clamped into W: an address past it would be a fault, not a no-op) and the pair's (+ pair_offset) over
    [k_start, k_end), one prefetch per 128-byte line (64 bf16)"""
    LINES: tl.constexpr = BLOCK_K // 64
    for k0 in range(k_start, k_end, BLOCK_K):
        ptrs = row_ptrs[:, None] + tl.minimum(k0 + tl.arange(0, LINES) * 64, K - 1)[None, :]  # (BLOCK_N, LINES)
        for p in tl.static_range(2 if PAIR else 1):
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs + p * pair_offset],
                                      dtype=tl.int32, is_pure=False, pack=1)


GEMM_BLOCK_K = 128  # reduction step; a stage holds BLOCK_M x BLOCK_K of x and BLOCK_N x BLOCK_K of W (twice: a pair)
ROPE_BLOCK_N = 16  # q|k|v with RoPE: columns of each head half a program (all D/2 with q/k norms: they need the head)
PREFETCH_BYTES = 16 * 2**20  # under PDL, a W up to this size is prefetched into L2 (50 MB) before the wait: on an
#                              H200 o_proj's 4.7 MB went 5.7 -> 4.8 us a call, gate|up's 55 MB 19.3 -> 24.9 (thrashed)
GEMM_WAVES = 4  # few-row GEMMs (<= 32): split K until there are ~this many programs per SM (o_proj, down_proj)


def linear_config(M, N, K, pair, device, block_n=None, n_tiles=None):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps) for a decode GEMM of N outputs (pair: two W tiles
    a step, GLU or RoPE): one m tile up to 128 rows (W is read once), BLOCK_N columns (block_n; n_tiles programs
    along N if given: RoPE's N / (2 BLOCK_N)), K split in whole BLOCK_K steps while the grid is under GEMM_WAVES x the
    SMs (<= 32 rows; 2 waves and at most 2 splits from 64 rows: the partials grow with the rows) and each split keeps
    >= 2 steps (a pair) or >= 8 (o_proj's 12 steps ran fastest unsplit, down_proj's 70 in 4). The rest is what
    `bench_rollout.py gemms sweep` and a wider time-boxed grid found on an H200 (1.5B shape, 8 / 32 / 128 rows):
    small tiles and many programs (2 warps) for few rows, deep pipelines; from 64 rows 16 columns and 8 warps for a
    short K (o_proj: 7.5 us against 11.6 with 32) and 32 columns, 4 stages, 4 warps for a long one (down_proj: 27
    against 34), gate|up's 64 x 64 tiles unsplit, 5 stages, 8 warps (42 us against 74) and q|k|v's 4 warps."""
    BM, BK = min(128, max(16, triton.next_power_of_2(M))), GEMM_BLOCK_K
    if BM <= 32:  # few rows: many small programs
        BN = block_n or (32 if pair else 16)
        waves, max_split = GEMM_WAVES, 8
        stages, warps = (3 if pair else 5), (4 if BN >= 64 else 2)  # (4 warps: RoPE's whole head half, 64 columns)
    elif pair and not block_n:  # gate|up from 64 rows: 64 x 64 tiles, unsplit
        BN, BK, waves, max_split, stages, warps = 64, 64, 2, 1, 5, 8
    elif pair:  # q|k|v (RoPE's block_n) from 64 rows
        BN, waves, max_split, stages, warps = block_n, 2, 2, 5, (4 if block_n <= 32 else 8)
    elif triton.cdiv(K, BK) <= 16:  # o_proj from 64 rows (a short K)
        BN, waves, max_split, stages, warps = 16, 2, 2, 5, 8
    else:  # down_proj from 64 rows (a long K)
        BN, waves, max_split, stages, warps = 32, 2, 2, 4, 4
    tiles = (n_tiles or triton.cdiv(N, BN)) * triton.cdiv(M, BM)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    split, min_steps = 1, (2 if pair else 8)
    while tiles * split * 2 <= waves * sms and triton.cdiv(K, BK) >= 2 * min_steps * split and split < max_split:
        split *= 2
    stages = min(stages, 200 * 1024 // ((BM + (2 if pair else 1) * BN) * BK * 2))  # x and W tiles: in shared memory
    return BM, BN, BK, split, stages, warps


def fold_norm(w, g):
    """W (N, K) with an RMSNorm's weight g (K,) folded into its columns, W g, rounded once to W's dtype: what
    decode_linear_triton reads for a GEMM behind that norm (rollout folds once per rollout)"""
    return (w.float() * g.float()[None, :]).to(w.dtype)


def decode_linear_triton(x, w, b=None, norm_eps=None, residual=None, glu=False, rope=None, config=None):
    """(M, K) x, (N or 2N, K) W -> (M, N): RMSNorm(x) (eps norm_eps, its weight already in W: fold_norm) if
    norm_eps is given, then x @ W^T + b, then
    silu(gate) * up if glu, or RoPE on the q and k heads of q|k|v if rope = (pos (M,), inv_freq (D/2,), scale,
    n_q_heads, n_k_heads, [q_norm; k_norm] (2D,) or None, its eps), then + residual (M, N); one launch
    (decode_linear_torch is the same in torch ops). config: linear_config's tuple, to override it (bench_rollout.py
    gemms; with rope, a BLOCK_N that does not divide D/2, or any but D/2 with q/k norms, is taken as D/2)."""
    M, K = x.shape
    N = w.shape[0] // (2 if glu else 1)
    assert x.stride(1) == w.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if rope is not None:  # a head's halves are the pair: BN columns of each a program
        pos, freq, rope_scale, nq, nk, qkn, qk_eps = rope
        half = freq.numel()
        BN = half if qkn is not None else min(half, ROPE_BLOCK_N)
        BM, BN, BK, split, stages, warps = config or linear_config(M, N, K, True, x.device, BN, N // (2 * BN))
        BN = BN if half % BN == 0 and (qkn is None or BN == half) else half
        grid = (N // (2 * BN), triton.cdiv(M, BM), split)
    else:
        pos = freq = qkn = None
        rope_scale, nq, nk, qk_eps = 1.0, 0, 0, 0.0
        BM, BN, BK, split, stages, warps = config or linear_config(M, N, K, glu, x.device)
        grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), split)
    part, count = y, y  # (unused without a split)
    if split > 1:
        part = torch.empty(grid[0] * grid[1] * split * BM * (2 * BN + 1), dtype=torch.float32, device=x.device)
        count = counters(x.device, grid[0] * grid[1])
    dummy = w  # (pointers a disabled branch never reads)
    _decode_linear_kernel[grid](
        x, w, dummy if b is None else b, dummy if residual is None else residual, y, part,
        count, dummy if pos is None else pos, dummy if freq is None else freq, dummy if qkn is None else qkn,
        M, N, K, triton.cdiv(triton.cdiv(K, split), BK) * BK, norm_eps or 0., nq, nq + nk, rope_scale, qk_eps,
        x.stride(0), w.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
        NORM=norm_eps is not None, GLU=glu, BIAS=b is not None, RESIDUAL=residual is not None, ROPE=rope is not None,
        QK_NORM=qkn is not None, HALF=freq.numel() if rope is not None else BN, SPLIT_K=split,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH=w.numel() * w.element_size() <= PREFETCH_BYTES, num_warps=warps, num_stages=stages,
        **pdl_launch(x.device))
    return y


def rms_norm_torch(x, weight, eps):
    """transformers' RMSNorm: float32 statistics, the normalized x back in x's dtype, then times the weight (None:
    the weight is folded into the next GEMM's W, fold_norm)"""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def decode_linear_torch(x, w, b=None, g=None, residual=None, eps=1e-6, glu=False, rope=None):
    """reference (and the CPU path): what the model's modules compute, in their order and roundings"""
    y = torch.nn.functional.linear(x if g is None else rms_norm_torch(x, g, eps), w, b)
    if glu:
        gate, up = y.chunk(2, -1)
        y = torch.nn.functional.silu(gate) * up
    if rope is not None:  # transformers' rotary embedding and apply_rotary_pos_emb, on the q and k heads
        pos, freq, scale, nq, nk, qkn, qk_eps = rope
        D = 2 * freq.numel()
        heads = y.view(y.shape[0], -1, D)  # (M, nq + nk + nv, D)
        qk = heads[:, :nq + nk]
        if qkn is not None:
            qk = torch.cat([rms_norm_torch(qk[:, :nq], qkn[:D], qk_eps), rms_norm_torch(qk[:, nq:], qkn[D:], qk_eps)],
                           1)
        angle = pos[:, None].float() * freq.float()[None, :]  # (M, D/2)
        cos = (torch.cat([angle, angle], -1).cos() * scale).to(y.dtype)[:, None, :]
        sin = (torch.cat([angle, angle], -1).sin() * scale).to(y.dtype)[:, None, :]
        qk = qk * cos + torch.cat([-qk[..., D // 2:], qk[..., :D // 2]], -1) * sin
        y = torch.cat([qk, heads[:, nq + nk:]], 1).reshape(y.shape)
    return y if residual is None else residual + y


@torch.library.custom_op("nanogrpo::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], norm: bool,
                     residual: Optional[torch.Tensor], eps: float, glu: bool, impl: str,
                     pos: Optional[torch.Tensor] = None, inv_freq: Optional[torch.Tensor] = None,
                     qk_norm: Optional[torch.Tensor] = None, heads: Optional[List[int]] = None,
                     rope_scale: float = 1.0, qk_eps: float = 0.0) -> torch.Tensor:
    """decode_linear_triton (impl "triton") or decode_linear_torch as a torch op, so that torch.compile keeps each
    of the decode's parts one graph with it inside. x (..., K) -> (..., N); norm: an RMSNorm (eps) in front, its
    weight folded into W (fold_norm); RoPE when pos is given (heads: [n_q, n_k])"""
    lead = x.shape[:-1]
    flat = lambda t: None if t is None else t.reshape(-1, t.shape[-1])  # noqa: E731
    rope = None if pos is None else (pos.reshape(-1), inv_freq, rope_scale, heads[0], heads[1], qk_norm, qk_eps)
    if impl == "triton":
        return decode_linear_triton(flat(x), w, b, eps if norm else None, flat(residual), glu, rope).reshape(*lead, -1)
    g = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if norm else None  # (W carries the weight)
    return decode_linear_torch(flat(x), w, b, g, flat(residual), eps, glu, rope).reshape(*lead, -1)


@decode_linear_op.register_fake
def _(x, w, b, norm, residual, eps, glu, impl, pos=None, inv_freq=None, qk_norm=None, heads=None, rope_scale=1.0,
      qk_eps=0.0):
    return x.new_empty(*x.shape[:-1], w.shape[0] // (2 if glu else 1))
