"""The floor of a dependent link on this GPU (issue 20): how long one piece of work takes to see another's output.

    python link_latency.py

1. ping-pong: two CTAs on two SMs bounce a flag (st.release / ld.acquire at gpu scope): one-way signal latency.
2. grid link: every SM's CTA writes its slice of an (M, H) bf16 vector, signals a counter (red.release), waits until
   all CTAs have signalled, reads the whole vector from L2 and computes the next slice from it. One phase = one
   dependent all-to-all link, as between two GEMMs of a layer whose every output tile reads all of x.
3. the same link as a kernel boundary: one launch per phase, replayed from a CUDA graph.
"""
import torch

SRC = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ long long now() { long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ int ld_acq(const int* p) { int v; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ int ld_rlx(const int* p) { int v; asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_rel(int* p, int v) { asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void red_rel(int* p, int v) { asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ int smid() { int s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); return s; }

extern "C" __global__ void pingpong(int* flags, int iters, long long* out) {
    if (threadIdx.x) return;
    int me = blockIdx.x;
    long long t0 = now();
    for (int i = 1; i <= iters; ++i) {
        if (me == 0) { st_rel(flags + 0, i); while (ld_acq(flags + 1) < i) {} }
        else { while (ld_acq(flags + 0) < i) {} st_rel(flags + 1, i); }
    }
    out[me] = now() - t0;
    out[2 + me] = smid();
}

// one phase: read x (M x H bf16, all of it, from L2), write my slice of y = f(x), signal; the next phase's x is y
extern "C" __global__ void gridlink(int* counters, __nv_bfloat16* buf, int M, int H, int phases, int sleep,
                                    int per_warp, long long* out) {
    extern __shared__ float red[];
    int ncta = gridDim.x, nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int cols = (H + ncta - 1) / ncta, c0 = blockIdx.x * cols, c1 = min(H, c0 + cols);
    long long t0 = now();
    for (int p = 0; p < phases; ++p) {
        const __nv_bfloat16* x = buf + (long long)(p % 2) * M * H;
        __nv_bfloat16* y = buf + (long long)((p + 1) % 2) * M * H;
        // all of x: 16-byte loads from L2 (ld.global.cg), a sum a row (the dependence)
        float s = 0.f;
        for (int e = threadIdx.x * 8; e < M * H; e += blockDim.x * 8) {
            uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + e));
            const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
            for (int j = 0; j < 8; ++j) s += __bfloat162float(h[j]);
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        float tot = 0.f;
        for (int w = 0; w < nw; ++w) tot += red[w];
        for (int e = threadIdx.x; e < M * (c1 - c0); e += blockDim.x) {
            int m = e / (c1 - c0), c = c0 + e % (c1 - c0);
            y[(long long)m * H + c] = __float2bfloat16(tot * 1e-6f + (float)((m + c) % 7));
        }
        if (per_warp) {   // each warp releases its own stores: no CTA barrier before the signal
            __syncwarp();
            if (lane == 0) red_rel(counters + p, 1);
            if (threadIdx.x == 0) { int want = ncta * nw; while (ld_acq(counters + p) < want) if (sleep) __nanosleep(sleep); }
        } else {
            __syncthreads();
            if (threadIdx.x == 0) {
                red_rel(counters + p, 1);
                while (ld_acq(counters + p) < ncta) if (sleep) __nanosleep(sleep);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = now() - t0;
}

// the same phase as one launch (the kernel boundary is the link)
extern "C" __global__ void onephase(const __nv_bfloat16* x, __nv_bfloat16* y, int M, int H) {
    extern __shared__ float red[];
    int ncta = gridDim.x, nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int cols = (H + ncta - 1) / ncta, c0 = blockIdx.x * cols, c1 = min(H, c0 + cols);
    float s = 0.f;
    for (int e = threadIdx.x * 8; e < M * H; e += blockDim.x * 8) {
        uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + e));
        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
        for (int j = 0; j < 8; ++j) s += __bfloat162float(h[j]);
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < nw; ++w) tot += red[w];
    for (int e = threadIdx.x; e < M * (c1 - c0); e += blockDim.x) {
        int m = e / (c1 - c0), c = c0 + e % (c1 - c0);
        y[(long long)m * H + c] = __float2bfloat16(tot * 1e-6f + (float)((m + c) % 7));
    }
}
"""


def main():
    dev = "cuda"
    mk = lambda name: torch.cuda._compile_kernel(SRC, name, nvcc_options=["-std=c++17"])
    pingpong, gridlink, onephase = mk("pingpong"), mk("gridlink"), mk("onephase")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(nsm, dtype=torch.int64, device=dev)

    print("| ping-pong (2 CTAs, flag st.release / ld.acquire) | round trip us | one way us | SMs |")
    print("|---|---|---|---|")
    for _ in range(3):
        flags = torch.zeros(2, dtype=torch.int32, device=dev)
        iters = 20000
        pingpong(grid=(2, 1, 1), block=(32, 1, 1), args=[flags, iters, out])
        torch.cuda.synchronize()
        rt = out[0].item() / iters / 1e3
        print(f"| | {rt:.3f} | {rt / 2:.3f} | {out[2].item()}, {out[3].item()} |")

    print()
    print("| grid link: M x H bf16, every CTA reads all of it | CTAs | threads | sleep ns | per-warp release | us a link |")
    print("|---|---|---|---|---|---|")
    phases = 2000
    for M, H in ((8, 1536), (8, 896), (16, 1536), (8, 8960)):
        for threads, sleep, pw in ((256, 0, 0), (256, 32, 0), (256, 0, 1), (512, 0, 0), (128, 0, 0)):
            buf = torch.zeros(2 * M * H, dtype=torch.bfloat16, device=dev)
            best = 1e9
            for _ in range(3):
                counters = torch.zeros(phases, dtype=torch.int32, device=dev)
                gridlink(grid=(nsm, 1, 1), block=(threads, 1, 1),
                         args=[counters, buf, M, H, phases, sleep, pw, out], shared_mem=threads // 32 * 4)
                torch.cuda.synchronize()
                best = min(best, out.max().item() / phases / 1e3)
            print(f"| {M} x {H} | {nsm} | {threads} | {sleep} | {pw} | {best:.3f} |", flush=True)

    print()
    print("| the same link as a kernel boundary (CUDA graph of 200 launches) | us a link |")
    print("|---|---|")
    for M, H in ((8, 1536), (8, 896), (16, 1536), (8, 8960)):
        x = torch.zeros(M * H, dtype=torch.bfloat16, device=dev)
        y = torch.zeros_like(x)
        run = lambda: [onephase(grid=(nsm, 1, 1), block=(256, 1, 1), args=[(x, y)[i % 2], (y, x)[i % 2], M, H],
                                shared_mem=32) for i in range(200)]
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            run()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
        best = 1e9
        for _ in range(3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1e3 / 200)
        print(f"| {M} x {H} | {best:.3f} |", flush=True)


if __name__ == "__main__":
    main()
