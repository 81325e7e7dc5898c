"""
Benchmark of logprobs.py's implementations: log-prob + entropy through the LM head, forward and
backward (bf16 on a GPU, fp32 on a CPU) against a chunked fp32 (CPU: fp64) reference (`reference`,
also test_all's check), the four cuBLAS GEMMs of each shape (the floor any recompute scheme pays)
and Liger's fused loss if installed. Also the benchmarks' timing helpers (sync, free, time_ms).

    python bench_logprobs.py [SHAPE ...]
"""
import gc
import os
import sys
import time

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU runs the fused kernel interpreted

from logprobs import token_logprobs  # noqa: E402

# a shape is (name, N tokens, H, V)
GPU_SHAPES = [("Llama-3-8B", 16384, 4096, 128256), ("Qwen2.5-7B", 16384, 3584, 152064),
              ("Gemma-2-2B", 8192, 2304, 256000), ("Qwen2.5-0.5B", 32768, 896, 151936)]
CPU_SHAPES = [("tiny-cpu", 256, 128, 4096)]  # the fused kernel runs interpreted here
REF_ROWS = 1024  # reference chunk


def reference(hidden, weight, targets, temperature, g, g_ent, dtype):
    """logp, ent, dH, dW in `dtype` (fp32 on GPU without tf32, fp64 on CPU), rows in chunks."""
    w = weight.to(dtype)
    N = hidden.shape[0]
    logp, ent = (torch.empty(N, dtype=dtype, device=w.device),
                 torch.empty(N, dtype=dtype, device=w.device))
    dH, dW = torch.empty(hidden.shape, dtype=dtype, device=w.device), torch.zeros_like(w)
    for r0 in range(0, N, REF_ROWS):
        sl = slice(r0, r0 + REF_ROWS)
        h = hidden[sl].to(dtype)
        z = h @ w.t() / temperature  # (C, V)
        lse = torch.logsumexp(z, -1)
        lp = z - lse[:, None]
        p = lp.exp()
        logp[sl] = lp.gather(1, targets[sl, None])[:, 0]
        ent[sl] = -(p * lp).sum(-1)
        dz = -g[sl, None].to(dtype) * p
        dz.scatter_add_(1, targets[sl, None], g[sl, None].to(dtype))
        dz -= g_ent[sl, None].to(dtype) * p * (lp + ent[sl, None])
        dz /= temperature
        dH[sl] = dz @ w
        dW.addmm_(dz.t(), h)
        del z, lp, p, dz
    return logp, ent, dH, dW


def liger_logprobs(hidden, weight, targets, temperature=1.0):
    """Liger's fused linear cross-entropy (pip install liger-kernel), reduction="none": -logp per
    token. No entropy output, so its benchmark row does less work than ours; not one of IMPLS."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    h = hidden / temperature if temperature != 1.0 else hidden  # z = (h / T) @ W^T
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        h, weight, targets, None, None, -100, 0.0, 0.0, "none")[0]
    return -loss.float(), None


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():  # between benchmark rows: one's cached blocks do not count in the next's peak
    gc.collect()
    torch.cuda.empty_cache()  # (a no-op where CUDA never started)


def time_ms(fn, reps):
    """The median ms of reps calls of fn, after one untimed call (compiles, allocator warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_shape(name, N, H, V, dev, dtype, impls, reps, T=1.0):
    torch.manual_seed(0)
    hidden = torch.randn(N, H, device=dev, dtype=dtype).requires_grad_()
    # scaled so that the logits have std ~2
    weight = (torch.randn(V, H, device=dev, dtype=dtype) * (2.0 / H**0.5)).requires_grad_()
    targets = torch.randint(0, V, (N,), device=dev)
    g, g_ent = torch.randn(N, device=dev), torch.randn(N, device=dev)
    ref_dtype = torch.float32 if dev == "cuda" else torch.float64
    ref = reference(hidden.detach(), weight.detach(), targets, T, g, g_ent, ref_dtype)
    # the liger row has no entropy: its dH, dW are compared with the gradient of logp alone
    ref_logp_only = (reference(hidden.detach(), weight.detach(), targets, T, g,
                               torch.zeros_like(g_ent), ref_dtype)
                     if "liger" in impls else None)
    grad_bytes = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()

    def floor():  # x @ W^T, the recompute, dz @ W, dz^T @ x: four cuBLAS GEMMs of this shape
        z = hidden.detach() @ weight.detach().t()  # (N, V)
        z = torch.mm(hidden.detach(), weight.detach().t(), out=z)
        z @ weight.detach()
        z.t() @ hidden.detach()
    with torch.no_grad():
        floor_ms = time_ms(floor, reps)
    free()
    for impl in impls:
        def step():
            if impl == "liger":
                logp, ent = liger_logprobs(hidden, weight, targets, T)
            else:
                logp, ent = token_logprobs(hidden, weight, targets, T, True, impl)
            outs = (logp, ent) if ent is not None else (logp,)
            dH, dW = torch.autograd.grad(outs, (hidden, weight), (g, g_ent)[:len(outs)])
            return logp, ent, dH, dW
        row = dict(shape=name, N=N, H=H, V=V, impl=impl, floor_ms=round(floor_ms, 3))
        try:
            ms = time_ms(step, reps)  # (it ends synchronized)
            if dev == "cuda":
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            out = step()
            if dev == "cuda":
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base - grad_bytes) / 2**30
            else:
                peak = None  # no allocator statistics on a CPU
            want = ref_logp_only if impl == "liger" else ref
            errs = [None if a is None else rel_err(a, b) for a, b in zip(out, want)]
            row.update(ms=round(ms, 3), ratio=round(ms / floor_ms, 3),
                       peak_gib=peak and round(peak, 3),
                       err_logp=errs[0], err_ent=errs[1], err_dh=errs[2], err_dw=errs[3])
            del out
        except torch.cuda.OutOfMemoryError:
            row.update(oom=True)
        free()
        print(_fmt(row), flush=True)


def _fmt(r):
    head = f"{r['shape']:<13} {r['impl']:<8}"
    if r.get("oom"):
        return f"{head} {'OOM':>9}"
    errs = " ".join("      n/a" if r[k] is None else f"{r[k]:9.2e}"
                    for k in ("err_logp", "err_ent", "err_dh", "err_dw"))
    peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
    return f"{head} {r['ms']:9.2f} {r['floor_ms']:9.2f} {r['ratio']:6.3f} {peak:>8} {errs}"


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":  # the fp32 reference and fp32 paths must not silently use tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = GPU_SHAPES if dev == "cuda" else CPU_SHAPES
    only = [a for a in sys.argv[1:] if not a.startswith("-")]
    if only:
        shapes = [s for s in shapes if any(o in s[0] for o in only)]
    impls = ["naive", "chunked", "fused"]
    reps = 5 if dev == "cuda" else 1
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device={name} dtype={str(dtype).split('.')[-1]} torch={torch.__version__} "
          f"ms = median of {reps} fwd+bwd (entropy on, per-token grads for logp and ent); "
          f"floor = 4 cuBLAS GEMMs; peak = GiB beyond inputs and grads; "
          f"err = ||x - ref|| / ||ref|| vs {'fp32' if dev == 'cuda' else 'fp64'} reference")
    try:  # Liger: the fused kernel users compare with
        import liger_kernel  # noqa: F401
        impls.append("liger")
        print("(liger row: Liger's fused linear cross-entropy, reduction='none', "
              "logp only: no entropy work)")
    except ImportError:
        print("(liger_kernel not installed: no liger row)")
    print(f"{'shape':<13} {'impl':<8} {'ms':>9} {'floor_ms':>9} {'ratio':>6} {'peak_GiB':>8} "
          f"{'err_logp':>9} {'err_ent':>9} {'err_dH':>9} {'err_dW':>9}")
    for name_s, N, H, V in shapes:
        bench_shape(name_s, N, H, V, dev, dtype, impls, reps)


if __name__ == "__main__":
    main()
