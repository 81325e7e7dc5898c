"""
The decode step's GEMMs as CUDA kernels that load their weights before the PDL wait (rollout.DECODE_GEMM = "cuda").

At decode a GEMM reads its whole weight to make a few rows. Kernel by kernel, a GEMM starts reading W only once the
kernel before it has ended, so each of a layer's links (q|k|v, attention, o, gate|up, down) costs its latency on
top of the bytes (BENCHMARKS: "The floor of a dependent link"). W does not depend on the kernel before, though. Under
Hopper's programmatic dependent launch (PDL) a kernel's CTAs may start while the one before still runs, so each CTA
here first bulk-copies its W rows into shared memory, and only then waits (griddepcontrol.wait) for x:

    y = act(RMSNorm(x) @ W^T + b) + residual      act: SiLU(gate) * up on W = [gate; up] (2N, K)

    per CTA:  W chunks -> shared memory (cp.async.bulk, a ring of NST slots of KCH columns)    <- before the wait
              griddepcontrol.wait; x (M <= 16 rows, this CTA's K range) -> shared memory, normalized on the way
              as transformers rounds RMSNorm: bf16(w * bf16(x * rsqrt(mean(x^2) + eps))); launch_dependents
              for each of its 16-row tiles of W, chunk by chunk: mma.sync m16n8k16, W as A (16 x 16), x as B
              epilogue: + b, SiLU(gate) * up, + residual, each rounded to bf16 where the model's ops round
    split K (long K, few tiles: down_proj): each split stores float32 partial sums, the last to arrive (a counter a
    tile) sums them in split order, so the bits do not depend on the timing.

On an H200 a layer's four GEMMs chained this way take 19.2 us at the 0.5B shape and 8 rows against 33.2 for the
engine's torch.compile + PDL (36.7 against 51.1 at 1.5B); the same kernels launched without PDL lose. In a decode
step the gain is smaller, and only at 8 rows: -22% a step at 0.5B, -14% at 1.5B (16 rows are no faster), so rollout
runs them in buckets of <= 8 rows, opt-in (BENCHMARKS, "The weights-first CUDA GEMMs in the engine" to "The attention
in a small step").

Memory order under PDL: a kernel writes nothing before its wait (which returns once the kernel before has finished
and flushed), and lets the next kernel launch only after it has read x. Its residual is read in the epilogue, after
that: the kernels that follow one of these in the decode forward (these, the attention's, or a compiled one that
reads this output) all wait before they write.

The source is compiled at first use by NVRTC (torch.cuda._compile_kernel) for the GPU at hand, once per
configuration; sm_90 or later (PDL, cp.async.bulk), bf16, M <= 16 rows. decode_gemm.decode_linear_torch is the
reference; `python decode_cuda.py [0.5B|1.5B] [rows ...]` checks and times each GEMM and a layer's chain on a GPU.
"""
import ctypes
import sys
from typing import Optional

import torch

from decode_gemm import decode_linear_torch
from decode_kernels import counters

SRC = r"""
#include <cuda_bf16.h>
typedef unsigned int u32;
typedef unsigned long long u64;
// compile-time: K, KS (K splits), MT (8-row x tiles), NORM, GLU, NW (warps), KCH (a chunk of K), NST (ring slots),
// PW (ring stages issued before the PDL wait; the rest of the first NST once x is in)
#define KC (K / KS)                // a split's K range
#define NCH (KC / KCH)             // its chunks
#define SROWB (KCH * 2 + 16)       // a W row in a slot, padded: the 32-bit fragment loads hit distinct banks
#define XROWB (KC * 2 + 16)
#define NTILE (GLU ? 2 : 1)        // 16-row W tiles an item: gate and up rows n, N + n
#define WROWS (NTILE * 16)
#define XR (MT * 8)
#define SPLITW (NW / NTILE)        // warps on a tile, each a slice of every chunk
#define SLOT (WROWS * SROWB)
static_assert(KS == 1 || (!NORM && !GLU), "the norm and SiLU * up need the whole K in one CTA");

__device__ __forceinline__ u32 saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ u32 ld32(const unsigned char* p) { return *reinterpret_cast<const u32*>(p); }
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1)); }
__device__ __forceinline__ void expect_bytes(u64* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(saddr(bar)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory"); }
__device__ __forceinline__ void wait_bytes(u64* bar, int parity) {
    u32 ok = 0;
    while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(saddr(bar)), "r"(parity) : "memory"); }

// (the minimum of CTAs an SM: split K runs two, so <= 128 registers; without it ptxas spilled the norm at 48)
extern "C" __global__ void __launch_bounds__(NW * 32, KS > 1 ? 2 : 1)
decode_gemv(const __nv_bfloat16* W, const __nv_bfloat16* x, int ldx, const __nv_bfloat16* norm_w,
            const __nv_bfloat16* bias, const __nv_bfloat16* res, int ldr, __nv_bfloat16* y, int ldy,
            float* part, int* count, int M, int N, float eps)
{
    extern __shared__ __align__(128) unsigned char sm[];
    unsigned char* ring = sm;                                          // NST x (WROWS x SROWB)
    unsigned char* xs = sm + NST * SLOT;                                // XR x XROWB: x, normalized if NORM
    float* red = reinterpret_cast<float*>(xs + XR * XROWB);             // (NTILE, SPLITW, 16, XR) warp sums
    unsigned char* nws = reinterpret_cast<unsigned char*>(red + NTILE * SPLITW * 16 * XR);  // norm weight (K)
    __shared__ __align__(8) u64 full[NST];
    __shared__ __align__(8) u64 nbar;
#if KS > 1
    __shared__ int last;
#endif
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ntiles = (N + 15) / 16;
    const int ks = blockIdx.x % KS, t0 = blockIdx.x / KS, tstep = gridDim.x / KS;   // tiles t0, t0 + tstep, ...
    const int S = (t0 < ntiles ? (ntiles - t0 + tstep - 1) / tstep : 0) * NCH;      // stages: (item, chunk)
    if (tid == 0) {
        for (int i = 0; i < NST; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(saddr(full + i)));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(saddr(&nbar)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int s) {   // warp 0: stage s's W rows (item s / NCH, chunk s % NCH) into slot s % NST
        const int n0 = (t0 + (s / NCH) * tstep) * 16, k0 = ks * KC + (s % NCH) * KCH;
        u64* b = full + s % NST;
        if (lane == 0) expect_bytes(b, min(16, N - n0) * NTILE * KCH * 2);
        __syncwarp();
        unsigned char* dst = ring + (s % NST) * SLOT;
        for (int r = lane; r < WROWS; r += 32) {
            const int n = n0 + r % 16;
            if (n < N) bulk_copy(dst + r * SROWB, W + (long long)(r < 16 ? n : N + n) * K + k0, KCH * 2, b);
        }
    };
    // the rest of the first NST stages, once x is in: a stage a warp (warp 0 alone took ~1.3 us at 0.5B, BENCHMARKS)
    auto issue_rest = [&] { for (int s = PW + warp; s < NST && s < S; s += NW) issue(s); };
    if (warp == 0) {   // what does not depend on the kernel before: the norm's weight and the first PW stages of W
        if (NORM && lane == 0) { expect_bytes(&nbar, K * 2); bulk_copy(nws, norm_w, K * 2, &nbar); }
        for (int s = 0; s < PW && s < S; ++s) issue(s);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");   // PDL: the kernel before has finished, its writes visible
#if NORM
    {   // x and its RMSNorm in one pass, a warp a row (zero past M): each lane loads its part of the row, stores it,
        // and sums its squares; a warp sum gives rstd = rsqrt(mean(x^2) + eps) (float32, as transformers' RMSNorm);
        // each lane then rewrites its own part as bf16(w * bf16(x * rstd)). No lane reads another's, so one barrier
        // covers x and the norm (two passes over shared memory took two more: 1.3-1.8 us at 8 rows, BENCHMARKS)
        constexpr int RW = (XR + NW - 1) / NW, NV = (K / 8 + 31) / 32;   // rows a warp, uint4s a lane of a row
        uint4 v[RW][NV];
#pragma unroll
        for (int i = 0; i < RW; ++i)
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int r = warp + i * NW, c = (lane + 32 * j) * 8;
                v[i][j] = make_uint4(0, 0, 0, 0);
                if (r < M && c < K) v[i][j] = *reinterpret_cast<const uint4*>(x + (long long)r * ldx + c);
            }
        wait_bytes(&nbar, 0);
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            const int r = warp + i * NW;
            if (r >= XR) break;
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = (lane + 32 * j) * 8;
                if (c >= K) break;
                const uint4 u = v[i][j];
                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
                for (int e = 0; e < 4; ++e) { const float2 f = __bfloat1622float2(h[e]); s += f.x * f.x + f.y * f.y; }
                *reinterpret_cast<uint4*>(xs + r * XROWB + c * 2) = u;
            }
            if (i == 0)        // x is in (this warp's row; the other rows' loads left with it): the rest of W
                issue_rest();  // before the norm's math (gate|up, GLU_PREWAIT)
#pragma unroll
            for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            const float rs = rsqrtf(s / K + eps);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = (lane + 32 * j) * 8;
                if (c >= K) break;
                uint4* p = reinterpret_cast<uint4*>(xs + r * XROWB + c * 2);
                uint4 u = *p;
                __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
                const uint4 w = *reinterpret_cast<const uint4*>(nws + c * 2);
                const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(h[e]), g = __bfloat1622float2(g2[e]);
                    h[e] = __floats2bfloat162_rn(g.x * bf(f.x * rs), g.y * bf(f.y * rs));
                }
                *p = u;
            }
        }
    }
#else
    {   // x rows (zero past M), this split's K range: every load issued before any store
        constexpr int NV = XR * (KC / 8), PER = (NV + NW * 32 - 1) / (NW * 32);
        uint4 v[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + j * NW * 32, r = i / (KC / 8), c = (i % (KC / 8)) * 8;
            v[j] = make_uint4(0, 0, 0, 0);
            if (i < NV && r < M) v[j] = *reinterpret_cast<const uint4*>(x + (long long)r * ldx + ks * KC + c);
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + j * NW * 32, r = i / (KC / 8), c = (i % (KC / 8)) * 8;
            if (i < NV) *reinterpret_cast<uint4*>(xs + r * XROWB + c * 2) = v[j];
        }
    }
#endif
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // x is read: the next kernel may launch
#if !NORM
    issue_rest();
#endif
    // mma fragments (PTX m16n8k16): lane = 4 g + q holds W rows g, g + 8 at columns 2q, 2q + 1 (+ 8) and x row g
    const int g = lane / 4, q = lane % 4, ut = warp / SPLITW, us = warp % SPLITW;   // this warp's tile, K slice
    float acc[MT][4] = {};
    for (int s = 0; s < S; ++s) {
        const int item = s / NCH, ch = s % NCH;
        wait_bytes(full + s % NST, (s / NST) & 1);
        const unsigned char* ws = ring + (s % NST) * SLOT;
        const int k0 = us * (KCH / SPLITW), k1 = k0 + KCH / SPLITW;
#pragma unroll 4
        for (int k = k0; k < k1; k += 16) {
            const unsigned char* wa = ws + (ut * 16 + g) * SROWB + (k + 2 * q) * 2;
            const u32 a0 = ld32(wa), a1 = ld32(wa + 8 * SROWB), a2 = ld32(wa + 16), a3 = ld32(wa + 8 * SROWB + 16);
            const unsigned char* xb = xs + g * XROWB + (ch * KCH + k + 2 * q) * 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma(acc[mt], a0, a1, a2, a3, ld32(xb + mt * 8 * XROWB), ld32(xb + mt * 8 * XROWB + 16));
        }
        if (ch == NCH - 1) {   // the item's K is done: this warp's sums to shared memory
            float* rd = red + ((ut * SPLITW + us) * 16) * XR;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                rd[g * XR + mt * 8 + 2 * q] = acc[mt][0];
                rd[g * XR + mt * 8 + 2 * q + 1] = acc[mt][1];
                rd[(g + 8) * XR + mt * 8 + 2 * q] = acc[mt][2];
                rd[(g + 8) * XR + mt * 8 + 2 * q + 1] = acc[mt][3];
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
            }
        }
        __syncthreads();                                     // the slot is free (and an item's sums are in red)
        if (warp == 0 && s + NST < S) issue(s + NST);
        if (ch != NCH - 1) continue;
        const int tile = t0 + item * tstep, n0 = tile * 16;
        auto sum = [&](int t, int j, int m) {   // tile t's row j, x row m: over the warps' K slices, in order
            float v = 0.f;
            for (int u = 0; u < SPLITW; ++u) v += red[((t * SPLITW + u) * 16 + j) * XR + m];
            return v; };
#if KS > 1
        for (int i = tid; i < M * 16; i += NW * 32) {
            const int m = i / 16, j = i % 16, n = n0 + j;
            if (n < N) part[((long long)ks * M + m) * N + n] = sum(0, j, m);
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(count + tile, 1) == KS - 1;
        __syncthreads();
        if (last) {
            __threadfence();
            if (tid == 0) count[tile] = 0;   // reset for the next launch
#endif
            for (int i = tid; i < M * 16; i += NW * 32) {
                const int m = i / 16, j = i % 16, n = n0 + j;
                if (n >= N) continue;
#if KS > 1
                float v = 0.f;
                for (int u = 0; u < KS; ++u) v += __ldcg(part + ((long long)u * M + m) * N + n);
#else
                float v = sum(0, j, m);
#endif
                if (bias) v += __bfloat162float(bias[n]);
#if GLU
                float up = sum(1, j, m);
                if (bias) up += __bfloat162float(bias[N + n]);
                const float gate = bf(v);
                float o = bf(bf(gate / (1.f + __expf(-gate))) * bf(up));
#else
                float o = bf(v);
#endif
                if (res) o = bf(__bfloat162float(res[(long long)m * ldr + n]) + o);
                y[(long long)m * ldy + n] = __float2bfloat16(o);
            }
#if KS > 1
        }
#endif
        __syncthreads();                                     // red is free again
    }
}
"""

PDL = True  # launch with programmatic dependent launch (False: each kernel waits for the one before to end)
MAX_ROWS = 16  # M <= 16: two 8-row x tiles in the mma's n
SLOT_BYTES = 60 * 1024  # a ring slot: the largest chunk of K whose W rows fit this
WHOLE_BYTES = 180 * 1024  # a CTA's whole W in flight if it fits this (0.5B gate|up: 3 tiles, 174 KB)...
RING_BYTES = 120 * 1024  # ...else a ring of this much
GLU_BYTES = (100 * 1024, 200 * 1024)  # gate|up's slot and ring up to 8 rows: at 1.5B two slots of its whole K (1536
#                                       columns), 1.564 ms a step at 8 rows on an H200 against 1.625 with two of half K
SPLIT_KC = (1024, 2048)  # split K (no norm, no SiLU * up, K > the upper end) into ranges of this many columns
GLU_PREWAIT = 1  # gate|up's ring stages issued before the PDL wait, the rest once x is in: its whole W (17-35 MB a
#                 layer) in flight delays x's loads and the wait itself (H200, cuda GEMMs at 8 rows: a 1.5B step
#                 1.52 ms against 1.62 with every stage before the wait; 0.5B within noise; BENCHMARKS)
SERIAL_STAGES = 2  # split K in a ring of one slot (a chunk loads only after the last one's math): no plan of more
#                   stages than this, cuBLAS instead (H200, 8 rows, down_proj: 3B, 4 stages, 21.8 us against cuBLAS's
#                   18.9; 7B, 14 stages, 61.1 against 41.9; 1.5B, 2 stages, 12.1 against 13.8)
SMEM_CTA = 227 * 1024  # Hopper's shared memory: a CTA's most, and an SM's (228 KB, 1 KB reserved a CTA)
SMEM_SM = 228 * 1024


def smem_bytes(d):
    """a configuration's dynamic shared memory: the ring, x, the warps' sums, the norm's weight"""
    ntile = 2 if d["GLU"] else 1
    return (d["NST"] * ntile * 16 * (2 * d["KCH"] + 16) + d["MT"] * 8 * (2 * d["K"] // d["KS"] + 16)
            + ntile * (d["NW"] // ntile) * 16 * d["MT"] * 8 * 4 + (2 * d["K"] if d["NORM"] else 0))


def plan(M, N, K, norm, glu, sms):
    """(defines, grid) of decode_gemv for an (M, K) x (N or 2N, K) GEMM on `sms` SMs, or None where none fits (the
    caller falls back to torch). From the sweeps on an H200 (BENCHMARKS): 8 warps (4 where a split of K needs them),
    a 16-row tile of W an item, persistent CTAs (one an SM, two for split K), K unsplit but for a long K with too few
    tiles (down_proj: ranges of 1-2K columns, the split count closest to two CTAs an SM), chunks of K as large as a
    slot holds, the whole W of a CTA in flight where it fits, else a ring of RING_BYTES (gate|up at <= 8 rows:
    GLU_BYTES), all of its first stages issued before the PDL wait but gate|up's (GLU_PREWAIT of them). None too for
    a split K whose ranges fit only one slot and a CTA has more than SERIAL_STAGES of them (a large prime factor in
    K / 64: down_proj at Qwen2.5 3B and 7B): cuBLAS streams those faster"""
    if M < 1 or M > MAX_ROWS or K % 8 or N < 1:
        return None
    ntile, ntiles, mt = (2 if glu else 1), -(-N // 16), -(-M // 8)
    cands = []
    for nw in (8, 4):
        step = 16 * (nw // ntile)  # a chunk is split over the tile's warps in 16-column mma steps
        if norm or glu or K <= SPLIT_KC[1]:
            cands += [(0, 0, -nw, 1)] if K % step == 0 else []
        else:  # (ranges up to twice SPLIT_KC's end where no split count gives one in it: 3B's K = 11008 = 256 x 43)
            cands += [(K // ks > SPLIT_KC[1], abs(ntiles * ks - 2 * sms), -nw, ks) for ks in range(2, 65)
                      if K % (ks * step) == 0 and SPLIT_KC[0] <= K // ks <= 2 * SPLIT_KC[1]]
    for per_sm in (2, 1):  # split K: two CTAs an SM where some split count fits them (16 rows: a shorter range)
        for *_, neg_nw, ks in sorted(cands):  # (-nw in the key: 8 warps before 4)
            nw = -neg_nw
            kc, step = K // ks, 16 * (nw // ntile)
            if per_sm == 2 and ks == 1:
                continue
            slot_max, ring = GLU_BYTES if glu and mt == 1 else (SLOT_BYTES, RING_BYTES)
            kch = max((c for c in range(step, kc + 1, step) if kc % c == 0 and ntile * 16 * (2 * c + 16) <= slot_max),
                      default=0)
            if kch < 256:  # (a prime factor in K/step: chunks would be tiny) the whole range in one slot, if it fits
                kch = kc if ntile * 16 * (2 * kc + 16) <= 2 * slot_max else 0
            if not kch:
                continue
            slot = ntile * 16 * (2 * kch + 16)
            grid = ks * min(ntiles, max(1, per_sm * sms // ks))
            stages = -(-ntiles // (grid // ks)) * (kc // kch)
            nst = stages if stages * slot <= WHOLE_BYTES else max(1, min(stages, ring // slot))
            for nst in range(nst, 0, -1):
                d = dict(K=K, KS=ks, MT=mt, NORM=int(norm), GLU=int(glu), NW=nw, KCH=kch, NST=nst,
                         PW=min(nst, GLU_PREWAIT) if glu else nst)
                fits = smem_bytes(d) <= SMEM_CTA and per_sm * (smem_bytes(d) + 2048) <= SMEM_SM
                serial = ks > 1 and nst == 1 and stages > SERIAL_STAGES  # (each chunk's load waits on the math)
                if fits and not serial:
                    return d, grid
    return None


KERNELS = {}  # (device, defines) -> (kernel, dynamic shared memory bytes), compiled once a process


def source(d):
    return "".join(f"#define {k} {v}\n" for k, v in d.items()) + SRC


def kernel(d, device):
    key = (device.index, tuple(sorted(d.items())))
    if key not in KERNELS:
        k = torch.cuda._compile_kernel(source(d), "decode_gemv", nvcc_options=["-std=c++17"])
        smem = smem_bytes(d)
        k.set_shared_memory_config(smem)  # (above 48 KB: the opt-in attribute)
        KERNELS[key] = (k, smem)
    return KERNELS[key]


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("pad2", ctypes.c_int * 15)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("nattrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_*: the launch may overlap the kernel before (PDL)
LIBCUDA = []


def launch(k, smem, grid, threads, args):
    """cuLaunchKernelEx with PDL on the current stream (a CUDA graph captures it with its programmatic edge).
    args: tensors (or None: a null pointer), ints, floats, in the kernel's order"""
    attr = LaunchAttr(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = LaunchConfig(grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                       ctypes.pointer(attr), 1 if PDL else 0)
    vals = [ctypes.c_void_p(0 if a is None else a.data_ptr()) if a is None or isinstance(a, torch.Tensor) else
            ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    if not LIBCUDA:
        LIBCUDA.append(torch.cuda._utils._get_gpu_runtime_library())  # the driver API (libcuda)
    err = LIBCUDA[0].cuLaunchKernelEx(ctypes.byref(cfg), k.func, ptrs, None)
    if err != 0:
        raise RuntimeError(f"decode_cuda: cuLaunchKernelEx failed with CUresult {err}")


def unsupported(device, dtype):
    """why these kernels cannot run here (None if they can): sm_90+ for PDL and bulk copies, bf16, NVRTC"""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "needs a Hopper (sm_90) or later GPU"
    if dtype != torch.bfloat16:
        return f"bf16 only (the model's dtype is {dtype})"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    return None


def decode_linear_cuda(x, w, b=None, g=None, residual=None, eps=1e-6, glu=False):
    """(M, K) x, (N or 2N, K) W -> (M, N) = act(RMSNorm(x; weight g, eps) @ W^T + b) + residual in one launch (g
    None: no norm); decode_linear_torch, the reference with the same arguments, where no plan fits"""
    (M, K), N = x.shape, w.shape[0] // (2 if glu else 1)
    if x.device.type != "cuda":  # (the CPU tests run rollout's plumbing through the reference)
        return decode_linear_torch(x, w, b, g, residual, eps, glu)
    p = plan(M, N, K, g is not None, glu, torch.cuda.get_device_properties(x.device).multi_processor_count)
    ok = all(t is None or (t.stride(-1) == 1 and t.data_ptr() % 16 == 0) for t in (x, w, g, residual)) and \
        x.stride(0) % 8 == 0 and w.is_contiguous()
    if p is None or not ok:
        return decode_linear_torch(x, w, b, g, residual, eps, glu)
    d, grid = p
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part = torch.empty(d["KS"], M, N, dtype=torch.float32, device=x.device) if d["KS"] > 1 else None
    k, smem = kernel(d, x.device)
    launch(k, smem, grid, d["NW"] * 32, [w, x, x.stride(0), g, b, residual,
                                         0 if residual is None else residual.stride(0), y, y.stride(0), part,
                                         counters(x.device, -(-N // 16)), M, N, float(eps)])
    return y


@torch.library.custom_op("nanogrpo::decode_linear_cuda", mutates_args=())
def decode_linear_cuda_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], g: Optional[torch.Tensor],
                          residual: Optional[torch.Tensor], eps: float, glu: bool) -> torch.Tensor:
    """decode_linear_cuda as a torch op (torch.compile keeps the decode's parts one graph with it inside):
    x (..., K) -> (..., N)"""
    flat = lambda t: None if t is None else t.reshape(-1, t.shape[-1]).contiguous()  # noqa: E731
    return decode_linear_cuda(flat(x), w, b, g, flat(residual), eps, glu).reshape(*x.shape[:-1], -1)


@decode_linear_cuda_op.register_fake
def _(x, w, b, g, residual, eps, glu):
    return x.new_empty(*x.shape[:-1], w.shape[0] // (2 if glu else 1))


# ----------------------------------------------------------------------------------------------------------------
# check and time on a GPU: python decode_cuda.py [0.5B|1.5B] [rows ...]

SHAPES = {"0.5B": (896, 4864, 14, 2, 24), "1.5B": (1536, 8960, 12, 2, 28)}  # H, I, heads, K/V heads, layers


def graph_us(fn):
    """us a call of fn, replayed from a CUDA graph (as the decode step runs; bench_rollout.py times the same way)"""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=20) * 1e3


def layer_chain(layers, h, gemm):
    """a decode layer's four GEMMs over all layers (attention left out: o reads q's columns): gemm is
    decode_linear_cuda or decode_linear_torch (same arguments)"""
    for p in layers:
        y = gemm(h, p["qkv"], p["b"], p["n1"])
        h2 = gemm(y[:, :h.shape[1]], p["o"], None, None, h)
        a = gemm(h2, p["gu"], None, p["n2"], None, 1e-6, True)
        h = gemm(a, p["down"], None, None, h2)
    return h


def main(shape="0.5B", rows=(8, 16)):
    H, I, nq, nkv, L = SHAPES[shape]
    dev, D = torch.device("cuda"), H // nq
    why = unsupported(dev, torch.bfloat16)
    if why:
        sys.exit(f"decode_cuda: {why}")
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, sc=0.02: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen) * sc  # noqa: E731
    layers = [dict(qkv=r(H + 2 * nkv * D, H), b=r(H + 2 * nkv * D), o=r(H, H, sc=0.005), gu=r(2 * I, H),
                   down=r(H, I), n1=1 + r(H, sc=0.1), n2=1 + r(H, sc=0.1)) for _ in range(L)]  # distinct: > L2
    wbytes = sum(t.numel() * 2 for p in layers for t in p.values()) / L
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {shape}: {wbytes / 1e6:.1f} MB of weights "
          f"a layer, {wbytes / 4.8e12 * 1e6:.1f} us at 4.8 TB/s")
    print("| rows | GEMM | plan (defines, grid) | cuda us | torch us | error |\n|---|---|---|---|---|---|")
    for M in rows:
        h = r(M, H, sc=1.0)
        p = layers[0]
        gemms = [("q|k|v + norm + bias", (h, p["qkv"], p["b"], p["n1"])),
                 ("o + residual", (h, p["o"], None, None, h)),
                 ("gate|up + norm + SiLU * up", (h, p["gu"], None, p["n2"], None, 1e-6, True)),
                 ("down + residual", (r(M, I, sc=1.0), p["down"], None, None, h))]
        for name, args in gemms:
            want, got = decode_linear_torch(*args), decode_linear_cuda(*args)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            t_cuda, t_torch = graph_us(lambda: decode_linear_cuda(*args)), graph_us(lambda: decode_linear_torch(*args))
            K, glu = args[1].shape[1], len(args) > 6
            pl = plan(M, args[1].shape[0] // (2 if glu else 1), K, args[3] is not None, glu, sms)
            print(f"| {M} | {name} | {pl} | {t_cuda:.1f} | {t_torch:.1f} | {err:.1e} |", flush=True)
        want = layer_chain(layers, h, decode_linear_torch)
        got = layer_chain(layers, h, decode_linear_cuda)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        compiled = torch.compile(lambda hh: layer_chain(layers, hh, decode_linear_torch), dynamic=False,
                                 options={"triton.enable_pdl": True})
        t_cuda = graph_us(lambda: layer_chain(layers, h, decode_linear_cuda)) / L
        t_comp = graph_us(lambda: compiled(h)) / L
        print(f"| {M} | a layer's chain, {L} layers | | {t_cuda:.1f} a layer ({wbytes / 4.8e12 * 1e6 / t_cuda:.2f}) | "
              f"{t_comp:.1f} compiled + PDL ({wbytes / 4.8e12 * 1e6 / t_comp:.2f}) | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["0.5B"]), tuple(int(a) for a in sys.argv[2:]) or (8, 16))
