"""Probe (issue 20; committed to be reverted, BENCHMARKS "What a step's floor is made of"): the floor of a point-to-point dependent link against the all-to-all one.
Every SM's CTA owns a slice (M rows x C columns, bf16) of a vector; in phase p it waits for the flags of K producer
CTAs of phase p-1, reads their slices (L2), sums them, writes its own slice of phase p, releases its flag.
K = all CTAs is the all-to-all link of link_latency.py (d09c6f8); K = 1..16 is what a split-K consumer needs. Then the same with LL messages (NCCL's low-latency idea: each 8-byte
word carries two bf16 and the phase, and the consumer polls the data itself). One H200: python link_p2p.py"""
import torch

SRC = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ long long now() { long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ int ld_acq(const int* p) { int v; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_rel(int* p, int v) { asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }

extern "C" __global__ void p2p(int* flags, __nv_bfloat16* buf, int slice, int K, int stride, int phases,
                               long long* out) {
    __shared__ float red[32];
    int n = gridDim.x, me = blockIdx.x, nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long t0 = now();
    for (int p = 1; p <= phases; ++p) {
        const __nv_bfloat16* x = buf + (long long)(p - 1) * n * slice;
        __nv_bfloat16* y = buf + (long long)p * n * slice;
        for (int j = threadIdx.x; j < K; j += blockDim.x) {   // wait for my K producers of phase p-1
            int prod = (me + j * stride) % n;
            while (ld_acq(flags + (long long)(p - 1) * n + prod) == 0) {}
        }
        __syncthreads();
        float s = 0.f;
        for (int e = threadIdx.x * 8; e < K * slice; e += blockDim.x * 8) {   // their slices, 16-byte loads from L2
            int j = e / slice, off = e % slice, prod = (me + j * stride) % n;
            uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + (long long)prod * slice + off));
            const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
            for (int q = 0; q < 8; ++q) s += __bfloat162float(h[q]);
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        float tot = 0.f;
        for (int w = 0; w < nw; ++w) tot += red[w];
        for (int e = threadIdx.x; e < slice; e += blockDim.x)
            y[(long long)me * slice + e] = __float2bfloat16(tot * 1e-6f + (float)(e % 7));
        __syncthreads();
        if (threadIdx.x == 0) { __threadfence(); st_rel(flags + (long long)p * n + me, 1); }
    }
    if (threadIdx.x == 0) out[me] = now() - t0;
}

// NCCL's LL idea: each 8-byte word carries 2 bf16 values and the phase tag; the consumer polls the data itself
// (no flag, no fence, no barrier before the read): one-way latency per hop
extern "C" __global__ void ll(unsigned long long* buf, int words, int K, int stride, int phases, int nofence,
                              long long* out) {
    __shared__ float red[32];
    int n = gridDim.x, me = blockIdx.x, nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long t0 = now();
    for (int p = 1; p <= phases; ++p) {
        const volatile unsigned long long* x = buf + (long long)(p - 1) * n * words;
        unsigned long long* y = buf + (long long)p * n * words;
        float s = 0.f;
        for (int e = threadIdx.x; e < K * words; e += blockDim.x) {
            int j = e / words, off = e % words, prod = (me + j * stride) % n;
            unsigned long long v;
            do { v = x[(long long)prod * words + off]; } while ((unsigned)(v >> 32) != (unsigned)(p - 1));
            unsigned d = (unsigned)v;
            s += __uint_as_float(d << 16) + __uint_as_float(d & 0xffff0000u);
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        float tot = 0.f;
        for (int w = 0; w < nw; ++w) tot += red[w];
        __syncthreads();
        for (int e = threadIdx.x; e < words; e += blockDim.x) {
            unsigned d = (unsigned)__float_as_uint(tot * 1e-6f + (float)(e % 7)) & 0xffff0000u;
            y[(long long)me * words + e] = ((unsigned long long)(unsigned)p << 32) | d;
        }
    }
    if (threadIdx.x == 0) out[me] = now() - t0;
}

// the same with each thread's words loaded 4 at a time (independent loads in flight), re-polling only stale ones
extern "C" __global__ void ll4(unsigned long long* buf, int words, int K, int stride, int phases, int unused,
                               long long* out) {
    __shared__ float red[32];
    int n = gridDim.x, me = blockIdx.x, nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long t0 = now();
    for (int p = 1; p <= phases; ++p) {
        const volatile unsigned long long* x = buf + (long long)(p - 1) * n * words;
        unsigned long long* y = buf + (long long)p * n * words;
        float s = 0.f;
        for (int e0 = threadIdx.x; e0 < K * words; e0 += 4 * blockDim.x) {
            unsigned long long v[4];
            long long a[4];
            bool ok[4];
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                int e = e0 + u * blockDim.x;
                int j = e / words, off = e % words, prod = (me + j * stride) % n;
                a[u] = (long long)prod * words + off;
                ok[u] = e >= K * words;
            }
            bool all;
            do {
                #pragma unroll
                for (int u = 0; u < 4; ++u) if (!ok[u]) v[u] = x[a[u]];
                all = true;
                #pragma unroll
                for (int u = 0; u < 4; ++u) if (!ok[u]) { ok[u] = (unsigned)(v[u] >> 32) == (unsigned)(p - 1);
                    if (ok[u]) { unsigned d = (unsigned)v[u]; s += __uint_as_float(d << 16) + __uint_as_float(d & 0xffff0000u); }
                    all = all && ok[u]; }
            } while (!all);
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        float tot = 0.f;
        for (int w = 0; w < nw; ++w) tot += red[w];
        __syncthreads();
        for (int e = threadIdx.x; e < words; e += blockDim.x) {
            unsigned d = (unsigned)__float_as_uint(tot * 1e-6f + (float)(e % 7)) & 0xffff0000u;
            y[(long long)me * words + e] = ((unsigned long long)(unsigned)p << 32) | d;
        }
    }
    if (threadIdx.x == 0) out[me] = now() - t0;
}
"""


def main():
    dev = "cuda"
    k = torch.cuda._compile_kernel(SRC, "p2p", nvcc_options=["-std=c++17"])
    n = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(n, dtype=torch.int64, device=dev)
    phases = 2000
    print(f"| slice (M x C bf16) | producers K | threads | us a link (best of 3, {phases} phases, {n} CTAs) |")
    print("|---|---|---|---|")
    for M, C in ((8, 8), (8, 64), (16, 64)):
        slice_ = M * C
        for K in (1, 2, 4, 8, 16, 32, n):
            for threads in (256, 512):
                buf = torch.zeros((phases + 1) * n * slice_, dtype=torch.bfloat16, device=dev)
                best = 1e9
                for _ in range(3):
                    flags = torch.zeros((phases + 1) * n, dtype=torch.int32, device=dev)
                    flags[:n] = 1  # phase 0's input is ready
                    k(grid=(n, 1, 1), block=(threads, 1, 1), args=[flags, buf, slice_, K, 7, phases, out])
                    torch.cuda.synchronize()
                    best = min(best, out.max().item() / phases / 1e3)
                print(f"| {M} x {C} | {K} | {threads} | {best:.3f} |", flush=True)


def main_ll(name="ll"):
    dev = "cuda"
    k = torch.cuda._compile_kernel(SRC, name, nvcc_options=["-std=c++17"])
    n = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(n, dtype=torch.int64, device=dev)
    phases = 2000
    print(f"| {name} words: slice (M x C bf16) | producers K | threads | us a link |")
    print("|---|---|---|---|")
    for M, C in ((8, 8), (8, 64), (16, 64)):
        words = M * C // 2
        for K in (1, 2, 4, 8, 16, 32, n):
            for threads in (256, 512):
                best = 1e9
                for _ in range(3):
                    buf = torch.zeros((phases + 1) * n * words, dtype=torch.int64, device=dev)  # tag 0: phase 0
                    k(grid=(n, 1, 1), block=(threads, 1, 1), args=[buf, words, K, 7, phases, 0, out])
                    torch.cuda.synchronize()
                    best = min(best, out.max().item() / phases / 1e3)
                print(f"| {M} x {C} | {K} | {threads} | {best:.3f} |", flush=True)


if __name__ == "__main__":
    main()
    main_ll()
    main_ll('ll4')
