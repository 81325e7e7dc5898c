"""
A decode step's GEMM chain in one persistent CUDA kernel with per-item dependencies (issue 20, prototype: measured,
not wired into the engine; BENCHMARKS, "A megakernel prototype").

Why: at 8-16 live rows every decode GEMM pays its own chain of latencies (first HBM loads, a short K loop, the
split-K round trip, the epilogue) and the next GEMM cannot start its weight loads until that chain ends
(BENCHMARKS, "A persistent layer kernel (tried, reverted)"). Weights do not depend on anything, so here they never
wait. Each SM runs one CTA:
    W producer (1 warp)   streams the weight tiles of the CTA's items into a ring of shared-memory stages by TMA
                          (2D boxes, 128-byte swizzle), as far ahead as the ring allows, whatever the dependencies;
    x producer (1 warp)   before each stage, waits until the BK-column chunk of x it reads is written (a counter a
                          chunk, polled 32 chunks at a time), then copies it in by cp.async (not TMA: see below);
    compute (NCW warps)   mma.sync m16n8k16 over each stage, K split NCW ways; the sums go to shared memory;
    epilogue (NCW warps)  sums the K slices, runs the epilogue (residual add, or SiLU(r g) * (r u) with the norm's
                          r from the x the item streamed), stores, and bumps the chunk counter; for split K the last
                          split of a tile sums the partials in split order (the same bits whatever the arrival).
An item is (phase, output tile, K split); each CTA runs its items in the global phase order (round-robin over the
CTAs), so the earliest unfinished item can always run: no deadlock while all CTAs are resident (one an SM).

The chain, for each layer (h: the residual stream, M <= 16 rows; W_gu's columns carry the norm's weight):
    o      h_mid = h + h @ W_o^T                                 (stands in for attention's o_proj)
    gu     a     = silu(r * h_mid @ W_g^T) * (r * h_mid @ W_u^T),  r = rsqrt(mean(h_mid^2) + eps)
    down   h     = h_mid + a @ W_d^T

Second round (the defaults now; each a compile-time switch, `defines={...}` to turn it off):
    SWAPAB      W is the mma's A operand (16 weight rows) and x its B (8 rows; XN=16 past 8 live rows), both by
                ldmatrix: at M <= 8 no mma runs half empty, and a stage takes a quarter of the shared-memory loads
    XROWS       the x producer copies only the XN rows the mma reads (not 16 with zeros)
    RES_EARLY   the residual's loads are issued before the K-slice sums, not after the split-K count
    ACQREL      the split-K count is one atom.acq_rel by one thread after the barrier (no fence in every thread)
    NOPROXY     no fence.proxy.async before the signal (x is read by cp.async, the generic proxy)
Measured and off: XTMA (x by TMA), XDEFER (x's mbarrier arrivals after the next stages' copies are issued).
The kernel stamps %globaltimer into a (CTAs, items, 32) trace: 0 dependency met, 1 stage 0 in, 5 last stage in,
2 K loop done, 3 epilogue starts, 4 signalled, 6+j stage j in, 16+j x issued for stage j, 24+j x producer reaches
stage j.

    python decode_megakernel.py 1.5B "{'splits': (1, 1, 5), 'ncw': 8, 'trace': 1}"   # us a layer, + where it goes
    python decode_megakernel.py lat "{'ncw': 4, 'trace': 1}"   # three tiny GEMMs a layer: the links' latency alone
"""
import struct

import torch

BK = 256  # K columns a stage (set per shape: it must divide every K / splits)
TN = 32  # weight rows a tile: 32 output columns, or 16 gate + 16 up rows (16 columns of a)
XM = 16  # x rows a stage (the mma's M): live rows <= 16 in this prototype
NCW = 4  # compute warps
COMPILED_TORCH = True  # bench: also time the torch chain through torch.compile

CUDA_SRC = r"""
#include <cuda_bf16.h>
typedef unsigned int u32;
typedef unsigned long long u64;

// A stage holds BK / 64 sub-tiles of W (TN rows x 64 columns) and of x (XM x 64), each as TMA writes it with the
// 128-byte swizzle: row r's 16-byte chunk c lands at chunk c ^ (r % 8), so the 8 rows an mma fragment reads from
// one column hit 8 different banks.
#define NSUB (BK / 64)
#define W_BYTES (TN * BK * 2)
#define X_BYTES (XM * BK * 2)
#define STAGE_BYTES (W_BYTES + X_BYTES)

// a phase, as 16 int64 in global memory (layout: phase_record in Python)
#define P_W 0
#define P_X 1
#define P_OUT 2
#define P_RES 3
#define P_PART 4
#define P_TILES 5
#define P_DONE 6
#define P_WAIT 7
#define P_TARGET 8
#define P_N 9
#define P_K 10
#define P_SPLITS 11
#define P_KIND 12
#define P_UP 13
#define P_XPTR 14

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* b, int n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(b)), "r"(n) : "memory"); }
__device__ __forceinline__ bool mbar_test(u64* b, int parity) {
    u32 ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(smem(b)), "r"(parity) : "memory");
    return ok; }
__device__ __forceinline__ void mbar_wait(u64* b, int parity) {   // a bounded wait: a bug traps, never hangs
    for (int n = 0; !mbar_test(b, parity); ++n) if (n > (1 << 24)) asm volatile("trap;"); }
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(b)) : "memory"); }
__device__ __forceinline__ void mbar_expect(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(b)), "r"(bytes) : "memory"); }
__device__ __forceinline__ long long now() { long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
#define TRACE(i, k) if (TRACING && trace) trace[((long long)blockIdx.x * max_items + (i)) * 32 + (k)] = now()
__device__ __forceinline__ void tma_prefetch(const void* map, int col, int row) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" :: "l"(map), "r"(col), "r"(row) : "memory"); }
__device__ __forceinline__ void tma_load(void* dst, const void* map, int col, int row, u64* b) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem(dst)), "l"(map), "r"(col), "r"(row), "r"(smem(b)) : "memory"); }
// a u32 (two bf16) of a swizzled sub-tile: row r, column k (even)
__device__ __forceinline__ u32 lds(const unsigned char* tile, int r, int k) {
    return *reinterpret_cast<const u32*>(tile + r * 128 + ((((k >> 3) ^ r) & 7) << 4) + (k & 7) * 2); }
__device__ __forceinline__ int load_acquire(const int* p) {
    int v; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void epilogue_sync() { asm volatile("bar.sync 1, %0;" :: "n"(NCW * 32) : "memory"); }
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1)); }
__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }  // round as bf16
__device__ __forceinline__ float sq2(u32 v) {  // the squares of a register's two bf16
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    float lo = __low2float(h), hi = __high2float(h);
    return lo * lo + hi * hi; }

// the W boxes of stage (item i, k0) asked into L2 (no shared memory, no barrier); then the cursor moves on
__device__ __forceinline__ void prefetch_stage(const long long* phases, const int* my, int& i, int& k0, int lane) {
    if (my[3 * i] < 0) return;
    const long long* ph = phases + 16 * my[3 * i];
    int tile = my[3 * i + 1], split = my[3 * i + 2];
    int K = (int)ph[P_K], kper = K / (int)ph[P_SPLITS];
    bool glu = ph[P_KIND] == 1;
    int j = glu ? lane % NSUB : lane, half = glu ? lane / NSUB : 0;
    int row = glu ? (half ? (int)ph[P_UP] : 0) + tile * 16 : tile * TN;
    if (glu ? lane < 2 * NSUB : lane < NSUB)
        tma_prefetch(reinterpret_cast<const void*>(ph[P_W]), split * kper + k0 + j * 64, row);
    k0 += BK;
    if (k0 >= kper) { k0 = 0; ++i; }
}

extern "C" __global__ void __launch_bounds__((2 * NCW + 2) * 32, 1)
gemm_chain(const long long* phases, const int* items, int max_items, int M, double eps_d, long long* trace)
{
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char* sm = sm_raw + ((1024 - (smem(sm_raw) & 1023)) & 1023);   // the swizzle needs 1024-byte alignment
    const float eps = (float)eps_d;
    u64* full = reinterpret_cast<u64*>(sm + NSTAGE * STAGE_BYTES);   // W and x of a stage landed
    u64* empty = full + NSTAGE;                                       // the compute warps are done with a stage
    u64* red_full = empty + NSTAGE;                                   // an item's sums handed to the epilogue (2)
    u64* red_empty = red_full + 2;                                    // the epilogue is done reading them (2)
    float* red = reinterpret_cast<float*>(red_empty + 2);             // (2, NCW, XM, TN) the K slices' sums
    float* ssq = red + 2 * NCW * XM * TN;                             // (2, NCW, XM) sum of x^2 a row
    int* flag = reinterpret_cast<int*>(ssq + 2 * NCW * XM);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int* my = items + blockIdx.x * max_items * 3;

    if (threadIdx.x == 0) {
        for (int s = 0; s < NSTAGE; ++s) { mbar_init(&full[s], XTMA ? 2 : 1 + 32); mbar_init(&empty[s], NCW); }
        for (int b = 0; b < 2; ++b) { mbar_init(&red_full[b], NCW); mbar_init(&red_empty[b], 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == 2 * NCW) {                          // ---- W producer: never waits on a dependency
        int it = 0;
        int pi = 0, pk = 0;                         // the L2 prefetch cursor, PF stages ahead of the loads
        for (int n = 0; n < PF; ++n) prefetch_stage(phases, my, pi, pk, lane);
        for (int i = 0; my[3 * i] >= 0; ++i) {
            const long long* ph = phases + 16 * my[3 * i];
            int tile = my[3 * i + 1], split = my[3 * i + 2];
            int K = (int)ph[P_K], kper = K / (int)ph[P_SPLITS];
            const void* map = reinterpret_cast<const void*>(ph[P_W]);
            bool glu = ph[P_KIND] == 1;     // gate rows tile*16.., up rows P_UP + tile*16..: two 16-row boxes
            int j = glu ? lane % NSUB : lane, half = glu ? lane / NSUB : 0;
            int row = glu ? (half ? (int)ph[P_UP] : 0) + tile * 16 : tile * TN;
            bool issues = glu ? lane < 2 * NSUB : lane < NSUB;
            for (int k0 = 0; k0 < kper; k0 += BK, ++it) {
                int s = it % NSTAGE, round = it / NSTAGE;
                if (PF) prefetch_stage(phases, my, pi, pk, lane);
                if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
                if (lane == 0) mbar_expect(&full[s], NOLOAD ? 0 : W_BYTES);
                __syncwarp();
                if (issues && !NOLOAD) tma_load(sm + s * STAGE_BYTES + j * TN * 128 + half * 16 * 128, map,
                                     split * kper + k0 + j * 64, row, &full[s]);
            }
        }
    } else if (warp == 2 * NCW + 1) {               // ---- x producer: waits for the phase it reads
        int it = 0;
        unsigned pending = 0;                       // XDEFER: stages whose loads are issued, arrival not yet
#define FLUSH_X() do { for (int s2 = 0; s2 < NSTAGE; ++s2) if (pending >> s2 & 1) \
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem(&full[s2])) : "memory"); \
            pending = 0; } while (0)
        for (int i = 0; my[3 * i] >= 0; ++i) {
            const long long* ph = phases + 16 * my[3 * i];
            int split = my[3 * i + 2];
            int K = (int)ph[P_K], kper = K / (int)ph[P_SPLITS];
            const int* wait = reinterpret_cast<const int*>(ph[P_WAIT]);   // the producing phase's chunk counters
            const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(ph[P_XPTR]);
            int nst = kper / BK, c0 = split * kper / BK, ok_until = wait ? 0 : nst;
            for (int k0 = 0, j = 0; k0 < kper; k0 += BK, ++it, ++j) {
                int s = it % NSTAGE, round = it / NSTAGE, kx = split * kper + k0;
                // x[:, kx:kx+BK] must be written (every tile of its column chunk finished). The lanes poll the
                // next 32 chunks at once (one L2 round trip, not one a stage); ok_until: first chunk not seen done
                if (XDEFER && j >= ok_until) FLUSH_X();   // about to poll: let the stages already in flight count
                for (int n = 0; j >= ok_until; ++n) {
                    bool done = j + lane < nst && load_acquire(wait + c0 + j + lane) >= (int)ph[P_TARGET];
                    unsigned ready = __ballot_sync(0xffffffff, done);
                    ok_until = j + __ffs(~ready) - 1 + (ready == 0xffffffff ? 33 : 0);
                    if (j >= ok_until) {
                        if (SLEEP) __nanosleep(SLEEP);
                        if (n > (1 << 26)) asm volatile("trap;");
                    }
                }
                if (lane == 0 && k0 == 0) TRACE(i, 0);
                if (lane == 0 && j < 8) TRACE(i, 24 + j);
                if (XDEFER && round > 0 && !mbar_test(&empty[s], (round - 1) & 1)) FLUSH_X();
                if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
                // x by cp.async (the load/store path), not TMA: the SM's TMA queue is full of W loads streaming
                // from HBM, and x (on the critical path, in L2) would wait behind them. 16-byte chunks, swizzled
                // as TMA would; rows >= M filled with zeros.
                if (lane == 0 && j < 8) TRACE(i, 16 + j);
                unsigned char* xs = sm + s * STAGE_BYTES + W_BYTES;
#if XTMA
                if (lane == 0) {
                    mbar_expect(&full[s], NOLOAD ? 0 : X_BYTES);
                    for (int j2 = 0; j2 < (NOLOAD ? 0 : NSUB); ++j2)
                        tma_load(xs + j2 * XM * 128, reinterpret_cast<const void*>(ph[P_X]), kx + j2 * 64, 0, &full[s]);
                }
                continue;
#endif
                #pragma unroll
                for (int n = 0; n < (NOLOAD ? 0 : XROWS * BK / 8 / 32); ++n) {
                    int q = lane + 32 * n, r = q / (BK / 8), cc = q % (BK / 8);
                    const __nv_bfloat16* src = x + (long long)(r < M ? r : 0) * K + kx + cc * 8;
                    u32 dst = smem(xs + (cc / 8) * XM * 128 + r * 128 + (((cc % 8) ^ (r % 8)) << 4));
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(r < M ? 16 : 0)
                                 : "memory");
                }
                if (XDEFER) {   // arrive later, after the next stages' loads are issued too
                    pending |= 1u << s;
                    if (__popc(pending) >= NSTAGE - 1 || j + 1 == nst) FLUSH_X();
                } else
                    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem(&full[s])) : "memory");
            }
        }
    } else if (warp < NCW) {                        // ---- compute warps: mma over the stages, sums to red[b]
        const int g = lane / 4, t = lane % 4;
        int it = 0;
        for (int i = 0; my[3 * i] >= 0; ++i) {
            const long long* ph = phases + 16 * my[3 * i];
            int K = (int)ph[P_K], kind = (int)ph[P_KIND], kper = K / (int)ph[P_SPLITS];
#if SWAPAB
            // W as the mma's A (16 weight rows = output columns), x as B (8 x rows): no half-empty mma at M <= 8;
            // fragments by ldmatrix (one instruction a 16 x 16 W block, one an 8 x 16 x block per x tile)
            float acc[TN / 16][XN / 8][4] = {};
            float ss[XN / 8] = {};                       // sum of x^2 of row g (+ 8 per x tile)
            for (int k0 = 0; k0 < kper; k0 += BK, ++it) {
                int s = it % NSTAGE;
                mbar_wait(&full[s], (it / NSTAGE) & 1);
                if (warp == 0 && lane == 0 && k0 == 0) TRACE(i, 1);
                if (warp == 0 && lane == 0 && k0 + BK >= kper) TRACE(i, 5);
                if (warp == 0 && lane == 0 && k0 / BK < 10) TRACE(i, 6 + k0 / BK);
                const unsigned char* st = sm + s * STAGE_BYTES;
                #pragma unroll
                for (int kk = 0; kk < (NOMMA ? 0 : BK / NCW / 16); ++kk) {
                    int kc = warp * (BK / NCW) + kk * 16;
                    const unsigned char* Ws = st + (kc / 64) * TN * 128;
                    const unsigned char* Xs = st + W_BYTES + (kc / 64) * XM * 128;
                    int c0 = (kc % 64) / 8;                      // the 16-byte chunk of k = kc
                    u32 bx[XN / 8][2];
                    {   // x rows (lane % 8) (+ 8 for lanes >= 16), chunks c0 and c0 + 1
                        int r = (lane % 8) + (XN == 16 ? 8 * (lane / 16) : 0), c = c0 + (lane / 8) % 2;
                        u32 addr = smem(Xs + r * 128 + ((c ^ (r & 7)) << 4));
                        if (XN == 16) asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                            : "=r"(bx[0][0]), "=r"(bx[0][1]), "=r"(bx[XN / 8 - 1][0]), "=r"(bx[XN / 8 - 1][1]) : "r"(addr));
                        else asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                            : "=r"(bx[0][0]), "=r"(bx[0][1]) : "r"(addr));
                    }
                    if (kind == 1)
                        #pragma unroll
                        for (int nx = 0; nx < XN / 8; ++nx) ss[nx] += sq2(bx[nx][0]) + sq2(bx[nx][1]);
                    #pragma unroll
                    for (int mt = 0; mt < TN / 16; ++mt) {
                        int r = mt * 16 + (lane % 8) + 8 * ((lane / 8) % 2), c = c0 + lane / 16;
                        u32 a[4];
                        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                            : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem(Ws + r * 128 + ((c ^ (r & 7)) << 4))));
                        #pragma unroll
                        for (int nx = 0; nx < XN / 8; ++nx) mma(acc[mt][nx], a[0], a[1], a[2], a[3], bx[nx][0], bx[nx][1]);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);
            }
            int b = i % 2;
            if (warp == 0 && lane == 0) TRACE(i, 2);
            if (i >= 2) mbar_wait(&red_empty[b], (i / 2 - 1) & 1);
            float* rb = red + b * NCW * XM * TN;
            #pragma unroll
            for (int mt = 0; mt < TN / 16; ++mt)
                #pragma unroll
                for (int nx = 0; nx < XN / 8; ++nx)
                    #pragma unroll
                    for (int c = 0; c < 4; ++c)   // C = (W row mt*16 + g (+8), x row nx*8 + 2t (+1))
                        rb[(warp * XM + nx * 8 + 2 * t + (c % 2)) * TN + mt * 16 + g + (c / 2) * 8] = acc[mt][nx][c];
            #pragma unroll
            for (int nx = 0; nx < XN / 8; ++nx) {
                ss[nx] += __shfl_xor_sync(0xffffffff, ss[nx], 1); ss[nx] += __shfl_xor_sync(0xffffffff, ss[nx], 2);
                if (t == 0) ssq[(b * NCW + warp) * XM + nx * 8 + g] = ss[nx];
            }
#else
            float acc[TN / 8][4] = {};
            float ss0 = 0.f, ss1 = 0.f;                  // sum of x^2, rows g and g + 8
            for (int k0 = 0; k0 < kper; k0 += BK, ++it) {
                int s = it % NSTAGE;
                mbar_wait(&full[s], (it / NSTAGE) & 1);
                if (warp == 0 && lane == 0 && k0 == 0) TRACE(i, 1);
                if (warp == 0 && lane == 0 && k0 + BK >= kper) TRACE(i, 5);
                const unsigned char* st = sm + s * STAGE_BYTES;
                #pragma unroll
                for (int kk = 0; kk < (NOMMA ? 0 : BK / NCW / 16); ++kk) {
                    int kc = warp * (BK / NCW) + kk * 16;        // this warp's K slice of the stage
                    const unsigned char* Ws = st + (kc / 64) * TN * 128;
                    const unsigned char* Xs = st + W_BYTES + (kc / 64) * XM * 128;
                    int k = kc % 64 + 2 * t;
                    u32 a0 = lds(Xs, g, k), a1 = lds(Xs, g + 8, k), a2 = lds(Xs, g, k + 8), a3 = lds(Xs, g + 8, k + 8);
                    if (kind == 1) { ss0 += sq2(a0) + sq2(a2); ss1 += sq2(a1) + sq2(a3); }
                    #pragma unroll
                    for (int nt = 0; nt < TN / 8; ++nt)
                        mma(acc[nt], a0, a1, a2, a3, lds(Ws, nt * 8 + g, k), lds(Ws, nt * 8 + g, k + 8));
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);
            }
            int b = i % 2;
            if (warp == 0 && lane == 0) TRACE(i, 2);
            if (i >= 2) mbar_wait(&red_empty[b], (i / 2 - 1) & 1);
            float* rb = red + b * NCW * XM * TN;
            #pragma unroll
            for (int nt = 0; nt < TN / 8; ++nt)
                #pragma unroll
                for (int c = 0; c < 4; ++c)
                    rb[(warp * XM + g + (c / 2) * 8) * TN + nt * 8 + 2 * t + (c % 2)] = acc[nt][c];
            ss0 += __shfl_xor_sync(0xffffffff, ss0, 1); ss0 += __shfl_xor_sync(0xffffffff, ss0, 2);
            ss1 += __shfl_xor_sync(0xffffffff, ss1, 1); ss1 += __shfl_xor_sync(0xffffffff, ss1, 2);
            if (t == 0) { ssq[(b * NCW + warp) * XM + g] = ss0; ssq[(b * NCW + warp) * XM + g + 8] = ss1; }
#endif
            __syncwarp();
            if (lane == 0) mbar_arrive(&red_full[b]);
        }
    } else {                                        // ---- epilogue warps: sums, epilogue, stores, signals
        const int tid = threadIdx.x - NCW * 32;
        for (int i = 0; my[3 * i] >= 0; ++i) {
            const long long* ph = phases + 16 * my[3 * i];
            int tile = my[3 * i + 1], split = my[3 * i + 2];
            int K = (int)ph[P_K], splits = (int)ph[P_SPLITS], kind = (int)ph[P_KIND], N = (int)ph[P_N];
            int b = i % 2;
            mbar_wait(&red_full[b], (i / 2) & 1);
            if (tid == 0) TRACE(i, 3);
            const float* rb = red + b * NCW * XM * TN;
            const float* sb = ssq + b * NCW * XM;
            __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(ph[P_OUT]);
            int last = 1;
            if (kind == 1) {                             // a = silu(r g) * (r u), HF's roundings
                for (int e = tid; e < XM * 16; e += NCW * 32) {
                    int m = e / 16, j = e % 16;
                    if (m >= M) continue;
                    float gs = 0.f, us = 0.f, q = 0.f;
                    for (int w = 0; w < NCW; ++w) {
                        gs += rb[(w * XM + m) * TN + j]; us += rb[(w * XM + m) * TN + 16 + j]; q += sb[w * XM + m];
                    }
                    float r = rsqrtf(q / K + eps);
                    float gv = bf(gs * r), uv = bf(us * r);
                    out[(long long)m * N + tile * 16 + j] = __float2bfloat16(bf(gv / (1.f + __expf(-gv))) * uv);
                }
                epilogue_sync();
                if (tid == 0) mbar_arrive(&red_empty[b]);
            } else {                                     // h_out = res + bf16(x W^T), split K summed in order
                float* part = reinterpret_cast<float*>(ph[P_PART]);
                const __nv_bfloat16* res = reinterpret_cast<const __nv_bfloat16*>(ph[P_RES]);
                float v[XM * TN / (NCW * 32)], rv[XM * TN / (NCW * 32)];
                if (RES_EARLY)   // the residual's L2 loads in flight before the sums, not after the split count
                    for (int q = 0; q < XM * TN / (NCW * 32); ++q) {
                        int e = tid + q * NCW * 32, m = e / TN, n = e % TN;
                        rv[q] = m < M ? __bfloat162float(__ldcg(res + (long long)m * N + tile * TN + n)) : 0.f;
                    }
                for (int q = 0; q < XM * TN / (NCW * 32); ++q) {
                    int e = tid + q * NCW * 32, m = e / TN, n = e % TN;
                    v[q] = 0.f;
                    for (int w = 0; w < NCW; ++w) v[q] += rb[(w * XM + m) * TN + n];
                }
                epilogue_sync();
                if (tid == 0) mbar_arrive(&red_empty[b]);
                if (splits > 1) {
                    for (int q = 0; q < XM * TN / (NCW * 32); ++q) {
                        int e = tid + q * NCW * 32, m = e / TN, n = e % TN;
                        if (m < M) part[((long long)split * M + m) * N + tile * TN + n] = v[q];
                    }
                    if (!ACQREL) __threadfence();
                    epilogue_sync();
                    if (tid == 0) {
                        int* count = reinterpret_cast<int*>(ph[P_TILES]) + tile;
                        int old;
                        if (ACQREL)   // release the CTA's partials (ordered before by the barrier), acquire the others'
                            asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
                        else old = atomicAdd(count, 1);
                        *flag = old == splits - 1;
                        if (*flag) *count = 0;           // ready for the next launch
                        __threadfence();
                    }
                    epilogue_sync();
                    last = *flag;
                    epilogue_sync();                     // (flag is rewritten by the next item)
                }
                if (last)
                    for (int q = 0; q < XM * TN / (NCW * 32); ++q) {
                        int e = tid + q * NCW * 32, m = e / TN, n = e % TN;
                        if (m >= M) continue;
                        long long o = (long long)m * N + tile * TN + n;
                        float s = v[q];
                        if (splits > 1) {
                            s = 0.f;
                            for (int sp = 0; sp < splits; ++sp) s += __ldcg(part + (long long)sp * M * N + o);
                        }
                        out[o] = __float2bfloat16((RES_EARLY ? rv[q] : __bfloat162float(__ldcg(res + o))) + bf(s));
                    }
            }
            if (!last) continue;
            if (!NOPROXY) asm volatile("fence.proxy.async.global;" ::: "memory");   // (x is read by cp.async: generic proxy)
            epilogue_sync();
            if (tid == 0) {   // release: the CTA's stores (ordered by the barrier) before the count
                int* done = reinterpret_cast<int*>(ph[P_DONE]) + tile * (kind == 1 ? 16 : TN) / BK;
                asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(done) : "memory");
                TRACE(i, 4);
            }
        }
    }
}
"""


def tensor_map(t, box_rows):
    """A TMA descriptor (CUtensorMap, 128 bytes) for a row-major bf16 matrix t, boxes of box_rows x 64 columns
    with the 128-byte swizzle (cuTensorMapEncodeTiled through the driver library torch already loaded)."""
    import ctypes
    lib = torch.cuda._utils._get_gpu_runtime_library()
    desc = (ctypes.c_uint8 * 128)()
    rows, cols = t.shape
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * 2)
    box = (ctypes.c_uint32 * 2)(64, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    BF16, INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO = 9, 0, 3, 3, 0
    res = lib.cuTensorMapEncodeTiled(desc, BF16, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box, estr,
                                     INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO)
    assert res == 0, f"cuTensorMapEncodeTiled failed ({res}) for {tuple(t.shape)}"
    return bytes(desc)


def phase_record(W, x, out, res, part, tiles, done, wait, target, N, K, splits, kind, up, xp):
    """A phase as the kernel reads it: 16 int64 (pointers as addresses, 0 for none)."""
    ptr = lambda t: 0 if t is None else t if isinstance(t, int) else t.data_ptr()
    vals = [ptr(W), ptr(x), ptr(out), ptr(res), ptr(part), ptr(tiles), ptr(done), ptr(wait), target, N, K, splits,
            kind, up, ptr(xp), 0]
    return struct.pack("<16q", *vals)


def plan(n_items_per_phase, n_cta):
    """Items (phase, tile, split) in the global phase order, round-robin over the CTAs: (n_cta, max_items + 1, 3)
    int32, -1 after each CTA's last. Returns the table and each CTA's count."""
    lists = [[] for _ in range(n_cta)]
    r = 0
    for p, (tiles, splits) in enumerate(n_items_per_phase):
        for tile in range(tiles):
            for split in range(splits):
                lists[r % n_cta].append((p, tile, split))
                r += 1
    width = max(len(l) for l in lists) + 1
    table = torch.full((n_cta, width, 3), -1, dtype=torch.int32)
    for c, l in enumerate(lists):
        if l:
            table[c, :len(l)] = torch.tensor(l, dtype=torch.int32)
    return table, width


def chain_torch(h, layers, eps):
    """The chain in the model's ops and roundings (the gate|up weight folded: r * (h W^T) = RMSNorm(h) (W/g)^T g)."""
    for Wo, Wgu, Wd in layers:
        h = h + h @ Wo.T
        r = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
        gu = (h.float() @ Wgu.float().T * r).to(h.dtype)
        g, u = gu.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g) * u
        h = h + a @ Wd.T
    return h


class Chain:
    """Buffers, phase records and the schedule for L layers at M rows (a prototype's harness, not the engine)."""

    def __init__(self, layers, M, splits=(3, 1, 5), eps=1e-6, bk=256, nstage=None, deps=True, pf=0, sleep=32,
                 trace=False, ncw=NCW, defines=None):
        dev = layers[0][0].device
        H, I = layers[0][0].shape[0], layers[0][2].shape[1]
        self.M, self.eps, self.L = M, eps, len(layers)
        self.h = torch.zeros(XM, H, dtype=torch.bfloat16, device=dev)  # XM rows: those >= M stay zero
        self.h_mid = torch.zeros_like(self.h)
        self.a = torch.zeros(XM, I, dtype=torch.bfloat16, device=dev)
        maps = [tensor_map(self.h[:M], XM), tensor_map(self.h_mid[:M], XM), tensor_map(self.a[:M], XM)]
        for Wo, Wgu, Wd in layers:
            maps += [tensor_map(Wo, TN), tensor_map(Wgu, 16), tensor_map(Wd, TN)]
        self.maps = torch.frombuffer(bytearray(b"".join(maps)), dtype=torch.uint8).to(dev)
        mp = lambda i: self.maps.data_ptr() + 128 * i
        self.part_o = torch.zeros(splits[0] * M * H, dtype=torch.float32, device=dev)  # o(l+1) may run beside down(l)
        self.part_d = torch.zeros(splits[2] * M * H, dtype=torch.float32, device=dev)
        n_tiles = (H // TN, I // 16, H // TN)
        chunks = (H // bk, I // bk, H // bk)  # a phase's done counters: one a BK-column chunk of its output
        per_layer = sum(chunks)
        self.counters = torch.zeros(per_layer * self.L + n_tiles[0] + n_tiles[2], dtype=torch.int32, device=dev)
        tiles_o = self.counters[per_layer * self.L:per_layer * self.L + n_tiles[0]]
        tiles_d = self.counters[per_layer * self.L + n_tiles[0]:]
        done = lambda l, p: self.counters[l * per_layer + sum(chunks[:p]):]
        target = (bk // TN, bk // 16, bk // TN)  # tiles a chunk
        recs = []
        for l in range(self.L):
            wait = [None if l == 0 else done(l - 1, 2), done(l, 0), done(l, 1)]
            if not deps:  # (timing only: the raw streaming rate, wrong output)
                wait = [None, None, None]
            recs.append(phase_record(mp(3 + 3 * l), mp(0), self.h_mid, self.h, self.part_o, tiles_o, done(l, 0),
                                     wait[0], target[2], H, H, splits[0], 0, 0, self.h))
            recs.append(phase_record(mp(4 + 3 * l), mp(1), self.a, None, None, None, done(l, 1),
                                     wait[1], target[0], I, H, splits[1], 1, I, self.h_mid))
            recs.append(phase_record(mp(5 + 3 * l), mp(2), self.h, self.h_mid, self.part_d, tiles_d, done(l, 2),
                                     wait[2], target[1], H, I, splits[2], 0, 0, self.a))
        self.phases = torch.frombuffer(bytearray(b"".join(recs)), dtype=torch.int64).to(dev)
        self.n_cta = torch.cuda.get_device_properties(dev).multi_processor_count
        table, self.width = plan([(n_tiles[p % 3], splits[p % 3]) for p in range(3 * self.L)], self.n_cta)
        self.items = table.to(dev)
        for K, s in ((H, splits[0]), (H, splits[1]), (I, splits[2])):
            assert (K // s) % bk == 0, f"K {K} / {s} splits is not a multiple of BK {bk}"
        assert M <= XM
        if nstage is None:  # as many stages as shared memory holds (227 KB on sm_90)
            fixed = 2 * (ncw * XM * TN + ncw * XM) * 4 + 64 + 1024
            nstage = (232448 - fixed) // ((TN + XM) * bk * 2 + 16)
        self.nstage, self.ncw = nstage, ncw
        self.trace = torch.zeros(self.n_cta, self.width, 32, dtype=torch.int64, device=dev)  # globaltimer ns
        self.table = table
        xn = 8 if M <= 8 else 16
        d = {**dict(SWAPAB=1, XN=xn, XROWS=xn, NOPROXY=1, RES_EARLY=1, ACQREL=1), **(defines or {})}  # the best found
        if d.get("XTMA"):
            d["NOPROXY"] = 0  # x read by TMA (the async proxy) needs the writers' proxy fence
        if not d["SWAPAB"]:
            d["XROWS"] = XM
        self.kernel, self.smem = compile_chain(nstage, bk, pf, sleep, ncw, tuple(sorted(d.items())))

    def __call__(self, h):
        self.h[:self.M].copy_(h)
        self.counters.zero_()
        self.kernel(grid=(self.n_cta, 1, 1), block=((2 * self.ncw + 2) * 32, 1, 1),
                    args=[self.phases, self.items, self.width, self.M, self.eps, self.trace], shared_mem=self.smem)
        return self.h[:self.M]


_COMPILED = {}


def compile_chain(nstage, bk, pf, sleep, ncw=NCW, extra=()):
    key = (nstage, bk, pf, sleep, ncw, extra)
    if key not in _COMPILED:
        extra = dict((("XDEFER", 0), ("XTMA", 0), ("XROWS", 16), ("SWAPAB", 0), ("XN", 8), ("NOLOAD", 0), ("NOMMA", 0), ("NOPROXY", 0), ("RES_EARLY", 0), ("ACQREL", 0)) + extra)
        defines = "".join(f"#define {k} {v}\n" for k, v in extra.items()) + f"#define BK {bk}\n#define TN {TN}\n#define XM {XM}\n#define NCW {ncw}\n#define NSTAGE {nstage}\n#define PF {pf}\n#define SLEEP {sleep}\n#define TRACING 1\n"
        kernel = torch.cuda._compile_kernel(defines + CUDA_SRC, "gemm_chain", nvcc_options=["-std=c++17"])
        stage = (TN + XM) * bk * 2
        smem = nstage * stage + 2 * nstage * 8 + 32 + 2 * (ncw * XM * TN + ncw * XM) * 4 + 16 + 1024
        kernel.set_shared_memory_config(smem)
        _COMPILED[key] = (kernel, smem)
    return _COMPILED[key]


def show_trace(ch):
    """Where an item's time goes, from the last launch's globaltimer stamps: for each phase kind, the median over
    its items of (dependency met -> first stage in shared memory -> last stage computed -> epilogue starts ->
    signalled), and the median gap from a phase's last signal to the next phase's first dependency met."""
    tr, tab = ch.trace.cpu(), ch.table
    ok = tab[:, :, 0] >= 0
    ph = tab[:, :, 0][ok]
    t = tr[:, :tab.shape[1]][ok].double() / 1e3  # us
    names = ("o", "gu", "down")
    print("| phase | x wait->stage 0 | stage 0->last stage in | last stage compute | ->epilogue | epilogue+signal | "
          "phase span | gap from prev phase end |")
    print("|---|---|---|---|---|---|---|---|")
    for p in range(3):
        sel = (ph % 3 == p) & (ph >= 3)  # layers >= 1
        d = t[sel]
        med = lambda x: x.median().item()
        spans, gaps = [], []
        for l in range(1, ch.L):
            cur = t[ph == 3 * l + p]
            prev = t[ph == 3 * l + p - 1]
            spans.append((cur[:, 4].max() - cur[:, 0].min()).item())
            gaps.append((cur[:, 0].min() - prev[:, 4].max()).item())
        print(f"| {names[p]} | {med(d[:, 1] - d[:, 0]):.2f} | {med(d[:, 5] - d[:, 1]):.2f} | {med(d[:, 2] - d[:, 5]):.2f} | {med(d[:, 3] - d[:, 2]):.2f} | "
              f"{med((d[:, 4] - d[:, 3])[d[:, 4] > 0]):.2f} | {sorted(spans)[len(spans) // 2]:.2f} | {sorted(gaps)[len(gaps) // 2]:.2f} |")
    print(f"layer span (median): {((t[ph >= 3][:, 4].max() - t[ph >= 3][:, 0].min()) / (ch.L - 1)).item():.2f} us")


def chain_torch_fast(h, layers, eps):
    """The engine's way (bf16 GEMMs on cuBLAS, the norm before gate|up), for timing."""
    for Wo, Wgu, Wd in layers:
        h = h + h @ Wo.T
        x = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        g, u = (x @ Wgu.T).chunk(2, dim=-1)
        h = h + (torch.nn.functional.silu(g) * u) @ Wd.T
    return h


def graph_time(fn, iters=20):
    """us per call, best of 3, replayed from a CUDA graph."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    best = float("inf")
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / iters)
    return best


def bench(shape="1.5B", rows=(8, 16), L=28, variants=({},)):
    """us a layer of the chain: torch (eager, compiled) and each variant of the kernel, at 8 and 16 rows"""
    H, I = {"1.5B": (1536, 8960), "0.5B": (896, 4864), "lat": (1536, 512)}[shape]
    base = dict(bk=128, splits=(1, 1, 2), ncw=8) if shape == "0.5B" else dict(bk=256, splits=(1, 1, 5), ncw=8)
    if shape == "lat":  # a chain of three tiny GEMMs a layer: its time is the links' latency
        base["splits"] = (1, 1, 1)
    dev = "cuda"
    torch.manual_seed(0)
    layers = [(torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.005,
               torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
               torch.randn(H, I, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(L)]
    wbytes = sum(w.numel() * 2 for lay in layers for w in lay) / L
    b_us = wbytes / 4.8e12 * 1e6
    print(f"{shape}: {wbytes / 1e6:.1f} MB of weights a layer = {b_us:.1f} us at 4.8 TB/s; us a layer (frac)")
    print("| rows | variant | us | frac | max err |")
    print("|---|---|---|---|---|")
    for M in rows:
        h0 = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        t = graph_time(lambda: chain_torch_fast(h0, layers, 1e-6)) / L
        print(f"| {M} | torch (cuBLAS) | {t:.1f} | {b_us / t:.2f} | |")
        if COMPILED_TORCH:  # as the engine runs it: cuBLAS GEMMs, the norm, SiLU-mul and adds fused by inductor
            fast = torch.compile(chain_torch_fast, dynamic=False)
            t = graph_time(lambda: fast(h0, layers, 1e-6)) / L
            print(f"| {M} | torch.compile (cuBLAS + fused elementwise) | {t:.1f} | {b_us / t:.2f} | |", flush=True)
        ref = chain_torch(h0, layers, 1e-6)
        for v in variants:
            cfg = {**base, **v}
            ch = Chain(layers, M, **cfg)
            out = ch(h0).clone()
            torch.cuda.synchronize()
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = graph_time(lambda: ch(h0)) / L
            print(f"| {M} | {v or 'default'} nstage={ch.nstage} | {t:.1f} | {b_us / t:.2f} | {err:.1e} |", flush=True)
            if v.get("trace"):
                show_trace(ch)


if __name__ == "__main__":
    import sys
    shape = sys.argv[1] if len(sys.argv) > 1 else "1.5B"
    variants = [eval(a) for a in sys.argv[2:]] or [{}]
    bench(shape, variants=variants)
