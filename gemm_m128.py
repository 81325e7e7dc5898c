"""Probe (issue 20; committed to be reverted, BENCHMARKS "What a step's floor is made of"): can a plain Triton GEMM
beat cuBLAS on the decode GEMMs at M = 32..128 rows? y = x @ W^T, W (N, K), bf16; 72 tiles swept a case (split K by
fp32 atomics: the zeroed output and its cast are not timed), timed from a CUDA graph over weight copies that
overflow L2. One H200: python gemm_m128.py [0.5B] [1.5B]"""
import itertools, sys, time
import torch, triton, triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def mm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    kper = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(pid_s * kper, tl.minimum(pid_s * kper + kper, K), BK):
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLIT == 1:
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=offs_m[:, None] < M)
    else:
        tl.atomic_add(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=offs_m[:, None] < M, sem="relaxed")


def run(x, w, y, cfg):
    BM, BN, BK, S, st, wp = cfg
    M, K = x.shape
    N = w.shape[0]
    mm_kernel[(N // BN, triton.cdiv(M, BM), S)](x, w, y, M, N, K, S, BM, BN, BK, num_stages=st, num_warps=wp)


SH = {"0.5B": (896, 14, 2, 4864), "1.5B": (1536, 12, 2, 8960)}
bw = 4.8e12
for shape in sys.argv[1:] or ["0.5B", "1.5B"]:
    h, nq, nk, I = SH[shape]
    D = h // nq
    for M in (128, 64, 32):
        for name, N, K in (("qkv", (nq + 2 * nk) * D, h), ("o", h, h), ("gu", 2 * I, h), ("down", h, I)):
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** .5
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            copies = [w] + [w.clone() for _ in range(min(31, 2**28 // w.nbytes))]
            it = itertools.cycle(copies)
            t_cub = do_bench_cudagraph(lambda: x @ next(it).T, rep=20) * 1e3
            ref = (x @ w.T).float()
            ideal = (N * K + M * K + M * N) * 2 / bw * 1e6
            best = (1e9, None)
            for BM, BN, BK, S, st, wp in itertools.product((min(M, 64), M) if M > 64 else (M,), (32, 64, 128),
                                                         (64, 128), (1, 2, 4), (3, 4), (4, 8)):
                if N % BN or (BM + BN) * BK * 2 * st > 200 * 1024 or triton.cdiv(K, BK) < 2 * S:
                    continue
                if BM == 128 and wp == 4:
                    continue
                cfg = (BM, BN, BK, S, st, wp)
                y = torch.zeros(M, N, device="cuda", dtype=torch.float32 if S > 1 else torch.bfloat16)
                try:
                    run(x, w, y, cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 2e-2, err
                    t = do_bench_cudagraph(lambda: run(x, next(it), y, cfg), rep=10) * 1e3
                except Exception as e:
                    print("fail", cfg, str(e)[:80])
                    continue
                best = min(best, (t, cfg))
            print(f"{shape} M={M:4d} {name:5s} {N}x{K}: bytes {ideal:5.1f} us | cuBLAS {t_cub:5.1f} ({ideal/t_cub:.2f}) "
                  f"| triton {best[0]:5.1f} ({ideal/best[0]:.2f}) {best[1]}", flush=True)
