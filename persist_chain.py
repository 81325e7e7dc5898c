"""
Probe (issue 20; BENCHMARKS, "decode_cuda's tiles as one persistent kernel"): measured, not part of the engine.

decode_cuda's decode_gemv tiles as ONE persistent kernel over a layer chain (q|k|v, o, gate|up, down for L layers;
o reads q's columns, as decode_cuda.layer_chain). Each CTA (one an SM) walks its items phase by phase; warp 0 keeps
a ring of W stages filled across phase and layer boundaries (W never waits on anything); a phase's items wait until
every CTA has signalled the phase before (a counter a phase: threadfence + atomicAdd, then ld.acquire polling).
%globaltimer stamps per (CTA, phase) split a phase into: the wait, x in, the first item's K loop, its epilogue, the
rest of the items and the release. Question: what does a link cost once the weights are in shared memory, and what
does a persistent kernel pay instead of the PDL chain's kernel boundaries?

    python persist_chain.py 0.5B 8 4      # shape, rows, down_proj's K splits; SKIP_TORCH=1: no decode_cuda chain
    python persist_chain.py 1.5B 8 4      #   and torch.compile chain for comparison; LAYERS=n: fewer layers
"""
import os
import sys

import torch

sys.path.insert(0, ".")
import decode_cuda as dc  # noqa: E402
from decode_gemm import decode_linear_torch  # noqa: E402

SRC = r"""
#include <cuda_bf16.h>
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
// compile-time: NW warps, NST ring slots of SLOTB bytes, XK (x columns a CTA holds), NP phases, NOWAIT, MT
#define XR (MT * 8)
#define XROWB (XK * 2 + 16)
enum { F_W, F_X, F_NORM, F_BIAS, F_RES, F_Y, F_PART, F_CNT, F_LDX, F_LDR, F_LDY, F_N, F_K, F_KS, F_KCH, F_FLAGS };

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
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v; asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }

#define STAMP(c) do { if (stamps && tid == 0) { u64 t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); stamps[((i64)b * NP + q) * 8 + (c)] = t_; } } while (0)
struct Cursor { int q, j, ch; };   // phase, this CTA's j-th item in it, chunk

extern "C" __global__ void __launch_bounds__(NW * 32, 1)
chain(const i64* __restrict__ ph, int* done, int M, float eps, u64* stamps)
{
    extern __shared__ __align__(128) unsigned char sm[];
    unsigned char* ring = sm;                                   // NST x SLOTB
    unsigned char* xs = sm + NST * SLOTB;                       // XR x XROWB
    float* red = reinterpret_cast<float*>(xs + XR * XROWB);     // (NW, 16, XR)
    unsigned char* nws = reinterpret_cast<unsigned char*>(red + NW * 16 * XR);   // norm weight (XK)
    __shared__ __align__(8) u64 full[NST];
    __shared__ float rstd[XR];
    __shared__ int last;
#if PHSMEM
    __shared__ int sN[NP], sK[NP], sKS[NP], sKCH[NP], sFL[NP];
    __shared__ const __nv_bfloat16* sW[NP];
    for (int i = threadIdx.x; i < NP; i += blockDim.x) {
        const i64* p = ph + i * 16;
        sN[i] = p[F_N]; sK[i] = p[F_K]; sKS[i] = p[F_KS]; sKCH[i] = p[F_KCH]; sFL[i] = p[F_FLAGS];
        sW[i] = reinterpret_cast<const __nv_bfloat16*>(p[F_W]);
    }
#define PH(q, f) (f == F_N ? sN[q] : f == F_K ? sK[q] : f == F_KS ? sKS[q] : f == F_KCH ? sKCH[q] : sFL[q])
#else
#define PH(q, f) ((int)ph[(q) * 16 + (f)])
#endif
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, G = gridDim.x, b = blockIdx.x;
    if (tid == 0) {
        for (int i = 0; i < NST; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(saddr(full + i)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto items = [&](int q) { return ((PH(q, F_N) + 15) / 16) * PH(q, F_KS); };
    auto nch = [&](int q) { return PH(q, F_K) / PH(q, F_KS) / PH(q, F_KCH); };
    auto mine = [&](int q) { const int n = items(q); return b < n ? (n - b + G - 1) / G : 0; };
    Cursor ic = {0, 0, 0};   // warp 0's next stage to issue
    auto skip = [&](Cursor& c) { while (c.q < NP && c.j >= mine(c.q)) { c.q++; c.j = 0; c.ch = 0; } };
    skip(ic);
    int issued = 0;
    auto issue = [&]() {   // warp 0: the stage at the cursor into slot issued % NST, then advance the cursor
        if (ic.q >= NP) return;
        const int N = PH(ic.q, F_N), K = PH(ic.q, F_K), KS = PH(ic.q, F_KS), KCH = PH(ic.q, F_KCH), glu = PH(ic.q, F_FLAGS) & 1;
        const int item = b + ic.j * G, tile = item / KS, ks = item % KS, n0 = tile * 16, k0 = ks * (K / KS) + ic.ch * KCH;
        const int wrows = glu ? 32 : 16, srowb = KCH * 2 + 16;
#if PHSMEM
        const __nv_bfloat16* W = sW[ic.q];
#else
        const __nv_bfloat16* W = reinterpret_cast<const __nv_bfloat16*>(ph[ic.q * 16 + F_W]);
#endif
        u64* bar = full + issued % NST;
        if (lane == 0) expect_bytes(bar, min(16, N - n0) * (glu ? 2 : 1) * KCH * 2);
        __syncwarp();
        unsigned char* dst = ring + (issued % NST) * SLOTB;
        for (int r = lane; r < wrows; r += 32) {
            const int n = n0 + r % 16;
            if (n < N) bulk_copy(dst + r * srowb, W + (i64)(r < 16 ? n : N + n) * K + k0, KCH * 2, bar);
        }
        issued++;
        if (++ic.ch == nch(ic.q)) { ic.ch = 0; ic.j++; skip(ic); }
    };
    if (warp == 0) for (int i = 0; i < NST; ++i) issue();
    const int g = lane / 4, qd = lane % 4;
    int s = 0;   // stages consumed
    for (int q = 0; q < NP; ++q) {
        const i64* p = ph + q * 16;
        const int n_mine = mine(q);
        if (n_mine == 0) {   // nothing here: this CTA's part of the phase is done
            if (tid == 0) atomicAdd(done + q, 1);
            continue;
        }
        const int N = p[F_N], K = p[F_K], KS = p[F_KS], KCH = p[F_KCH], glu = p[F_FLAGS] & 1, norm = (p[F_FLAGS] >> 1) & 1;
        const int KC = K / KS, NCH = KC / KCH, ntile = glu ? 2 : 1, splitw = NW / ntile, srowb = KCH * 2 + 16;
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(p[F_X]);
        const __nv_bfloat16* nw = reinterpret_cast<const __nv_bfloat16*>(p[F_NORM]);
        const __nv_bfloat16* bias = reinterpret_cast<const __nv_bfloat16*>(p[F_BIAS]);
        const __nv_bfloat16* res = reinterpret_cast<const __nv_bfloat16*>(p[F_RES]);
        __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p[F_Y]);
        float* part = reinterpret_cast<float*>(p[F_PART]);
        int* count = reinterpret_cast<int*>(p[F_CNT]);
        const int ldx = p[F_LDX], ldr = p[F_LDR], ldy = p[F_LDY];
        if (norm) for (int c = tid * 8; c < K; c += NW * 256)   // the norm's weight: before the wait
            *reinterpret_cast<uint4*>(nws + c * 2) = *reinterpret_cast<const uint4*>(nw + c);
        u64 c0 = clock64();
        if (stamps && tid == 0) { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); stamps[((i64)b * NP + q) * 8 + 0] = t; }
        if (!NOWAIT && q > 0 && tid == 0) while (ld_acquire(done + q - 1) < G) {}
        __syncthreads();
        if (stamps && tid == 0) { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); stamps[((i64)b * NP + q) * 8 + 1] = t; }
        int xks = -1;
        for (int j = 0; j < n_mine; ++j) {
            const int item = b + j * G, tile = item / KS, ks = item % KS, n0 = tile * 16;
            if (ks != xks) {   // x rows (zero past M), columns of this split: L2 (.cg: other SMs wrote them)
                xks = ks;
                const int nv = XR * (KC / 8);
#if XBATCH
                constexpr int PER = (XR * (XK / 8) + NW * 32 - 1) / (NW * 32);
                uint4 v[PER];
#pragma unroll
                for (int jj = 0; jj < PER; ++jj) {
                    const int i = tid + jj * NW * 32, r = i / (KC / 8), c = (i % (KC / 8)) * 8;
                    v[jj] = make_uint4(0, 0, 0, 0);
                    if (i < nv && r < M) v[jj] = __ldcg(reinterpret_cast<const uint4*>(x + (i64)r * ldx + ks * KC + c));
                }
#pragma unroll
                for (int jj = 0; jj < PER; ++jj) {
                    const int i = tid + jj * NW * 32, r = i / (KC / 8), c = (i % (KC / 8)) * 8;
                    if (i < nv) *reinterpret_cast<uint4*>(xs + r * XROWB + c * 2) = v[jj];
                }
#else
                for (int i = tid; i < nv; i += NW * 32) {
                    const int r = i / (KC / 8), c = (i % (KC / 8)) * 8;
                    uint4 v = make_uint4(0, 0, 0, 0);
                    if (r < M) v = __ldcg(reinterpret_cast<const uint4*>(x + (i64)r * ldx + ks * KC + c));
                    *reinterpret_cast<uint4*>(xs + r * XROWB + c * 2) = v;
                }
#endif
                __syncthreads();
                if (j == 0) STAMP(4);
                if (norm) {
                    for (int r = warp; r < M; r += NW) {
                        float sq = 0.f;
                        for (int c = lane * 8; c < K; c += 256) {
                            const uint4 v = *reinterpret_cast<const uint4*>(xs + r * XROWB + c * 2);
                            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
                            for (int e = 0; e < 4; ++e) { const float2 f = __bfloat1622float2(h[e]); sq += f.x * f.x + f.y * f.y; }
                        }
                        for (int o = 16; o; o >>= 1) sq += __shfl_xor_sync(0xffffffff, sq, o);
                        if (lane == 0) rstd[r] = rsqrtf(sq / K + eps);
                    }
                    __syncthreads();
                    for (int i = tid; i < M * (K / 8); i += NW * 32) {
                        const int r = i / (K / 8), c = (i % (K / 8)) * 8;
                        uint4* pp = reinterpret_cast<uint4*>(xs + r * XROWB + c * 2);
                        uint4 v = *pp;
                        const uint4 w = *reinterpret_cast<const uint4*>(nws + c * 2);
                        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
                        const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&w);
                        for (int e = 0; e < 4; ++e) {
                            const float2 f = __bfloat1622float2(h[e]), gg = __bfloat1622float2(g2[e]);
                            h[e] = __floats2bfloat162_rn(gg.x * bf(f.x * rstd[r]), gg.y * bf(f.y * rstd[r]));
                        }
                        *pp = v;
                    }
                    __syncthreads();
                }
            }
            const int ut = warp / splitw, us = warp % splitw;
            float acc[MT][4] = {};
            for (int ch = 0; ch < NCH; ++ch, ++s) {
                wait_bytes(full + s % NST, (s / NST) & 1);
                const unsigned char* ws = ring + (s % NST) * SLOTB;
#pragma unroll 4
                for (int k = us * 16; k < KCH; k += splitw * 16) {
                    const unsigned char* wa = ws + (ut * 16 + g) * srowb + (k + 2 * qd) * 2;
                    const u32 a0 = ld32(wa), a1 = ld32(wa + 8 * srowb), a2 = ld32(wa + 16), a3 = ld32(wa + 8 * srowb + 16);
                    const unsigned char* xb = xs + g * XROWB + (ch * KCH + k + 2 * qd) * 2;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        mma(acc[mt], a0, a1, a2, a3, ld32(xb + mt * 8 * XROWB), ld32(xb + mt * 8 * XROWB + 16));
                }
                if (ch == NCH - 1) {
                    float* rd = red + (warp * 16) * XR;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        rd[g * XR + mt * 8 + 2 * qd] = acc[mt][0];
                        rd[g * XR + mt * 8 + 2 * qd + 1] = acc[mt][1];
                        rd[(g + 8) * XR + mt * 8 + 2 * qd] = acc[mt][2];
                        rd[(g + 8) * XR + mt * 8 + 2 * qd + 1] = acc[mt][3];
                    }
                }
                __syncthreads();   // the slot is free
                if (j == 0 && ch == NCH - 1) STAMP(5);
                if (warp == 0) issue();
            }
            auto sum = [&](int t, int jj, int m) {
                float v = 0.f;
                for (int u = 0; u < splitw; ++u) v += red[((t * splitw + u) * 16 + jj) * XR + m];
                return v; };
            bool fin = true;
            if (KS > 1) {
                for (int i = tid; i < M * 16; i += NW * 32) {
                    const int m = i / 16, jj = i % 16, n = n0 + jj;
                    if (n < N) part[((i64)ks * M + m) * N + n] = sum(0, jj, m);
                }
                __threadfence();
                __syncthreads();
                if (tid == 0) last = atomicAdd(count + tile, 1) == KS - 1;
                __syncthreads();
                fin = last;
                if (fin) { __threadfence(); if (tid == 0) count[tile] = 0; }
            }
            if (fin) for (int i = tid; i < M * 16; i += NW * 32) {
                const int m = i / 16, jj = i % 16, n = n0 + jj;
                if (n >= N) continue;
                float v = 0.f;
                if (KS > 1) { for (int u = 0; u < KS; ++u) v += __ldcg(part + ((i64)u * M + m) * N + n); }
                else v = sum(0, jj, m);
                if (bias) v += __bfloat162float(bias[n]);
                float o;
                if (glu) {
                    float up = sum(1, jj, m);
                    if (bias) up += __bfloat162float(bias[N + n]);
                    const float gate = bf(v);
                    o = bf(bf(gate / (1.f + __expf(-gate))) * bf(up));
                } else o = bf(v);
                if (res) o = bf(__bfloat162float(__ldcg(res + (i64)m * ldr + n)) + o);
                y[(i64)m * ldy + n] = __float2bfloat16(o);
            }
            __syncthreads();   // red is free
            if (j == 0) STAMP(6);
        }
        if (tid == 0) {
            __threadfence();
            atomicAdd(done + q, 1);
            if (stamps) { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); stamps[((i64)b * NP + q) * 8 + 2] = t;
                          stamps[((i64)b * NP + q) * 8 + 3] = clock64() - c0; }
        }
    }
}
"""

SLOTB = 60 * 1024


def kch_for(KC, wrows):
    return max(c for c in range(16, KC + 1, 16) if KC % c == 0 and wrows * (2 * c + 16) <= SLOTB)


def build(layers, h, M, down_ks):
    """phase table + buffers for the chain over `layers` (decode_cuda.main's dicts) starting from h (M, H)"""
    H = h.shape[1]
    dev = h.device
    Nq = layers[0]["qkv"].shape[0]
    I = layers[0]["down"].shape[1]
    hb = h.clone()
    y = torch.empty(M, Nq, dtype=h.dtype, device=dev)
    h2 = torch.empty(M, H, dtype=h.dtype, device=dev)
    a = torch.empty(M, I, dtype=h.dtype, device=dev)
    part = torch.empty(down_ks, M, H, dtype=torch.float32, device=dev)
    cnt = torch.zeros(-(-H // 16), dtype=torch.int32, device=dev)
    rows = []
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731

    def phase(W, x, ldx, norm, bias, res, ldr, yy, ldy, N, K, KS, glu):
        kch = kch_for(K // KS, 32 if glu else 16)
        rows.append([ptr(W), ptr(x), ptr(norm), ptr(bias), ptr(res), ptr(yy), ptr(part if KS > 1 else None),
                     ptr(cnt if KS > 1 else None), ldx, ldr, ldy, N, K, KS, kch, int(glu) | (int(norm is not None) << 1)])
    for p in layers:
        phase(p["qkv"], hb, H, p["n1"], p["b"], None, 0, y, Nq, Nq, H, 1, False)
        phase(p["o"], y, Nq, None, None, hb, H, h2, H, H, H, 1, False)
        phase(p["gu"], h2, H, p["n2"], None, None, 0, a, I, I, H, 1, True)
        phase(p["down"], a, I, None, None, h2, H, hb, H, H, I, down_ks, False)
    tab = torch.tensor(rows, dtype=torch.int64, device=dev)
    xk = max(H, I // down_ks)
    return tab, hb, xk, (y, h2, a, part, cnt)  # (keep the buffers alive: the table holds raw pointers)


def compile_chain(NP, xk, MT, nowait=0, nw=8, nst=3, xbatch=0, phsmem=0):
    smem = lambda n: n * SLOTB + MT * 8 * (xk * 2 + 16) + nw * 16 * MT * 8 * 4 + xk * 2  # noqa: E731
    while smem(nst) + 28 * NP + 256 > 227 * 1024:
        nst -= 1
    smem = smem(nst)
    d = dict(NW=nw, NST=nst, SLOTB=SLOTB, XK=xk, NP=NP, NOWAIT=nowait, MT=MT, XBATCH=xbatch, PHSMEM=phsmem)
    src = "".join(f"#define {k} {v}\n" for k, v in d.items()) + SRC
    k = torch.cuda._compile_kernel(src, "chain", nvcc_options=["-std=c++17"])
    k.set_shared_memory_config(smem)
    return k, smem, nw * 32


def main(shape="0.5B", M=8, down_ks=4):
    H, I, nq, nkv, L = dc.SHAPES[shape]
    L = int(os.environ.get("LAYERS", L))
    dev, D = torch.device("cuda"), H // nq
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, sc=0.02: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen) * sc  # noqa: E731
    mk = lambda: dict(qkv=r(H + 2 * nkv * D, H), b=r(H + 2 * nkv * D), o=r(H, H, sc=0.005), gu=r(2 * I, H),  # noqa
                      down=r(H, I), n1=1 + r(H, sc=0.1), n2=1 + r(H, sc=0.1))
    distinct = [mk() for _ in range(L)]
    same = [distinct[0]] * L
    wbytes = sum(t.numel() * 2 for t in distinct[0].values())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    h = r(M, H, sc=1.0)
    MT = -(-M // 8)
    print(f"{shape}, {M} rows, {L} layers, {wbytes / 1e6:.1f} MB a layer ({wbytes / 4.8e12 * 1e6:.1f} us at 4.8 TB/s),"
          f" down split {down_ks}, {sms} CTAs", flush=True)
    for name, layers in (("HBM (distinct layers)", distinct), ("L2 (one layer's weights repeated)", same)):
        want = dc.layer_chain(layers, h, decode_linear_torch)
        tab, hb, xk, keep = build(layers, h, M, down_ks)
        NP = tab.shape[0]
        done = torch.zeros(NP, dtype=torch.int32, device=dev)
        res = {}
        for nowait, xbatch, phsmem in ((0, 1, 0), (0, 1, 1), (1, 1, 1)):
            k, smem, thr = compile_chain(NP, xk, MT, nowait, xbatch=xbatch, phsmem=phsmem)

            def run(stamps=None):
                done.zero_()
                hb.copy_(h)
                dc.PDL, pdl = False, dc.PDL
                dc.launch(k, smem, sms, thr, [tab, done, M, 1e-6, stamps])
                dc.PDL = pdl
            print("launch", nowait, flush=True)
            run()
            torch.cuda.synchronize()
            print("synced", done.tolist()[:8], flush=True)
            err = ((hb.float() - want.float()).abs().max() / want.float().abs().max()).item()
            t = dc.graph_us(run) / L
            res[nowait] = t
            print(f"| {name} | persistent{' NOWAIT (wrong output)' if nowait else ''}{' x loads batched' if xbatch else ''}{', phase table in smem' if phsmem else ''} | {t:.1f} us a layer "
                  f"({wbytes / 4.8e12 * 1e6 / t:.2f}) | err {err:.1e} |", flush=True)
            if not nowait:
                st = torch.zeros(sms * NP * 8, dtype=torch.int64, device=dev)
                run(st)
                torch.cuda.synchronize()
                st = st.view(sms, NP, 8).cpu()
                base = st[:, :, 1][st[:, :, 2] > 0].min()
                for c_ in (0, 1, 2, 4, 5, 6):
                    st[:, :, c_] = torch.where(st[:, :, c_] > 0, st[:, :, c_] - base, 0)
                # per phase: when the dependency was met (max over CTAs of t1) and when the last CTA signalled (t2)
                beg = st[:, :, 0].float()
                met = st[:, :, 1].float()
                sig = st[:, :, 2].float()
                act = st[:, :, 2] > 0
                t0 = met[act].min()
                lines = []
                for q in range(4 * (NP > 4), 4 * (NP > 4) + 4):  # layer 1's phases
                    a_ = act[:, q]
                    lines.append(f"{['qkv', 'o', 'gu', 'down'][q % 4]}: met {((met[a_, q].min() - t0) / 1e3):.2f}-"
                                 f"{((met[a_, q].max() - t0) / 1e3):.2f} signalled {((sig[a_, q].min() - t0) / 1e3):.2f}-"
                                 f"{((sig[a_, q].max() - t0) / 1e3):.2f} us")
                ghz = (st[:, :, 3].float()[act] / (sig - beg)[act]).median().item()
                print(f"   layer 1 timeline (SM clock {ghz:.2f} GHz): " + "; ".join(lines), flush=True)
                for p_ in range(4):
                    qs = list(range(p_, NP, 4))
                    a2 = act[:, qs]
                    w_ = (met - beg)[:, qs][a2]
                    b_ = (sig - met)[:, qs][a2]
                    ph_ = lambda c1, c0: ((st[:, qs, c1] - st[:, qs, c0]).float()[a2 & (st[:, qs, c1] > 0)].median() / 1e3).item()  # noqa
                    print(f"   {['qkv', 'o', 'gu', 'down'][p_]}: wait -> x in {ph_(4, 1):.2f}, -> first item's K {ph_(5, 4):.2f}, "
                          f"-> its epilogue {ph_(6, 5):.2f}, -> signal {ph_(2, 6):.2f} us")
                    print(f"   {['qkv', 'o', 'gu', 'down'][p_]}: CTAs with items {a2.sum(0).float().mean():.0f}, "
                          f"wait median {w_.median() / 1e3:.2f} us, work after the wait median {b_.median() / 1e3:.2f} "
                          f"(p90 {b_.quantile(0.9) / 1e3:.2f}) us", flush=True)
                span = (sig[act].max() - met[act].min()) / 1e3 / (NP // 4)
                print(f"   span a layer {span:.2f} us", flush=True)
        if os.environ.get("SKIP_TORCH"):
            continue
        tc = dc.graph_us(lambda: dc.layer_chain(layers, h, dc.decode_linear_cuda)) / L
        comp = torch.compile(lambda hh: dc.layer_chain(layers, hh, decode_linear_torch), dynamic=False,
                             options={"triton.enable_pdl": True})
        tt = dc.graph_us(lambda: comp(h)) / L
        print(f"| {name} | decode_cuda chain (PDL) | {tc:.1f} | compiled torch {tt:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "0.5B", int(sys.argv[2]) if len(sys.argv) > 2 else 8,
         int(sys.argv[3]) if len(sys.argv) > 3 else 4)
