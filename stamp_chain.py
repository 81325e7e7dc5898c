"""
probe (issue 20): %globaltimer stamps inside decode_cuda's decode_gemv, over a layer's PDL-linked chain of its four
GEMMs (q|k|v, o, gate|up, down) for all layers, replayed from a CUDA graph: where each kernel's time goes after its
wait. The kernel's source is decode_cuda.source(d) with stamps spliced in (thread 0 of each CTA): 0 entry, 1 past
griddepcontrol.wait, 2 x in, 3 norm done, 4 first item's K loop done, 5 its epilogue done, 6 exit.

    python stamp_chain.py [0.5B|1.5B] [rows ...]
"""
import sys

import torch

import decode_cuda as dc

dev = torch.device("cuda")
SHAPES = dict(dc.SHAPES)


def mk(shape):
    H, I, nq, nkv, L = SHAPES[shape]
    D = H // nq
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, sc=0.02: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen) * sc  # noqa
    layers = [dict(qkv=r(H + 2 * nkv * D, H), b=r(H + 2 * nkv * D), o=r(H, H, sc=0.005), gu=r(2 * I, H),
                   down=r(H, I), n1=1 + r(H, sc=0.1), n2=1 + r(H, sc=0.1)) for _ in range(L)]
    return layers, r


# ---- stamped copy of the new kernel (cluster) -----------------------------------------------------------------
STAMP = ('#define STAMP(c) do { if (stamps && threadIdx.x == 0) { u64 t_; asm volatile("mov.u64 %0, %%globaltimer;"'
         ' : "=l"(t_)); stamps[blockIdx.x * 8 + (c)] = t_; } } while (0)\n')


def stamped_src(d):
    s = dc.source(d)
    rep = [("float* part, int* count, int M, int N, float eps)", "float* part, int* count, int M, int N, float eps, u64* stamps)"),
           ("    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;\n",
            "    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;\n    STAMP(0);\n"),
           ('    asm volatile("griddepcontrol.wait;" ::: "memory");   // PDL: the kernel before has finished, its writes visible\n',
            '    asm volatile("griddepcontrol.wait;" ::: "memory");\n    STAMP(1);\n'),
           ('    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // x is read: the next kernel may launch\n',
            '    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n    STAMP(2);\n'),
           ("    // mma fragments (PTX", "    STAMP(3);\n    // mma fragments (PTX"),
           ("        if (ch != NCH - 1) continue;\n", "        if (ch != NCH - 1) continue;\n        if (item == 0) STAMP(4);\n"),
           ("        __syncthreads();                                     // red is free again\n",
            "        if (item == 0) STAMP(5);\n        __syncthreads();                                     // red is free again\n"),
           ("        __syncthreads();                                     // red is free again\n    }\n}",
            "        __syncthreads();                                     // red is free again\n    }\n    STAMP(6);\n}")]
    for a, b in rep:
        assert s.count(a) == 1, a
        s = s.replace(a, b)
    i = s.index("extern \"C\"")
    return s[:i] + STAMP + s[i:]


SK = {}
PART = {k: torch.empty(k, 16, 8192, dtype=torch.float32, device=dev) for k in range(2, 9)}  # (KS, M, N)
LOG = []  # (kind, grid, stamps tensor view) per launch, in order


def stamped_gemm(x, w, b=None, g=None, residual=None, eps=1e-6, glu=False, kind="?"):
    (M, K), N = x.shape, w.shape[0] // (2 if glu else 1)
    d, grid = dc.plan(M, N, K, g is not None, glu, torch.cuda.get_device_properties(dev).multi_processor_count)
    key = tuple(sorted(d.items()))
    if key not in SK:
        k = torch.cuda._compile_kernel(stamped_src(d), "decode_gemv", nvcc_options=["-std=c++17"])
        k.set_shared_memory_config(dc.smem_bytes(d))
        SK[key] = (k, dc.smem_bytes(d))
    k, smem = SK[key]
    y = torch.empty(M, N, dtype=x.dtype, device=dev)
    st = STBUF[len(LOG)]
    LOG.append((kind, grid, st))
    dc.launch(k, smem, grid, d["NW"] * 32, [w, x, x.stride(0), g, b, residual,
                                           0 if residual is None else residual.stride(0), y, y.stride(0), PART[d["KS"]] if d["KS"] > 1 else None,
                                           dc.counters(dev, -(-N // 16)), M, N, float(eps), st])
    return y


def stamped_chain(layers, h):
    for p in layers:
        y = stamped_gemm(h, p["qkv"], p["b"], p["n1"], kind="qkv")
        h2 = stamped_gemm(y[:, :h.shape[1]], p["o"], None, None, h, kind="o")
        a = stamped_gemm(h2, p["gu"], None, p["n2"], None, 1e-6, True, kind="gu")
        h = stamped_gemm(a, p["down"], None, None, h2, kind="down")
    return h


def stamps(layers, h, L):
    global STBUF
    STBUF = torch.zeros(4 * L, 300, 8, dtype=torch.int64, device=dev)
    LOG.clear()
    stamped_chain(layers, h)  # compile
    torch.cuda.synchronize()
    LOG.clear()
    STBUF.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stamped_chain(layers, h)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    st = STBUF.cpu().double()
    per = {}
    prev_end = None
    for i, (kind, grid, _) in enumerate(LOG):
        s = st[i, :grid]
        ok = (s[:, 6] > 0)
        s = s[ok]
        w, e = s[:, 1].min(), s[:, 6].max()
        rec = per.setdefault(kind, [])
        med = lambda a, b: ((s[:, b] - s[:, a]).median() / 1e3).item()  # noqa
        rec.append(dict(link=((w - prev_end) / 1e3).item() if prev_end is not None else float("nan"),
                        prewait=med(0, 1), xin=med(1, 2), norm=med(2, 3), k0=med(3, 4), epi0=med(4, 5),
                        rest=med(5, 6), after=med(1, 6), span=((e - w) / 1e3).item(),
                        late=((s[:, 1].max() - w) / 1e3).item()))
        prev_end = e
    print("| GEMM | link (last end -> first past wait) | CTAs' wait spread | x in | norm | first K loop | its "
          "epilogue | other items | after the wait (median CTA) | first past wait -> last end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, recs in per.items():
        recs = recs[1:]
        m = {k: torch.tensor([r[k] for r in recs]).median().item() for k in recs[0]}
        print(f"| {kind} | {m['link']:.2f} | {m['late']:.2f} | {m['xin']:.2f} | {m['norm']:.2f} | {m['k0']:.2f} | "
              f"{m['epi0']:.2f} | {m['rest']:.2f} | {m['after']:.2f} | {m['span']:.2f} |", flush=True)


def main(shape="0.5B", rows=(8, 16)):
    layers, r = mk(shape)
    H, I, nq, nkv, L = SHAPES[shape]
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {shape}, us (medians over layers 1.., "
          f"of CTAs for the per-CTA columns; the timer ticks at 0.256 us)", flush=True)
    for M in rows:
        h = r(M, H, sc=1.0)
        t = dc.graph_us(lambda: dc.layer_chain(layers, h, dc.decode_linear_cuda)) / L
        print(f"{M} rows: the chain {t:.1f} us a layer", flush=True)
        stamps(layers, h, L)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["0.5B"]), tuple(int(a) for a in sys.argv[2:]) or (8, 16))
